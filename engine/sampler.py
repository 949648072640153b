"""Logits pipeline and sampling, vectorised over the batch.

`process_logits` turns raw logits into the distribution each request samples from (logit bias,
min_tokens, penalties, temperature, top-k, top-p, min-p, in that order, HF's warper order);
verification (engine/rejection.py) draws from it, plain decodes included (no drafts), so what
speculation verifies against is exactly what plain sampling would sample from.

Random draws use the exponential race (argmax of p / E with E ~ Exp(1)), which samples
categorically and lets a seeded request draw from its own generator wherever it sits in the
batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.device import host_tensor, to_device
from engine.request import Request, TokenHistory
from kernels import cpu as cpu_kernels

NEG_INF = float("-inf")


class RequestAt(TokenHistory):
    """A request as the logits pipeline sees it at draft position j: its tokens plus the first j
    drafts. Penalties and min_tokens bans for verifying draft j depend on the drafts before it,
    exactly as they would had those tokens been sampled one by one. The token list is built
    only when asked for (penalties): a verify step makes one view per draft row."""

    __slots__ = ("request", "drafts", "params", "eos_token_ids", "num_prompt_tokens")

    def __init__(self, request: Request, drafts: list[int]):
        self.request = request
        self.drafts = drafts
        self.params = request.params
        self.eos_token_ids = request.eos_token_ids
        self.num_prompt_tokens = request.num_prompt_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_ids + self.drafts

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.drafts)


@dataclass(slots=True)
class SamplingBatch:
    requests: list[Request | RequestAt]
    temperature: torch.Tensor  # [M]; 1.0 on greedy rows
    all_greedy: bool
    top_k: torch.Tensor | None  # [M] int64, vocab size where disabled
    max_top_k: int  # the largest of top_k (0 without top_k): the width of one topk
    top_p: torch.Tensor | None  # [M]
    min_p: torch.Tensor | None  # [M]

    @classmethod
    def from_requests(
        cls,
        requests: list[Request | RequestAt],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> SamplingBatch:
        """The batch's parameters as tensors on `device` (the logits' device), copied there
        without waiting for it."""
        params = [r.params for r in requests]
        greedy = [p.is_greedy for p in params]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        top_k = top_p = min_p = None
        max_top_k = 0
        if any(p.top_k for p in params):
            ks = [min(p.top_k or vocab_size, vocab_size) for p in params]
            top_k, max_top_k = host_tensor(ks), max(ks)
        if any(p.top_p < 1.0 for p in params):
            top_p = host_tensor([p.top_p for p in params], torch.float32)
        if any(p.min_p > 0.0 for p in params):
            min_p = host_tensor([p.min_p for p in params], torch.float32)
        batch = cls(
            requests=requests,
            temperature=host_tensor(temps, torch.float32),
            all_greedy=all(greedy),
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            min_p=min_p,
        )
        return to_device(batch, torch.device(device))


def apply_logit_bias_and_bans(logits: torch.Tensor, requests: list[Request]) -> None:
    """Logit bias, then min_tokens bans (EOS and stop token ids -inf until min_tokens outputs),
    for all rows at once: no step waits on the logits' device."""
    rows, ids, values = [], [], []
    for row, r in enumerate(requests):
        for token, value in r.params.logit_bias.items() if r.params.logit_bias else ():
            rows.append(row)
            ids.append(token)
            values.append(value)
    if rows:
        index = to_device((host_tensor(rows), host_tensor(ids)), logits.device)
        bias = to_device(host_tensor(values, torch.float32), logits.device)
        logits.index_put_(index, bias.to(logits.dtype), accumulate=True)
    rows, ids, banned_rows = [], [], []
    for row, r in enumerate(requests):
        if r.num_output_tokens < r.params.min_tokens:
            banned = list(r.eos_token_ids) + list(r.params.stop_token_ids)
            if banned:
                rows += [len(banned_rows)] * len(banned)
                ids += banned
                banned_rows.append(row)
    if not rows:
        return
    which, ids, banned_rows = to_device(
        (host_tensor(rows), host_tensor(ids), host_tensor(banned_rows)), logits.device
    )
    index = (banned_rows[which], ids)  # ([N], [N]): every (row, banned token)
    kept = logits[index]  # [N]
    logits[index] = NEG_INF
    # A grammar that can only end here wins over min_tokens: such a row gets its bans back.
    alive = torch.isfinite(logits[banned_rows]).any(dim=-1)  # [rows with bans]
    logits[index] = torch.where(alive[which], NEG_INF, kept)


def _row_id_table(lists: list[list[int]], device: torch.device) -> torch.Tensor:
    """[len(lists), longest] int64 on device: each (non-empty) list padded with its own first
    id, so a gather and a scatter back over a row touch only ids of that row."""
    width = max(map(len, lists))
    flat = []
    for ids in lists:
        flat += ids
        flat += ids[:1] * (width - len(ids))
    return to_device(host_tensor(flat).view(len(lists), width), device)


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> None:
    """Repetition (HF: over prompt + output), presence and frequency (OpenAI: output only),
    over the rows that have them at once, touching only the ids each row has seen (an id
    seen twice, or padding, is read twice and written twice with the same value)."""
    device = logits.device
    rep = [i for i, r in enumerate(requests) if r.params.repetition_penalty != 1.0]
    if rep:
        ids = _row_id_table([requests[i].token_ids for i in rep], device)  # [rep, L]
        penalty = [requests[i].params.repetition_penalty for i in rep]
        rows, penalty = to_device(
            (host_tensor(rep)[:, None], host_tensor(penalty, torch.float32)[:, None]), device
        )
        vals = logits[rows, ids]  # [rep, L]
        logits[rows, ids] = torch.where(vals > 0, vals / penalty, vals * penalty)
    counted = [
        i
        for i, r in enumerate(requests)
        if (r.params.presence_penalty or r.params.frequency_penalty) and r.num_output_tokens
    ]
    if counted:
        ids = _row_id_table([requests[i].output_token_ids for i in counted], device)  # [c, L]
        counts = torch.zeros(len(counted), logits.shape[1], dtype=logits.dtype, device=device)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))
        counts = counts.gather(1, ids)  # [c, L]: how often each row's id occurs in its output
        params = [requests[i].params for i in counted]
        rows, frequency, presence = to_device(
            (
                host_tensor(counted)[:, None],
                host_tensor([p.frequency_penalty for p in params], torch.float32)[:, None],
                host_tensor([p.presence_penalty for p in params], torch.float32)[:, None],
            ),
            device,
        )
        logits[rows, ids] = logits[rows, ids] - (frequency * counts + presence * (counts > 0))


def keeps_argmax(request: Request) -> bool:
    """Whether process_logits and the grammar mask leave this request's argmax where its raw
    logits have it: no logit bias, penalties or grammar, and min_tokens reached (its bans end
    once it has min_tokens outputs; drafts only add outputs). Temperature, top-k, top-p and
    min-p always keep the largest logit."""
    p = request.params
    return (
        not p.logit_bias
        and not p.has_penalties
        and request.num_output_tokens >= p.min_tokens
        and request.grammar is None
    )


def argmax_suffices(request: Request) -> bool:
    """Whether this request's next tokens (and its drafts' verdicts) are its raw logits' argmax
    and nothing more is needed from its rows: greedy, no logprobs, keeps_argmax."""
    return request.params.is_greedy and request.params.logprobs is None and keeps_argmax(request)


def argmax_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] -> each row's argmax [R] (torch's: the first maximal index) and whether
    it holds a NaN [R], in one read on CPUs with Tandem's kernels (kernels/cpu/argmax.cpp:
    torch's two passes cost ~1 ms over a 262k vocabulary); a NaN row's index means nothing."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and cpu_kernels.load():
        return torch.ops.tandem_cpu.argmax_rows(logits)
    return logits.argmax(dim=-1), logits.isnan().any(dim=-1)


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[M, V] raw logits -> [M, V] logits of the distribution to sample (-inf = excluded).
    Greedy rows are left unscaled: their argmax is taken directly."""
    logits = logits.clone()
    apply_logit_bias_and_bans(logits, batch.requests)
    apply_penalties(logits, batch.requests)
    if batch.all_greedy:
        return logits
    logits.div_(batch.temperature[:, None])
    if batch.top_k is not None:
        kth = logits.topk(batch.max_top_k, dim=-1).values  # [M, max_k]
        cutoff = kth.gather(1, (batch.top_k.clamp(max=kth.shape[1]) - 1)[:, None])
        logits.masked_fill_(logits < cutoff, NEG_INF)
    if batch.top_p is not None:
        logits.masked_fill_(top_p_drop(logits, batch.top_p), NEG_INF)
    if batch.min_p is not None:
        probs = logits.softmax(-1)
        threshold = batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits.masked_fill_(probs < threshold, NEG_INF)
    return logits


# Top-p on CPU looks at this many of the most likely tokens first: a sort of SmolLM2's 49152
# logits costs many times a top-256 there, and at temperature 0.8 the top 256 hold top_p = 0.95
# of the mass at most of SmolLM2's positions (bench.choices measures both).
TOP_P_CANDIDATES = 256


def _top_p_drop_sorted(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[M, V] bool: the tokens whose more likely tokens (in sorted order) already hold top_p
    of the mass; never the most likely one, nothing where top_p is 1 (where float32 sums
    reach 1.0 early, the tail would go)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    drop_sorted = (probs.cumsum(-1) - probs) >= top_p[:, None]  # mass strictly before
    drop_sorted[:, 0] = False
    drop_sorted &= (top_p < 1.0)[:, None]
    return torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)


def top_p_drop(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[M, V] bool, the tokens top-p excludes (rows with top_p 1 keep everything but what is
    already excluded). On CPU from the TOP_P_CANDIDATES most likely tokens of each row, every
    token past them dropped, where those hold top_p of the mass; the other rows are sorted in
    full. Elsewhere (one sort is cheap there, and a row-by-row decision would wait for the
    device) the full sort for every row."""
    vocab = logits.shape[1]
    if logits.device.type != "cpu" or vocab <= TOP_P_CANDIDATES:
        return _top_p_drop_sorted(logits, top_p)
    probs, ids = logits.softmax(-1).topk(TOP_P_CANDIDATES, dim=-1)  # [M, C], sorted
    cum = probs.cumsum(-1)
    drop_top = (cum - probs) >= top_p[:, None]
    drop_top[:, 0] = False
    drop = torch.ones_like(logits, dtype=torch.bool).scatter_(1, ids, drop_top)
    # The first token past the candidates is dropped iff the candidates hold top_p; rows
    # with top_p 1 drop nothing.
    drop[top_p >= 1.0] = False
    unresolved = ((cum[:, -1] < top_p) & (top_p < 1.0)).nonzero()[:, 0].tolist()
    if unresolved:
        drop[unresolved] = _top_p_drop_sorted(logits[unresolved], top_p[unresolved])
    return drop


def exponential_noise(
    *shape: int, generator: torch.Generator | None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Exp(1) draws as -log U, U ~ U[0, 1) in float32 (U = 0 gives inf: that token sits the
    draw out, a 2^-24 effect). On CPU several times faster than Tensor.exponential_, which
    draws in double (bench.choices), the largest cost of a sampled row there."""
    return torch.rand(*shape, generator=generator, device=device).log_().neg_()


def race_noise(
    generators: list[torch.Generator | None],  # [M] a row's own (seeded) generator, or None
    vocab: int,
    generator: torch.Generator | None,  # shared by the rows without their own
    device: torch.device | str = "cpu",
) -> torch.Tensor:  # [M, V] Exp(1)
    """The exponential race's noise for M rows: the rows without a generator in one batched
    draw, then each seeded row V exponentials from its own generator, in row order."""
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        return exponential_noise(len(unseeded), vocab, generator=generator, device=device)
    noise = torch.empty(len(generators), vocab, device=device)
    if unseeded:  # (indices copied like every step input: a list index would wait for the GPU)
        at = to_device(host_tensor(unseeded), torch.device(device))
        noise[at] = exponential_noise(len(unseeded), vocab, generator=generator, device=device)
    for i, g in enumerate(generators):
        if g is not None:
            noise[i] = exponential_noise(vocab, generator=g, device=device)
    return noise


# token id -> (logprob, rank) at one position: the chosen token's, then the top n
RawLogprobs = dict[int, tuple[float, int]]


@dataclass
class TopLogprobs:
    """Logprobs of M rows, gathered where the logits are: the chosen token's logprob [M] and
    rank [M] (1 = most likely), the top n values and ids [M, n]. The same tensors on the host
    give `entries`."""

    chosen: torch.Tensor
    rank: torch.Tensor
    values: torch.Tensor
    ids: torch.Tensor

    @classmethod
    def gather(
        cls,
        logprobs: torch.Tensor,  # [M, V] log-softmax of the raw logits
        token_ids: torch.Tensor,  # [M] the token each row emitted
        num_top: int,
    ) -> TopLogprobs:
        chosen = logprobs.gather(1, token_ids[:, None])[:, 0]
        rank = (logprobs > chosen[:, None]).sum(-1) + 1
        values, ids = logprobs.topk(num_top, dim=-1)
        return cls(chosen, rank, values, ids)

    def entries(self, picks: list[tuple[int, int, int]]) -> list[RawLogprobs]:
        """Host tensors only. picks: (row, token the row emitted, n): per pick, the token's
        (logprob, rank) and the row's top n."""
        chosen, rank = self.chosen.tolist(), self.rank.tolist()
        values, ids = self.values.tolist(), self.ids.tolist()
        out = []
        for row, token, num_top in picks:
            entry = {token: (chosen[row], rank[row])}
            for k in range(num_top):
                entry.setdefault(ids[row][k], (values[row][k], k + 1))
            out.append(entry)
        return out

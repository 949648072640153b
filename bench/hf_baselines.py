"""HF transformers baselines for the throughput benchmarks: `generate` one request at a time,
static left-padded batches, and transformers' own continuous batching (the manager behind
`generate_batch`). Each `*_mode` is a harness mode (bench/harness.py): a callable that runs the
whole workload once and returns its Run (wall seconds, output tokens per second, the token ids of
every request in order); model loading, cache allocation and the CB manager's start-up are
outside it.

HF ignores EOS through an unreachable eos_token_id (`generate`) or eos_token_id=-1 (continuous
batching): every request generates exactly its own output length without touching the logits.
`min_new_tokens` would instead mask EOS out of the argmax and change greedy tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from bench.harness import Run
from bench.workload import MODEL, ModeResult, Workload, workload_run

# HF's fastest setting on this CPU, measured by the suite's hf-settings group (bench/RESULTS.md):
# sdpa attention, the default dynamic cache. That group fails when another setting is faster.
HF_FASTEST = {"attn_implementation": "sdpa", "cache_implementation": None}
EOS_DISABLED = -1  # transformers continuous batching: no EOS token
PAGE_SIZE = 256  # tokens per KV block in transformers continuous batching (its default)


def load_hf_model(attn_implementation: str = HF_FASTEST["attn_implementation"]):
    """SmolLM2 in fp32 through transformers, at HF_FASTEST's attention unless told."""
    from transformers import AutoModelForCausalLM

    from engine.models.registry import resolve_model

    model = AutoModelForCausalLM.from_pretrained(
        str(resolve_model(MODEL)), dtype=torch.float32, attn_implementation=attn_implementation
    )
    return model.eval()


def _unreachable_eos(model) -> int:
    """An EOS id the model can never emit: `generate` then runs exactly max_new_tokens and, unlike
    min_new_tokens, never masks the real EOS out of the argmax (the engine's ignore_eos). The
    attention mask is always passed explicitly, so HF does not infer one from pad != eos."""
    return int(model.config.vocab_size)


def eos_id(model) -> int:
    eos = model.generation_config.eos_token_id
    if isinstance(eos, list):
        eos = eos[0]
    return int(eos if eos is not None else model.config.eos_token_id)


@torch.inference_mode()
def generate(
    model, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool = True, **kwargs
) -> list[list[int]]:
    """`generate` over left-padded prompts (pad = EOS, masked out): the new token ids per row,
    greedy and at HF_FASTEST's cache unless `kwargs` say otherwise (do_sample, a streamer, a
    logits processor, PEFT's adapter_names, cache_implementation=None for the dynamic cache).
    Left padding keeps every row's last prompt token in the last column, where generation starts;
    HF shifts the position ids by the mask, so each row sees its own positions 0.. ignore_eos:
    exactly max_new_tokens per row (the engine's ignore_eos), else HF's own EOS stops a row."""
    eos = eos_id(model)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), eos, dtype=torch.long)  # [B, width]
    mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, width]
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    kwargs.setdefault("do_sample", False)
    if kwargs.setdefault("cache_implementation", HF_FASTEST["cache_implementation"]) is None:
        del kwargs["cache_implementation"]  # HF's default: the dynamic cache
    if ignore_eos:
        kwargs["eos_token_id"] = _unreachable_eos(model)
    out = model.generate(  # [B, width + new]
        ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=eos, **kwargs
    )
    return out[:, width:].tolist()


def hf_seq_mode(model, wl: Workload, limit: int | None = None) -> Callable[[], Run]:
    """`generate` one request at a time (batch 1): the first `limit` requests (default all)."""
    n = len(wl.prompts) if limit is None else min(limit, len(wl.prompts))

    def run() -> Run:
        t0 = time.perf_counter()
        outputs = []
        for prompt, length in zip(wl.prompts[:n], wl.out_lens[:n], strict=True):
            outputs += generate(model, [prompt], length)
        return workload_run(time.perf_counter() - t0, outputs, extrapolated=n < len(wl.prompts))

    return run


def run_hf_seq(model, wl: Workload, limit: int | None) -> ModeResult:
    """One warm-up request, then one pass of hf_seq_mode (bench/server.py's HF side)."""
    generate(model, [wl.prompts[0][:16]], 4)
    run = hf_seq_mode(model, wl, limit)()
    res = ModeResult("hf_seq", seconds=run.metrics["seconds"])
    res.outputs = dict(enumerate(run.outputs))
    res.tally(wl)
    if res.num_requests < len(wl.prompts):
        res.extrapolated = True
        res.notes.append(
            f"timed the first {res.num_requests} of {len(wl.prompts)} requests; "
            "tokens/s extrapolated to all"
        )
    return res


def hf_static_mode(model, wl: Workload, batch_size: int) -> Callable[[], Run]:
    """`generate` on static batches in arrival order, left padded: every batch runs to its
    longest output and each request keeps only its own length (only useful tokens count)."""
    starts = range(0, len(wl.prompts), batch_size)
    batches = [range(i, min(i + batch_size, len(wl.prompts))) for i in starts]

    def run() -> Run:
        outputs, computed = [], 0
        t0 = time.perf_counter()
        for batch in batches:
            new = max(wl.out_lens[i] for i in batch)
            rows = generate(model, [wl.prompts[i] for i in batch], new)
            outputs += [rows[row][: wl.out_lens[i]] for row, i in enumerate(batch)]
            computed += len(batch) * new
        seconds = time.perf_counter() - t0
        useful = sum(map(len, outputs)) / computed
        return workload_run(seconds, outputs, batch_size=batch_size, useful_share=useful)

    return run


class ContinuousBatching:
    """transformers' continuous batching as a mode. `generate_batch` takes one max_new_tokens for
    all requests, so the manager behind it is driven directly: one `add_request` per request
    with its own max_new_tokens and EOS disabled. The manager is built, warmed up and started
    once (outside every timing) and serves every pass; `close()` stops it. Its prefix sharing is
    off, like ours: a pass would otherwise reuse the KV of the previous pass's identical prompts.
    Its cache holds the whole workload at once: the default reserves 60% of free memory, slow
    to allocate and measured no faster.
    When the manager API is missing (another transformers version) each pass is one
    `generate_batch` at the longest length, extra tokens discarded."""

    def __init__(self, model, wl: Workload):
        from transformers import GenerationConfig

        self.model, self.wl, self.passes = model, wl, 0
        max_new = max(wl.out_lens)
        self.gen_cfg = GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=EOS_DISABLED,
            pad_token_id=eos_id(model),
        )
        try:
            from transformers import ContinuousBatchingConfig
            from transformers.generation.continuous_batching.utils import WorkloadHints

            # Room for every request's prompt and output at once, and one block of slack each.
            pairs = zip(wl.prompts, wl.out_lens, strict=True)
            num_blocks = sum(-(-(len(p) + n) // PAGE_SIZE) + 1 for p, n in pairs)
            hints = WorkloadHints(
                max_prompt_length=max(len(p) for p in wl.prompts),
                max_generated_length=max_new,
                num_requests=len(wl.prompts),
            )
            self.manager = model.init_continuous_batching(
                generation_config=self.gen_cfg,
                continuous_batching_config=ContinuousBatchingConfig(
                    page_size=PAGE_SIZE, num_blocks=num_blocks, allow_block_sharing=False
                ),
                workload_hints=hints,
            )
        except (ImportError, AttributeError, TypeError):
            self.manager = None
            return
        self.manager.warmup()
        self.manager.start()

    @torch.no_grad()  # not inference_mode: the CB thread updates its static tensors in place
    def __call__(self) -> Run:
        self.passes += 1
        if self.manager is None:
            return self._generate_batch()
        ids = [f"p{self.passes}-r{i}" for i in range(len(self.wl.prompts))]
        t0 = time.perf_counter()
        for rid, prompt, n in zip(ids, self.wl.prompts, self.wl.out_lens, strict=True):
            self.manager.add_request(prompt, rid, max_new_tokens=n, eos_token_id=EOS_DISABLED)
        results = _collect(self.manager, set(ids))
        seconds = time.perf_counter() - t0
        outputs = [list(results[rid].generated_tokens) for rid in ids]
        cfg = self.manager.continuous_batching_config
        info = {"page_size": cfg.page_size, "max_batch_tokens": cfg.max_batch_tokens}
        return workload_run(seconds, outputs, **info)

    def _generate_batch(self) -> Run:
        t0 = time.perf_counter()
        out = self.model.generate_batch(inputs=self.wl.prompts, generation_config=self.gen_cfg)
        seconds = time.perf_counter() - t0
        pairs = zip(out.values(), self.wl.out_lens, strict=True)
        outputs = [list(r.generated_tokens)[:n] for r, n in pairs]
        return workload_run(seconds, outputs, uniform_length=True)

    def close(self) -> None:
        if self.manager is not None:
            self.manager.stop(block=True)
            self.manager.destroy()
            self.manager = None


def _collect(manager, wanted: set[str], timeout_s: float = 3600.0) -> dict:
    results = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < len(wanted):
        if time.monotonic() > deadline:
            raise TimeoutError(f"continuous batching: {len(results)}/{len(wanted)} finished")
        r = manager.get_result(timeout=1)
        if r is None:
            if not manager.is_running():
                raise RuntimeError("continuous batching thread stopped")
            continue
        if r.is_finished() and r.request_id in wanted:
            if r.error is not None:
                raise RuntimeError(f"request {r.request_id} failed: {r.error}")
            results[r.request_id] = r
    return results

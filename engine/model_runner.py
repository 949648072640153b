"""Model runner: one flat batch per step over the paged KV cache, then logits and sampling.

Owns the KV tensors. `launch` takes the scheduler's decision, builds the inputs (token ids,
positions, slot mapping, attention metadata), runs the model and samples the rows that are
caught up, all queued on the device; `LaunchedStep.wait()` brings plain Python results back
(the one host sync of the step), now or, under async scheduling, after the next step is
launched.

Inputs are built on the host and copied to the model's device; the KV cache and the weights live
there (CUDA: bf16 by default). Sampling runs where the logits are: greedy requests that nothing
reshapes (no bias, penalties, bans, grammar or logprobs) take their rows' argmax; the others go
through grammar masks, the logits pipeline and batched verification (engine.rejection.
verify_batched; the fused Triton kernel with the Triton backend) in float32, and their logprobs
are gathered there, as are prompt logprobs. Only token ids, acceptance counts and the
logprobs asked for come back, in one copy that waits for the device once. Random draws come
from generators on the logits' device: a seeded request reproduces its tokens on one kind of
device (CPU and CUDA draw differently).

A step of one greedy token per request that nothing reshapes, on a model whose C++ layer stack
holds its ends (the quantized CPU path), is one call from embedding to argmax
(LayerStack.decode): one step, or with lookahead slots (EngineConfig.num_scheduler_steps)
several, each fed the last one's tokens.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from engine.attention import slot_ids
from engine.backends import TORCH, Backend
from engine.cuda_graphs import GraphRunner
from engine.device import host_tensor, to_device
from engine.inputs import (
    FlatInputs,
    ForwardItem,
    SampledTokens,
    fill_pending,
    flat_inputs,
    pending_inputs,
)
from engine.models import kv_cache
from engine.models.causal_lm import CausalLM
from engine.models.config import ModelConfig
from engine.rejection import (
    VerifyRow,
    verify_batched,
)
from engine.request import Request
from engine.sampler import (
    RequestAt,
    SamplingBatch,
    TopLogprobs,
    argmax_rows,
    argmax_suffices,
    process_logits,
)
from engine.scheduler import SchedulerOutput
from engine.step_results import DeviceResults, LaunchedStep, PendingStep, PromptAsk
from lora.batch import LoRABatch, LoRASlots


def mask_logits(masker, logits: torch.Tensor, rows: list[tuple[Request, list[int]]]) -> None:
    """masker(logits [R, V], rows) in place. If it raises, again one request at a time: only
    the requests whose own masks fail are marked failed (Request.fail, their rows are dropped
    later); everyone else's rows are masked as usual. Masking is idempotent, so rows a failed
    call masked already are safe to mask again."""
    try:
        masker(logits, rows)
        return
    except Exception:
        pass
    by_request: dict[Request, list[int]] = {}
    for i, (request, _) in enumerate(rows):
        by_request.setdefault(request, []).append(i)
    for request, idx in by_request.items():
        part = logits[idx]  # [len(idx), V], a copy
        try:
            masker(part, [rows[i] for i in idx])
        except Exception as exc:
            request.fail("grammar", exc)
            continue
        logits[idx] = part


class ModelRunner:
    """A model and its paged KV cache. The target and a draft model each have one; both
    address their caches with the same block tables."""

    def __init__(
        self,
        model: CausalLM,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        backend: Backend = TORCH,
        kv_format: torch.dtype | None = None,  # the cache's elements (models.kv_cache); None: dtype
    ):
        self.model = model
        self.cfg = cfg
        self.windows = cfg.windows  # the layers' distinct attention windows
        self.block_size = block_size
        self.backend = backend  # the torch references or the Triton kernels
        if backend.name != "torch":  # Triton attends a dense model's rows, not the C++ layers
            model.fuse(dense=False)
        weight = model.norm.weight  # (packed or quantized layers keep no dense weight)
        self.device, self.dtype = weight.device, weight.dtype
        # [num_layers, 2 (K, V), Hkv, num_blocks, block_size, D]; int8: kv_cache.Int8Caches
        self.kv_caches = kv_cache.allocate(
            cfg, num_blocks, block_size, kv_format or self.dtype, self.device
        )
        self.generator = torch.Generator(self.device).manual_seed(0)  # unseeded requests' draws
        # Constrained decoding: masker(logits [R, V], [(request, drafts before row i)]) in place.
        self.logits_masker = None
        self.lora_slots: LoRASlots | None = None  # adapter slots, when LoRA is enabled
        self.graphs: GraphRunner | None = None  # decode/verify steps from static buffers
        self.lora_of = lambda request: request.lora  # which of a request's adapters runs here
        # Async scheduling: keep each step's sampled tokens on the device (`sampled`, the last
        # launched step's) for the next step's inputs.
        self.keep_sampled = False
        self.sampled: SampledTokens | None = None
        # Tensor parallelism: the other ranks (engine.distributed.tensor_parallel.Workers), told of
        # every forward's inputs and every block copy before this rank runs it.
        self.workers = None

    def use_graphs(self, max_num_seqs: int, max_model_len: int, max_query_len: int) -> None:
        """Decode and verification steps (up to max_query_len tokens per request, no adapter)
        from static buffers: CUDA graphs on CUDA; on CPU the same padded forward, eagerly."""
        if not self.backend.static_buffers:
            raise ValueError(f"graphs need the Triton attention backend, got {self.backend.name!r}")
        self.graphs = GraphRunner(
            self.model,
            self.kv_caches,
            self.block_size,
            max_num_seqs,
            max_model_len,
            max_query_len,
            self.windows,
            capture=self.device.type == "cuda",
        )

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        if self.workers is not None:
            self.workers.copy_blocks(copies)
        src, dst = (
            to_device(torch.tensor(c, dtype=torch.long), self.device)
            for c in zip(*copies, strict=True)
        )
        kv_cache.copy_blocks(self.kv_caches, src, dst)

    @torch.inference_mode()
    def forward(self, items: list[ForwardItem], tables: dict[Request, list[int]]) -> torch.Tensor:
        """Run every item's tokens in one flat batch; returns hidden states [sum(len), hidden]."""
        token_slots = self._token_slots(items) if self.lora_slots is not None else None
        lora = token_slots and self.backend.lora_batch(self.lora_slots, token_slots)
        if lora is None and self.graphs is not None and self.graphs.fits(items):
            return self.graphs.forward(items, tables, self.sampled)
        flat = flat_inputs(items, tables, self.block_size)
        if self.workers is not None:
            self.workers.forward(flat, self._placed(), token_slots)
        return self.forward_flat(flat, lora, pending_inputs(items))

    def _placed(self) -> list:
        """The adapter slot changes since the last call (tensor parallelism tells the others)."""
        slots = self.lora_slots
        if slots is None:
            return []
        placed, slots.placed = slots.placed, []
        return placed

    def forward_flat(
        self,
        flat: FlatInputs,
        lora: LoRABatch | None = None,
        pending: tuple[list[int], list[int]] | None = None,
    ) -> torch.Tensor:
        """The forward of flat inputs (a tensor-parallel worker runs rank 0's this way); pending:
        inputs still on the device (async scheduling)."""
        slots = host_tensor(flat.slots)
        rows = self.model.fused_layers
        meta = self.backend.metadata(flat, slots, self.block_size, self.windows, rows)
        ids, pos = host_tensor(flat.input_ids), host_tensor(flat.positions)
        ids, pos, meta, lora = to_device((ids, pos, meta, lora), self.device)
        if pending is not None:
            fill_pending(ids, pending, self.sampled)
        return self.model(ids, pos, self.kv_caches, meta, lora)

    def device_logits(self, hidden: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
        """[len(rows) or M, vocab] in the model's dtype, on its device. hidden: the whole
        forward's [M, hidden] (tensor-parallel workers pick the same rows of theirs)."""
        if rows is not None:
            hidden = hidden[to_device(host_tensor(rows), self.device)]
        if self.workers is not None:  # their shares of the vocabulary, for the same rows
            self.workers.logits(rows)
        return self.model.lm_head(hidden)[:, : self.cfg.vocab_size]

    def _token_slots(self, items: list[ForwardItem]) -> list[int] | None:
        """Each token row's adapter slot (0: none), the step's adapters made resident; None
        when no item has an adapter."""
        loras = [self.lora_of(item.request) for item in items]
        adapters = list({id(a): a for a in loras if a is not None}.values())
        if not adapters:
            return None
        slot_of = self.lora_slots.activate(adapters)
        token_slots = []
        for item, lora in zip(items, loras, strict=True):
            token_slots += [slot_of[id(lora)] if lora else 0] * len(item.token_ids)
        return token_slots

    def launch(self, sched: SchedulerOutput, tables: dict[Request, list[int]]) -> LaunchedStep:
        """The target's step, scheduled tokens plus each request's drafts, then verification,
        queued without waiting for the device: its results are copied to the host when they
        are ready, and LaunchedStep.wait() collects them. Its sampled tokens stay on the
        device too (`sampled`) when kept, for the next step's inputs."""
        if sched.block_copies:
            self.copy_blocks(sched.block_copies)
        items, verify_rows, row = [], [], 0
        for request, n, k in sched.scheduled():
            start = request.num_computed_tokens
            base = n - k  # tokens of the request itself; the rest of the row count is drafts
            drafts = sched.drafts_of(request)
            tokens = request.token_ids[start : start + base]
            last_from = None
            if len(tokens) < base:  # its last token was sampled by the step in flight
                if len(tokens) != base - 1 or drafts or request not in self.sampled.row_of:
                    raise RuntimeError(f"request {request.request_id}: tokens not on the host")
                last_from = self.sampled.row_of[request]
                tokens.append(0)
            items.append(ForwardItem(request, start, tokens + drafts, last_from))
            row += base + len(drafts)
            if start + base == request.num_tokens + request.num_pending:
                q = sched.draft_probs.get(request)
                verify_rows.append((request, row - 1 - len(drafts), drafts, q))
        if len(verify_rows) == len(items) and all(self._decodes(item) for item in items):
            # one C++ call, no torch ops around it (inference mode costs ~30 us to enter
            # and leave with the caches cold)
            steps = 1 + min(sched.num_drafts) if sched.lookahead else 1
            return LaunchedStep(self._decode(items, tables, steps), self.device)
        return LaunchedStep(self._forward_and_sample(items, verify_rows, tables), self.device)

    @torch.inference_mode()
    def _forward_and_sample(self, items, verify_rows, tables) -> PendingStep:
        hidden = self.forward(items, tables)
        pending = self._sample(hidden, verify_rows)
        self._prompt_logprobs(hidden, items, pending)
        return pending

    def decodes(self, request: Request) -> bool:
        """Whether the request's next tokens can come from LayerStack.decode (embedding to
        argmax in one C++ call): greedy, nothing reshapes its logits, no adapter, no prompt
        logprobs or forks, on a model whose stack decodes, one process, no graphs."""
        stack = self.model.stack
        return (
            stack is not None
            and stack.decodes
            and self.graphs is None
            and self.workers is None
            and not self.keep_sampled
            and not request.siblings
            and request.params.prompt_logprobs is None
            and (self.lora_slots is None or self.lora_of(request) is None)
            and argmax_suffices(request)
        )

    def _decodes(self, item: ForwardItem) -> bool:
        return len(item.token_ids) == 1 and item.last_from is None and self.decodes(item.request)

    def _decode(self, items: list[ForwardItem], tables, steps: int) -> PendingStep:
        """One token per request, then steps - 1 more (lookahead slots), in one call: the
        members' tokens [B, steps]. Each row sees its own request's blocks up to itself."""
        bs = self.block_size
        starts = [item.start for item in items]
        own = [tables[item.request] for item in items]
        slots = [s for table, start in zip(own, starts, strict=True)
                 for s in slot_ids(table, start, steps, bs)]  # fmt: skip
        needs = [-(-(start + steps) // bs) for start in starts]  # blocks each row reads
        width, flat = max(needs), []
        for table, need in zip(own, needs, strict=True):
            flat += table[:need]
            flat += [0] * (width - need)  # the null block
        ids = [item.token_ids[0] for item in items]
        tokens, is_nan = self.model.stack.decode(ids, starts, self.kv_caches, slots, flat)
        self.sampled = None
        pending = PendingStep(DeviceResults(decoded=tokens, is_nan=is_nan))
        pending.members = [item.request for item in items]
        return pending

    def _sample(self, hidden: torch.Tensor, verify_rows) -> PendingStep:
        """verify_rows: (request, row of its last real token, its drafts, their q or None); the
        drafts' rows follow the last real token's. Queues the sampling (and verification) of
        every request that samples; keeps their tokens on the device if keep_sampled."""
        rows: list[int] = []
        pending = PendingStep(DeviceResults())
        spans, members = pending.spans, pending.members
        for request, row, drafts, q in verify_rows:
            spans.append(self._span(len(rows), request, drafts, q))
            members.append(request)
            rows.extend(range(row, row + len(drafts) + 1))
            if request.siblings and request.num_output_tokens == 0:
                # n > 1: the siblings sample their first token from the leader's logits.
                for sibling in request.siblings:
                    spans.append(self._span(len(rows), sibling, [], None))
                    members.append(sibling)
                    rows.append(row)
        self.sampled = None
        if not rows:
            return pending
        # Greedy rows that nothing reshapes need only argmax; the rest are masked and verified.
        pending.fast = [argmax_suffices(m) for m in members]
        pending.slow = [i for i, fast in enumerate(pending.fast) if not fast]
        logits = self.device_logits(hidden, rows)  # [R, V] on the device
        argmax, pending.device.is_nan = argmax_rows(logits)  # [R] each; a NaN row fails alone
        if any(pending.fast):
            pending.device.argmax = argmax
        if pending.slow:
            slow_rows = [r for i in pending.slow for r in range(spans[i].start, spans[i].end)]
            if len(slow_rows) < len(rows):
                logits = logits[to_device(host_tensor(slow_rows), self.device)]
            self._verify(logits.float(), pending)
        if self.keep_sampled and not any(span.drafts for span in spans):
            self.sampled = self._sampled_tokens(pending)
        return pending

    def _span(self, start: int, request: Request, drafts: list[int], q) -> VerifyRow:
        """A request's rows in the verification batch from `start`; a greedy request draws
        nothing, so it gets no generator."""
        greedy = request.params.is_greedy
        gen = None if greedy else request.generator_on(self.device)
        return VerifyRow(start, drafts, q if drafts else None, greedy, gen)

    def _sampled_tokens(self, pending: PendingStep) -> SampledTokens:
        """Every member's one token on the device (no drafts): its row's argmax, or what
        verification emitted for it."""
        members, spans = pending.members, pending.spans
        tokens = torch.empty(len(members), dtype=torch.long, device=self.device)  # [M]
        fast = [i for i, f in enumerate(pending.fast) if f]
        if fast:
            at, rows = to_device(
                (host_tensor(fast), host_tensor([spans[i].start for i in fast])), self.device
            )
            tokens[at] = pending.device.argmax[rows]
        if pending.slow:
            at = to_device(host_tensor(pending.slow), self.device)
            tokens[at] = pending.device.tokens[:, 0].long()
        return SampledTokens(tokens, {m: i for i, m in enumerate(members)})

    def _verify(self, logits: torch.Tensor, pending: PendingStep) -> None:
        """Grammar masks, the logits pipeline, verification and the logprobs asked for, queued
        on the device, for the slow members (logits [R, V] float32: their rows in order)."""
        device, row = logits.device, 0
        own_spans: list[VerifyRow] = []  # the slow spans with starts into logits
        views: list[Request | RequestAt] = []  # [R] what the logits pipeline sees at each row
        mask_rows: list[tuple[Request, list[int]]] = []  # [R] grammar: (request, drafts before)
        for i in pending.slow:
            span, member = pending.spans[i], pending.members[i]
            own_spans.append(replace(span, start=row))
            row += span.num_rows
            for j in range(span.num_rows):
                views.append(RequestAt(member, span.drafts[:j]) if j else member)
                mask_rows.append((member, span.drafts[:j]))
        if self.logits_masker is not None:
            mask_logits(self.logits_masker, logits, mask_rows)
        batch = SamplingBatch.from_requests(views, self.cfg.vocab_size, device)
        processed = process_logits(logits, batch)
        verify = verify_batched(processed, own_spans, self.generator, self.backend.verify_kernel)
        pending.verify = verify
        pending.device.tokens, pending.device.num_accepted = verify.tokens, verify.num_accepted
        # Logprobs of every row of the requests that ask (where each walk ends is not known
        # yet), each for the token the walk emits there; resolve() keeps the rows it reached.
        members, slow = pending.members, pending.slow
        asking = [(k, i) for k, i in enumerate(slow) if members[i].params.logprobs is not None]
        if not asking:
            return
        lp_rows, lp_requests, lp_positions = [], [], []
        for k, i in asking:
            span = own_spans[k]
            lp_rows += range(span.start, span.end)
            lp_requests += [k] * span.num_rows
            lp_positions += range(span.num_rows)
            pending.logprob_spans.append((i, span))
        lp_rows, lp_requests, lp_positions = to_device(
            (host_tensor(lp_rows), host_tensor(lp_requests), host_tensor(lp_positions)), device
        )
        emitted = verify.tokens[lp_requests, lp_positions].clamp(min=0)  # [L]
        num_top = max(members[i].params.logprobs for _, i in asking)
        logprobs = torch.log_softmax(logits[lp_rows], dim=-1)
        pending.device.logprobs = TopLogprobs.gather(logprobs, emitted, num_top)

    def _prompt_logprobs(self, hidden, items: list[ForwardItem], pending: PendingStep) -> None:
        """The top logprobs of the prompt positions this step computes, for the requests that
        ask, queued on the device."""
        start_row = 0
        for item in items:
            request, n, start = item.request, len(item.token_ids), item.start
            num_top = request.params.prompt_logprobs
            # (After a preemption the prompt is computed again; the group keeps only the
            # positions it lacks.)
            if num_top is not None and start < request.num_prompt_tokens:
                # Position p predicts prompt token p + 1; the last prompt position predicts
                # the first output token, which is not a prompt logprob.
                last = min(start + n, request.num_prompt_tokens - 1)
                if last > start:
                    rows = list(range(start_row, start_row + last - start))
                    targets = request.token_ids[start + 1 : last + 1]
                    lp = torch.log_softmax(self.device_logits(hidden, rows).float(), dim=-1)
                    emitted = to_device(host_tensor(targets), self.device)
                    top = TopLogprobs.gather(lp, emitted, num_top)
                    pending.device.prompt_logprobs.append(top)
                    pending.prompt.append(PromptAsk(request, start, targets, num_top))
            start_row += n

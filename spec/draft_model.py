"""Draft-model proposer: a smaller model with its own paged KV cache, addressed by the target's
block tables (the same block ids and slots, a second set of KV tensors).

It runs only for the requests that have draft slots this step: a first pass catches up on every
token the target has accepted since the draft last ran (the whole prompt the first time, the
accepted drafts and bonus token after that) and proposes the first draft; k - 1 more passes
extend each request by one greedy token. A request that does not speculate (k = 0, e.g. adaptive
speculation switched off under load) costs the draft nothing; it lags, and catches up when it
speculates again. Full blocks it has computed are flagged in the block pool, so a prefix-cache hit
knows how much of the draft's KV it inherits. Its logits go
through the request's own logits pipeline (bias, bans, penalties) before the argmax, so it does
not propose what the target cannot emit. Greedy drafts make q one-hot; the verifier stays
lossless for sampled requests all the same.
"""

from __future__ import annotations

import time

import torch

from engine.device import host_tensor, to_device, to_host
from engine.inputs import ForwardItem
from engine.model_runner import ModelRunner, mask_logits
from engine.request import Request
from engine.sampler import RequestAt, SamplingBatch, keeps_argmax, process_logits
from engine.scheduler import SchedulerOutput
from spec.proposer import drafts_wanted


class DraftModelProposer:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.pass_times: list[tuple[int, float]] = []  # (rows, seconds) per pass, for the engine
        self.logits_masker = None  # the engine's grammar masks, once a request is constrained

    @torch.inference_mode()
    def propose(
        self, sched: SchedulerOutput, tables: dict[Request, list[int]], skip=frozenset()
    ) -> None:
        """Drafts for every request with slots left but those in skip (they lag)."""
        self.runner.copy_blocks(sched.block_copies)
        wanting = list(drafts_wanted(sched, skip))  # (request, its drafts so far, drafts to add)
        if not wanting:
            return
        items, last_rows, row = [], [], 0
        for request, drafts, _ in wanting:
            # The target's tokens up to this decode, then any forced drafts already in place.
            end = request.num_tokens
            start = min(request.num_draft_computed, end - 1)
            tokens = request.token_ids[start:end] + drafts
            items.append(ForwardItem(request, start, tokens))
            row += len(tokens)
            last_rows.append(row - 1)
            request.num_draft_computed = start + len(tokens)
        t0 = time.perf_counter()
        hidden = self.runner.forward(items, tables)
        self._extend(self.runner.device_logits(hidden, last_rows), [(r, d) for r, d, _ in wanting])
        self.pass_times.append((row, time.perf_counter() - t0))
        for step in range(1, max(k for _, _, k in wanting)):
            t0 = time.perf_counter()
            active = [(r, d) for r, d, k in wanting if k > step]
            items = [ForwardItem(r, r.num_tokens + len(d) - 1, d[-1:]) for r, d in active]
            hidden = self.runner.forward(items, tables)
            for r, _ in active:
                r.num_draft_computed += 1
            self._extend(self.runner.device_logits(hidden, None), active)
            self.pass_times.append((len(active), time.perf_counter() - t0))

    def _extend(self, logits: torch.Tensor, active: list[tuple[Request, list[int]]]) -> None:
        """Append each (request, drafts)'s next greedy draft (logits [R, V] on the device),
        under its own logits pipeline for the requests whose pipeline can move the argmax."""
        tokens = logits.argmax(dim=-1)  # [R]
        slow = [i for i, (r, _) in enumerate(active) if not keeps_argmax(r)]
        if slow:
            device = logits.device
            index = to_device(host_tensor(slow), device)
            part = logits[index].float()  # [S, V]
            if self.logits_masker is not None:  # propose only what the grammar allows
                mask_logits(self.logits_masker, part, [active[i] for i in slow])
            views = [RequestAt(*active[i]) for i in slow]
            batch = SamplingBatch.from_requests(views, self.runner.cfg.vocab_size, device)
            tokens[index] = process_logits(part, batch).argmax(dim=-1)
        tokens = to_host([tokens])[0].tolist()
        for (_, drafts), token in zip(active, tokens, strict=True):
            drafts.append(token)

"""Draft-model proposer: a smaller model with its own paged KV cache, addressed by the target's
block tables (the same block ids and slots, a second set of KV tensors).

Each step it first runs the tokens the target computes this step (prefill chunks and decode
tokens, plus whatever it lags behind after the last verification), which keeps its KV in step
with the target's so that prefix-cached blocks hold valid KV for both models; then it extends
every request that has draft slots by one greedy token per pass, k passes in all. Its logits go
through the request's own logits pipeline (bias, bans, penalties) before the argmax, so it does
not propose what the target cannot emit. Greedy drafts make q one-hot; the verifier stays
lossless for sampled requests all the same.
"""

from __future__ import annotations

import torch

from engine.model_runner import ForwardItem, ModelRunner
from engine.request import Request
from engine.sampler import RequestAt, SamplingBatch, process_logits
from engine.scheduler import SchedulerOutput
from spec.proposer import clear_drafts


class DraftModelProposer:
    def __init__(self, runner: ModelRunner):
        self.runner = runner

    @torch.inference_mode()
    def propose(self, sched: SchedulerOutput, tables: dict[Request, list[int]]) -> None:
        clear_drafts(sched)
        self.runner.copy_blocks(sched.block_copies)
        items, last_rows, wanting, row = [], [], [], 0
        for request, n, k in sched.scheduled():
            end = request.num_computed_tokens + n - k  # the target's count after this step
            start = min(request.num_draft_computed, end - 1)
            items.append(ForwardItem(request, start, request.token_ids[start:end]))
            row += end - start
            request.num_draft_computed = end
            if k:
                last_rows.append(row - 1)
                wanting.append((request, k))
        hidden = self.runner.forward(items, tables)
        if not wanting:
            return
        self._extend(hidden[torch.tensor(last_rows)], [r for r, _ in wanting])
        for step in range(1, max(k for _, k in wanting)):
            active = [r for r, k in wanting if k > step]
            items = [ForwardItem(r, r.num_tokens - 1 + step, r.spec_token_ids[-1:]) for r in active]
            hidden = self.runner.forward(items, tables)
            for r in active:
                r.num_draft_computed += 1
            self._extend(hidden, active)

    def _extend(self, hidden: torch.Tensor, requests: list[Request]) -> None:
        """Append each request's next greedy draft, under its own logits pipeline."""
        model = self.runner.model
        logits = model.compute_logits(hidden)[:, : self.runner.cfg.vocab_size]
        views = [RequestAt(r, r.spec_token_ids) for r in requests]
        batch = SamplingBatch.from_requests(views, self.runner.cfg.vocab_size)
        tokens = process_logits(logits, batch).argmax(dim=-1).tolist()
        for r, token in zip(requests, tokens, strict=True):
            r.spec_token_ids.append(token)

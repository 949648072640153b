"""Model runner: one flat batch per step over the paged KV cache, then logits and sampling.

Owns the KV tensors. `execute` takes the scheduler's decision, builds the inputs (token ids,
positions, slot mapping, attention metadata), runs the model, samples the rows that are caught
up, and returns plain Python results (the one host sync of the step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention import build_metadata
from engine.models.llama import LlamaForCausalLM, ModelConfig
from engine.request import Request
from engine.sampler import SamplingBatch, process_logits, sample, top_logprobs
from engine.scheduler import SchedulerOutput

# token id -> (logprob, rank) for one position
RawLogprobs = dict[int, tuple[float, int]]


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype=torch.float32) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return cfg.num_layers * 2 * cfg.num_kv_heads * block_size * cfg.head_dim * elem


def logprob_entry(token: int, chosen, rank, values, ids, num_top: int) -> RawLogprobs:
    """The chosen token's (logprob, rank) plus the top num_top, for one position."""
    entry = {token: (float(chosen), int(rank))}
    for k in range(num_top):
        entry.setdefault(int(ids[k]), (float(values[k]), k + 1))
    return entry


@dataclass
class StepResult:
    sampled: list[tuple[Request, int]] = field(default_factory=list)  # (request, token id)
    logprobs: dict[Request, RawLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[Request, list[RawLogprobs]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cfg: ModelConfig, num_blocks: int, block_size: int):
        self.model = model
        self.cfg = cfg
        self.block_size = block_size
        # [num_layers, 2 (K, V), Hkv, num_blocks, block_size, D]
        self.kv_caches = torch.zeros(
            cfg.num_layers, 2, cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim
        )
        self.generator = torch.Generator().manual_seed(0)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, tables: dict[Request, list[int]]) -> StepResult:
        requests, num_new = sched.requests, sched.num_new_tokens
        for src, dst in sched.block_copies:
            self.kv_caches[:, :, :, dst] = self.kv_caches[:, :, :, src]

        input_ids, positions, slots, seq_lens, sample_rows = [], [], [], [], []
        row = 0
        bs = self.block_size
        for request, n in zip(requests, num_new, strict=True):
            start = request.num_computed_tokens
            table = tables[request]
            input_ids.extend(request.token_ids[start : start + n])
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            seq_lens.append(start + n)
            row += n
            if start + n == request.num_tokens:
                sample_rows.append((request, row - 1))
        meta = build_metadata(
            seq_lens,
            num_new,
            [tables[r] for r in requests],
            torch.tensor(slots, dtype=torch.long),
            bs,
            self.cfg.sliding_window,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            self.kv_caches,
            meta,
        )
        result = StepResult()
        self._prompt_logprobs(hidden, requests, num_new, result)
        self._sample(hidden, sample_rows, result)
        return result

    def _sample(self, hidden: torch.Tensor, sample_rows, result: StepResult) -> None:
        rows, row_requests = [], []
        for request, row in sample_rows:
            rows.append(row)
            row_requests.append(request)
            if request.siblings and request.num_output_tokens == 0:
                # n > 1: the siblings sample their first token from the leader's logits.
                rows.extend([row] * len(request.siblings))
                row_requests.extend(request.siblings)
        if not rows:
            return
        logits = self.model.compute_logits(hidden[torch.tensor(rows)])  # [M, V]
        logits = logits[:, : self.cfg.vocab_size]
        batch = SamplingBatch.from_requests(row_requests, self.cfg.vocab_size)
        tokens = sample(process_logits(logits, batch), batch, self.generator)
        want = [i for i, r in enumerate(row_requests) if r.params.logprobs is not None]
        if want:
            idx = torch.tensor(want)
            num_top = max(row_requests[i].params.logprobs for i in want)
            lp = torch.log_softmax(logits[idx], dim=-1)
            chosen, rank, values, ids = top_logprobs(lp, tokens[idx], num_top)
            for j, i in enumerate(want):
                n = row_requests[i].params.logprobs
                result.logprobs[row_requests[i]] = logprob_entry(
                    int(tokens[i]), chosen[j], rank[j], values[j], ids[j], n
                )
        result.sampled = list(zip(row_requests, tokens.tolist(), strict=True))

    def _prompt_logprobs(self, hidden, requests, num_new, result: StepResult) -> None:
        start_row = 0
        for request, n in zip(requests, num_new, strict=True):
            num_top = request.params.prompt_logprobs
            start = request.num_computed_tokens
            rows_end = start_row + n
            # After a preemption the prompt is recomputed: skip positions already recorded.
            first = max(start, len(request.prompt_logprobs))
            if num_top is not None and first < request.num_prompt_tokens:
                # Position p predicts prompt token p + 1; the last prompt position predicts
                # the first output token, which is not a prompt logprob.
                last = min(start + n, request.num_prompt_tokens - 1)
                if last > first:
                    h = hidden[start_row + first - start : start_row + last - start]
                    lp = torch.log_softmax(self.model.compute_logits(h), dim=-1)
                    targets = torch.tensor(request.token_ids[first + 1 : last + 1])
                    chosen, rank, values, ids = top_logprobs(lp, targets, num_top)
                    result.prompt_logprobs[request] = [
                        logprob_entry(
                            int(targets[j]), chosen[j], rank[j], values[j], ids[j], num_top
                        )
                        for j in range(last - first)
                    ]
            start_row = rows_end

"""The quality rule for approximate weights: teacher-forced scoring of a held real text.

Both models read the same token ids; at every position we take the log-probability of the
text's next token (for perplexity) and the top-1 prediction. A quantized model passes against
its exact reference when its perplexity is within 1% and its top-1 token agrees at >= 95% of
positions (issue 23's rule; tests/engine/test_quantized.py applies it, bench/peers.py reports it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine import LLM, SamplingParams

MAX_PERPLEXITY_RATIO = 1.01
MIN_TOP1_AGREEMENT = 0.95


def held_text() -> str:
    """Real English prose that ships with CPython: the documentation's topic pages."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def held_tokens(tokenizer, num_tokens: int) -> list[int]:
    ids = tokenizer.encode(held_text()[: num_tokens * 8])
    if len(ids) < num_tokens:
        raise ValueError(f"held text has {len(ids)} tokens, fewer than {num_tokens}")
    return ids[:num_tokens]


@dataclass(frozen=True)
class Scores:
    token_logprobs: list[float]  # [T - 1]: log p(text[t] | text[:t]) for t = 1..T-1
    top1: list[int]  # [T - 1]: the most likely token at each of those positions

    @property
    def perplexity(self) -> float:
        return math.exp(-sum(self.token_logprobs) / len(self.token_logprobs))


def teacher_forced(llm: LLM, token_ids: list[int]) -> Scores:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    out = llm.generate([token_ids], params)[0]
    positions = out.prompt_logprobs[1:]  # the first token has no prediction
    logprobs, top1 = [], []
    for token, lps in zip(token_ids[1:], positions, strict=True):
        logprobs.append(lps[token].logprob)
        top1.append(next(t for t, lp in lps.items() if lp.rank == 1))
    return Scores(logprobs, top1)


def teacher_forced_decode(llm: LLM, token_ids: list[int], prefill: int) -> Scores:
    """Scores of positions prefill..T-1 as decode computes them: token_ids[:prefill] in one
    prefill, then each next text token as a single-token step (for a model with fused layers,
    kernels/cpu/fused_layer.cpp). Drives the model on cache blocks 1.. directly: call it on an
    idle engine with at least ceil(T / block_size) + 1 blocks."""
    import torch

    from engine.attention import slot_ids
    from engine.inputs import FlatInputs

    runner = llm.engine.runner
    model, bs = runner.model, runner.block_size
    table = list(range(1, 1 + -(-len(token_ids) // bs)))

    def step(start: int, tokens: list[int]) -> torch.Tensor:  # log-probs [vocab] after tokens
        n = len(tokens)
        slots = slot_ids(table, start, n, bs)
        positions = list(range(start, start + n))
        flat = FlatInputs(tokens, positions, slots, [start + n], [n], [table])
        meta = runner.backend.metadata(
            flat, torch.tensor(slots), bs, runner.cfg.windows, model.fused_layers
        )  # the layout the engine's own steps get
        hidden = model(torch.tensor(tokens), torch.tensor(positions), runner.kv_caches, meta)[-1:]
        return model.lm_head(hidden)[0, : runner.cfg.vocab_size].float().log_softmax(-1)

    logprobs, top1 = [], []
    with torch.inference_mode():
        scores = step(0, token_ids[:prefill])
        for t in range(prefill, len(token_ids)):
            logprobs.append(scores[token_ids[t]].item())
            top1.append(int(scores.argmax()))
            if t + 1 < len(token_ids):
                scores = step(t, [token_ids[t]])
    return Scores(logprobs, top1)


def span(scores: Scores, start: int, end: int) -> Scores:
    """The scores of text positions start..end-1 (position t predicts token t)."""
    return Scores(scores.token_logprobs[start - 1 : end - 1], scores.top1[start - 1 : end - 1])


@dataclass(frozen=True)
class QualityReport:
    perplexity_ref: float
    perplexity: float
    top1_agreement: float
    num_positions: int

    @property
    def perplexity_ratio(self) -> float:
        return self.perplexity / self.perplexity_ref

    @property
    def passes(self) -> bool:
        return (
            self.perplexity_ratio <= MAX_PERPLEXITY_RATIO
            and self.top1_agreement >= MIN_TOP1_AGREEMENT
        )

    def __str__(self) -> str:
        return (
            f"perplexity {self.perplexity:.3f} vs {self.perplexity_ref:.3f} "
            f"(x{self.perplexity_ratio:.4f}), top-1 agreement {self.top1_agreement:.4f} "
            f"over {self.num_positions} positions"
        )


def compare(reference: Scores, approx: Scores) -> QualityReport:
    agree = sum(a == b for a, b in zip(reference.top1, approx.top1, strict=True))
    return QualityReport(
        reference.perplexity, approx.perplexity, agree / len(reference.top1), len(reference.top1)
    )

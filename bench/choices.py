"""The measurements behind choices the engine's core makes, which its comments cite instead of
quoting figures that go stale. Each pair is the choice against what it replaced, alternated
(bench/harness.py: a warm-up each, then --repeats rounds, median and spread), one thread:

- host_tensor: `engine.device.host_tensor` (through numpy) against `torch.tensor(list)`, for a
  list of 640 ints (a step's flat inputs for a few dozen requests);
- decode: `engine.detokenizer.ExactDecoder`'s Rust decode against the tokenizer's Python
  `decode` (clean-up off), on SmolLM2's tokenizer, two-token windows as the detokenizer asks;
- noise: `engine.sampler.exponential_noise` (float32 uniforms) against `Tensor.exponential_`,
  [32, 49152] (32 sampled rows of SmolLM2's vocabulary);
- top_p: `engine.sampler.top_p_drop` (the top TOP_P_CANDIDATES first) against sorting every
  row (`_top_p_drop_sorted`), top-p 0.95 over 64 rows of SmolLM2's own logits (HF, float32) on
  real English text at temperature 0.8; also the share of rows the candidates resolve (random
  logits are flat: no row resolves, and the shortcut only adds its top-k to the full sort);
- bucket: one bucket of `engine.attention.BucketedAttention.attend` (SmolLM2's heads: 9 query,
  3 KV, dim 64; 8 requests, 1 query each) at a 16-token and a 1040-token context: the cost of
  one padded key slot is the slope, a bucket's fixed cost the short one, and their ratio is
  what engine.attention.BUCKET_OVERHEAD_SLOTS should be near.

    python -m bench.choices [--repeats 5]

Exits 1 when the two sides of a choice give different results (all but the noise, whose draws
differ by design) or when the engine's side is the slower one: a comment citing it is then wrong.
Last line: RESULT host_tensor_x=.. decode_x=.. noise_x=.. top_p_x=.. bucket_overhead_slots=..
(x: how many times faster the engine's choice is; bucket_overhead_slots: fixed cost / slot cost)
"""

from __future__ import annotations

import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import time
from collections.abc import Callable

import torch

from bench.harness import Run, Timings, alternate


def per_call(fn: Callable[[], object], calls: int) -> Callable[[], Run]:
    """A mode: `calls` calls of fn, timed together; seconds per call."""

    def mode() -> Run:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return Run({"seconds": (time.perf_counter() - t0) / calls})

    return mode


def pairs() -> tuple[dict[str, dict[str, Callable[[], Run]]], list[str]]:
    """Each choice: {the engine's, what it replaced} as modes; and the choices whose two sides
    do not give the same result (all but the noise, whose draws differ by design)."""
    from bench.decode import tokenizer
    from engine.detokenizer import ExactDecoder
    from engine.device import host_tensor
    from engine.sampler import TOP_P_CANDIDATES, _top_p_drop_sorted, exponential_noise, top_p_drop

    ints = list(range(640))
    tok = tokenizer()
    decoder = ExactDecoder(tok)
    windows = [[i, i + 1] for i in range(1000, 1400)]
    gen = torch.Generator().manual_seed(0)
    logits = model_logits(tok, 64) / 0.8  # [64, V]
    top_p = torch.full((64,), 0.95)
    held = logits.softmax(-1).topk(TOP_P_CANDIDATES, dim=-1).values.sum(-1)  # [64]
    print(
        f"top_p: the top {TOP_P_CANDIDATES} hold 0.95 of the mass in {(held >= 0.95).sum()}/64 rows"
    )
    same = {
        "host_tensor": torch.equal(host_tensor(ints), torch.tensor(ints)),
        "decode": all(
            decoder(w, skip_special_tokens=True)
            == tok.decode(w, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            for w in windows
        ),
        "top_p": torch.equal(top_p_drop(logits, top_p), _top_p_drop_sorted(logits, top_p)),
    }
    modes = {
        "host_tensor": {
            "ours": per_call(lambda: host_tensor(ints), 2000),
            "torch.tensor": per_call(lambda: torch.tensor(ints, dtype=torch.long), 2000),
        },
        "decode": {
            "ours": per_call(lambda: [decoder(w, skip_special_tokens=True) for w in windows], 5),
            "tokenizer.decode": per_call(
                lambda: [
                    tok.decode(w, skip_special_tokens=True, clean_up_tokenization_spaces=False)
                    for w in windows
                ],
                5,
            ),
        },
        "noise": {
            "ours": per_call(lambda: exponential_noise(32, 49152, generator=gen), 10),
            "exponential_": per_call(
                lambda: torch.empty(32, 49152).exponential_(generator=gen), 10
            ),
        },
        "top_p": {
            "ours": per_call(lambda: top_p_drop(logits, top_p), 3),
            "full sort": per_call(lambda: _top_p_drop_sorted(logits, top_p), 3),
        },
        "bucket": {"ctx 16": bucket_mode(16), "ctx 1040": bucket_mode(1040)},
    }
    return modes, [name for name, ok in same.items() if not ok]


def model_logits(tok, rows: int) -> torch.Tensor:  # [rows, vocab] float32
    """SmolLM2's logits at the first `rows` positions of real English text."""
    from transformers import AutoModelForCausalLM

    from bench.decode import prompt_ids
    from bench.workload import MODEL
    from engine.models.registry import resolve_model

    model = AutoModelForCausalLM.from_pretrained(str(resolve_model(MODEL)), dtype=torch.float32)
    with torch.inference_mode():
        return model(torch.tensor([prompt_ids(tok, rows)])).logits[0].float()


def bucket_mode(context: int, requests: int = 8) -> Callable[[], Run]:
    """One bucket of `requests` decodes at `context` tokens, SmolLM2's attention shape."""
    from engine.attention import bucketed_metadata, slot_ids

    block_size, heads, kv_heads, dim = 16, 9, 3, 64
    per_request = -(-context // block_size)
    tables = [list(range(1 + i * per_request, 1 + (i + 1) * per_request)) for i in range(requests)]
    cache = torch.randn(kv_heads, 1 + requests * per_request, block_size, dim) * 0.1
    slots = torch.tensor([slot_ids(t, context - 1, 1, block_size)[0] for t in tables])
    meta = bucketed_metadata([context] * requests, [1] * requests, tables, slots, block_size, None)
    assert len(meta.buckets) == 1 and not meta.prefills
    q = torch.randn(requests, heads, dim)
    kv = torch.randn(requests, kv_heads, dim)
    return per_call(lambda: meta.attend(q, kv, kv, cache, cache, dim**-0.5), 50)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    medians: dict[str, dict[str, float]] = {}
    choices, unequal = pairs()
    for choice, modes in choices.items():
        timings: dict[str, Timings] = alternate(modes, args.repeats, threads=1)
        medians[choice] = {name: t.median("seconds") for name, t in timings.items()}
        for name, t in timings.items():
            print(
                f"{choice:12s} {name:18s} {t.median('seconds') * 1e6:10.1f} us "
                f"(spread {t.spread('seconds') * 1e6:.1f})"
            )
    x = {c: m[list(m)[1]] / m["ours"] for c, m in medians.items() if "ours" in m}
    short, long = medians["bucket"]["ctx 16"], medians["bucket"]["ctx 1040"]
    slot = (long - short) / (8 * (1040 - 16))  # seconds per padded key slot
    fixed = short - 8 * 16 * slot  # a bucket's cost beyond its key slots
    print(f"bucket: {slot * 1e6:.3f} us per key slot, fixed {fixed * 1e6:.1f} us per bucket")
    print(
        "RESULT "
        + " ".join(f"{c}_x={v:.2f}" for c, v in x.items())
        + f" bucket_overhead_slots={fixed / slot:.0f}"
    )
    slower = [c for c, v in x.items() if v < 1]
    if unequal or slower:  # a comment that cites this figure no longer holds
        print(f"FAILED: results differ: {unequal}; the engine's choice is slower: {slower}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

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
  what engine.attention.BUCKET_OVERHEAD_SLOTS should be near;
- packed: `engine.models.layers.Packed` (oneDNN's blocked weights) against `F.linear`
  (MKL), SmolLM2's four projections of one layer at 12 rows (a decode batch);
- head_1_row / head_5_rows: the LM head (SmolLM2's [49152, 576]) at one row in `F.linear`'s
  gemv against the packed GEMM, and at five rows the other way round (one row is reported, not
  judged: which side is faster there depends on the head's shape and the CPU);
- int8: `engine.models.quant.linear_int8` (a draft model's int8 weights, activations quantized
  per call) against fp32 `F.linear`, one row of Qwen2.5-0.5B's widest projection, with its
  relative output error;
- bitmask: `engine.grammar.matcher.apply_bitmask` (numpy unpack, one masked_fill) against
  xgrammar's CPU kernel, 16 mostly-forbidden rows of SmolLM2's vocabulary.

    python -m bench.choices [--repeats 5]

Exits 1 when the two sides of a choice give different results (all but the noise, whose draws
differ by design) or when the engine's side is the slower one: a comment citing it is then wrong.
Last line: RESULT host_tensor_x=.. decode_x=.. noise_x=.. top_p_x=.. packed_x=.. head_1_row_x=..
head_5_rows_x=.. int8_x=.. bitmask_x=.. bucket_overhead_slots=..
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

UNJUDGED = {"head_1_row"}  # reported only: the faster side depends on the shape and the CPU


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

    def wrapper_decode(ids: list[int]) -> str:  # the tokenizer's Python decode, clean-up off
        return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    same = {
        "host_tensor": torch.equal(host_tensor(ints), torch.tensor(ints)),
        "decode": all(decoder(w, skip_special_tokens=True) == wrapper_decode(w) for w in windows),
        "top_p": torch.equal(top_p_drop(logits, top_p), _top_p_drop_sorted(logits, top_p)),
    }
    modes = {
        "host_tensor": {
            "ours": per_call(lambda: host_tensor(ints), 2000),
            "torch.tensor": per_call(lambda: torch.tensor(ints, dtype=torch.long), 2000),
        },
        "decode": {
            "ours": per_call(lambda: [decoder(w, skip_special_tokens=True) for w in windows], 5),
            "tokenizer.decode": per_call(lambda: [wrapper_decode(w) for w in windows], 5),
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


def model_pairs() -> tuple[dict[str, dict[str, Callable[[], Run]]], list[str]]:
    """As pairs(), for the choices in engine/models/ and engine/grammar/: oneDNN's packed GEMM
    for the projections, the LM head's gemv at one row, int8 draft weights, the CPU bitmask."""
    import numpy as np
    import torch.nn.functional as F
    import xgrammar as xgr

    from engine.grammar.matcher import apply_bitmask
    from engine.models.layers import Packed
    from engine.models.quant import linear_int8, pack_int8

    gen = torch.Generator().manual_seed(1)

    def weight(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, generator=gen) * inp**-0.5

    # SmolLM2's four projections of one layer ([out, in]): qkv, o, gate_up, down
    layer = [weight(960, 576), weight(576, 576), weight(3072, 576), weight(576, 1536)]
    packed = [Packed(w, None) for w in layer]
    xs = [torch.randn(12, w.shape[1], generator=gen) for w in layer]  # 12 decode rows
    pairs_packed = list(zip(xs, packed, strict=True))
    pairs_dense = list(zip(xs, layer, strict=True))
    head = weight(49152, 576)
    head_packed = Packed(head, None)
    h1, h5 = torch.randn(1, 576, generator=gen), torch.randn(5, 576, generator=gen)
    draft = weight(9728, 896)  # Qwen2.5-0.5B's gate_up, the draft model's widest
    draft_int8, x1 = pack_int8(draft, None), torch.randn(1, 896, generator=gen)
    error = (linear_int8(x1, draft_int8) - F.linear(x1, draft)).norm() / F.linear(x1, draft).norm()
    print(f"int8: relative output error {float(error):.3f} against fp32")
    vocab, rows = 49152, 16
    words = np.zeros((rows, vocab // 32), dtype=np.int32)
    words[:, :4] = -1  # mostly forbidden: 128 tokens allowed per row
    bitmask, masked = torch.from_numpy(words), torch.randn(rows, vocab, generator=gen)

    def ours_mask() -> torch.Tensor:
        out = masked.clone()
        apply_bitmask(out, bitmask, list(range(rows)), vocab)
        return out

    def xgrammar_mask() -> torch.Tensor:
        out = masked.clone()
        xgr.apply_token_bitmask_inplace(out, bitmask, vocab_size=vocab)
        return out

    same = {
        "packed": all(
            torch.allclose(p(x), F.linear(x, w), rtol=1e-4, atol=1e-4)
            for x, p, w in zip(xs, packed, layer, strict=True)
        ),
        "bitmask": torch.equal(ours_mask(), xgrammar_mask()),
    }
    modes = {
        "packed": {
            "ours": per_call(lambda: [p(x) for x, p in pairs_packed], 20),
            "F.linear": per_call(lambda: [F.linear(x, w) for x, w in pairs_dense], 20),
        },
        "head_1_row": {
            "ours": per_call(lambda: F.linear(h1, head), 20),
            "packed": per_call(lambda: head_packed(h1), 20),
        },
        "head_5_rows": {
            "ours": per_call(lambda: head_packed(h5), 20),
            "F.linear": per_call(lambda: F.linear(h5, head), 20),
        },
        "int8": {
            "ours": per_call(lambda: linear_int8(x1, draft_int8), 50),
            "F.linear": per_call(lambda: F.linear(x1, draft), 50),
        },
        "bitmask": {"ours": per_call(ours_mask, 20), "xgrammar": per_call(xgrammar_mask, 20)},
    }
    return modes, [name for name, ok in same.items() if not ok]


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
    more, more_unequal = model_pairs()
    choices, unequal = choices | more, unequal + more_unequal
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
    slower = [c for c, v in x.items() if v < 1 and c not in UNJUDGED]
    if unequal or slower:  # a comment that cites this figure no longer holds
        print(f"FAILED: results differ: {unequal}; the engine's choice is slower: {slower}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

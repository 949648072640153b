"""The tandem kernel's quantized linear op alone, at Qwen2.5-Coder-1.5B's shapes (smol_*:
SmolLM2-135M's): random GGUF blocks of a type (Q6_K8: Q6_K requantized to 8 bits, the form a
mixed fused projection takes) against M activation rows, 1 thread, CPU time of the calling
thread (robust to other processes taking the core, not to their cache traffic), the shapes and
row counts alternated each round.

    python -m bench.quant_op [--cases down:Q6_K,down:Q4_K] [--rows 16,64,512] [--rounds 5]
    cd OTHER_CHECKOUT && python /path/to/bench/quant_op.py ...   # the same op on another tree

Prints min and median ms and GMAC/s per case, and a `RESULT` line of the min ms. --save PATH
writes the outputs (torch.save) to compare two trees' bits.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "tests")]  # this checkout's engine

import torch  # noqa: E402

SHAPES = {  # out_features, in_features
    "qkv": (2048, 1536),
    "o": (1536, 1536),
    "gate_up": (17920, 1536),
    "down": (1536, 8960),
    "smol_qkv": (960, 576),  # SmolLM2-135M's (its GGUF: Q4_1)
    "smol_o": (576, 576),
    "smol_gate_up": (3072, 576),
    "smol_down": (576, 1536),
}


def layer(shape: str, qtype: str):
    from gguf import GGMLQuantizationType as T
    from quant_blocks import random_blocks

    from engine.models.gguf_blocks import decode
    from engine.models.quantized import QuantizedLinear

    n, k = SHAPES[shape]
    t = T.Q6_K if qtype == "Q6_K8" else T[qtype]
    weight = decode(random_blocks(t, n, k), t, k)
    if qtype == "Q6_K8":
        weight = weight.affine()
    return QuantizedLinear(weight, None, backend="tandem")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="down:Q6_K,down:Q4_K,gate_up:Q4_K,qkv:Q6_K8")
    parser.add_argument("--rows", default="16,64,512")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--save", default=None)
    args = parser.parse_args(argv)
    from kernels import cpu

    print(f"kernel: {cpu.load()} ({cpu.library_path().name})")
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    cases = [tuple(c.split(":")) for c in args.cases.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    layers = {c: layer(*c) for c in cases}
    g = torch.Generator().manual_seed(0)
    xs = {(c, m): torch.randn(m, SHAPES[c[0]][1], generator=g) for c in cases for m in rows}
    outs, times = {}, {}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for c in cases:
            for m in rows:
                start = time.thread_time()
                outs[c, m] = layers[c](xs[c, m])
                if round_:
                    times.setdefault((c, m), []).append(time.thread_time() - start)
    result = []
    for (c, m), ts in times.items():
        ts.sort()
        n, k = SHAPES[c[0]]
        print(
            f"{c[0]:8s} {c[1]:6s} rows {m:4d}: min {ts[0] * 1e3:8.2f} ms, median "
            f"{ts[len(ts) // 2] * 1e3:8.2f} ms, {n * k * m / ts[0] / 1e9:6.1f} GMAC/s"
        )
        result.append(f"{c[0]}_{c[1]}_m{m}_ms={ts[0] * 1e3:.2f}")
    if args.save:
        torch.save({f"{c[0]}:{c[1]}:{m}": y for (c, m), y in outs.items()}, args.save)
    print("RESULT " + " ".join(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

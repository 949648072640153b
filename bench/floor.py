"""How fast could any engine built on this machine's fp32 kernels run bench.throughput's full
workload? A lower bound from measured pieces, to set against 10x HF sequential.

    python -m bench.floor [--hf-seq-seconds S]

Without --hf-seq-seconds it times HF sequential on the same workload itself (the slow part,
~11 minutes on one thread); pass a figure only when it was measured on this machine in the
same session (bench.throughput's hf_seq mode prints it).

One thread. It times the engine's own linear kernels (oneDNN packed weights, the faster of the
options measured in bench/RESULTS.md) for one SmolLM2 layer's four projections at each batch
size the workload's decode steps have, times 30 layers, plus the LM head; prefill at 1024-row
chunks (the engine's token budget). The decode attention floor is the KV cache read once per
step (the sum over steps and running requests of context length x K/V bytes per token) at the
measured single-thread read bandwidth. Everything else (attention arithmetic, prefill attention,
norms, RoPE, activations, sampling, Python) counts as zero, so the real floor is higher.

A second floor replaces that ideal KV read with the engine's own pure-torch decode attention
(engine.attention.BucketedAttention.attend: K/V gathered into a copy, batched matmuls,
softmax; requests bucketed by context length) timed for one layer at every decode step's
contexts, times the layers: the least any engine whose CPU attention is the torch reference
can spend.
Last line: RESULT floor_seconds=.. max_x_hf_seq=.. torch_attention_floor_seconds=..
max_x_hf_seq_torch_attention=..
"""

from __future__ import annotations

import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import time

import torch

from bench.workload import make_workload
from engine.attention import bucketed_metadata
from engine.models.loader import load_model
from engine.models.registry import resolve_model

# bench.throughput's full workload: 64 requests, seed 0 (see bench/RESULTS.md).
FULL = dict(n=64, seed=0, prompt=(100, 0.8, 16, 512), output=(80, 0.8, 8, 256))


def best_seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def torch_decode_attention_seconds(cfg, contexts_per_step: list[list[int]]) -> float:
    """One layer of the engine's torch decode attention at each step's contexts, x layers."""
    block_size = 16
    longest = [0] * len(contexts_per_step[0])  # running sets are prefixes of the first
    for contexts in contexts_per_step:
        for i, c in enumerate(contexts):
            longest[i] = max(longest[i], c)
    blocks_per_req = [-(-n // block_size) for n in longest]
    tables, next_block = [], 1  # block 0 is the null block
    for n in blocks_per_req:
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    shape = (cfg.num_kv_heads, next_block, block_size, cfg.head_dim)
    k_cache, v_cache = torch.randn(shape), torch.randn(shape)
    total = 0.0
    for contexts in contexts_per_step:  # running requests' lengths after this step
        n = len(contexts)
        slots = torch.tensor(
            [
                tables[i][(c - 1) // block_size] * block_size + (c - 1) % block_size
                for i, c in enumerate(contexts)
            ]
        )
        meta = bucketed_metadata(contexts, [1] * n, tables[:n], slots, block_size, None)
        q = torch.randn(n, cfg.num_heads, cfg.head_dim)
        kv = torch.randn(n, cfg.num_kv_heads, cfg.head_dim)
        total += best_seconds(
            lambda q=q, kv=kv, meta=meta: meta.attend(q, kv, kv, k_cache, v_cache, 0.125),
            2,
        )
    return total * cfg.num_layers


def hf_seq_seconds(wl) -> float:
    """HF `generate` one request at a time over the whole workload (bench.hf_baselines)."""
    from bench.hf_baselines import load_hf_model, run_hf_seq

    print("# timing HF sequential on the whole workload (no --hf-seq-seconds given)")
    return run_hf_seq(load_hf_model(), wl, None).seconds


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hf-seq-seconds", type=float, default=None, help="hf_seq time, measured")
    ap.add_argument("--token-budget", type=int, default=1024)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    model, cfg, _ = load_model(resolve_model("smollm2-135m-instruct"))
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    projections = [
        (attn.qkv_proj, cfg.hidden_size),
        (attn.o_proj, cfg.num_heads * cfg.head_dim),
        (mlp.gate_up_proj, cfg.hidden_size),
        (mlp.down_proj, cfg.intermediate_size),
    ]
    cache: dict[int, tuple[float, float]] = {}

    def cost(rows: int) -> tuple[float, float]:
        """(30 layers of projections, LM head) seconds at this many rows."""
        if rows not in cache:
            repeats = 3 if rows > 256 else 10
            layers = 0.0
            for proj, width in projections:
                x = torch.randn(rows, width)
                layers += best_seconds(lambda proj=proj, x=x: proj(x), repeats)
            h = torch.randn(rows, cfg.hidden_size)
            head = best_seconds(lambda: model.lm_head(h), repeats)
            cache[rows] = (layers * cfg.num_layers, head)
        return cache[rows]

    wl = make_workload(FULL["n"], FULL["seed"], cfg.vocab_size, FULL["prompt"], FULL["output"])
    prompt_tokens = wl.num_prompt_tokens
    prefill = prompt_tokens / args.token_budget * cost(args.token_budget)[0]
    prefill += cost(len(wl.prompts))[1]  # each request's first token
    decode_proj = decode_head = 0.0
    for t in range(1, max(wl.out_lens)):
        rows = sum(1 for n in wl.out_lens if n > t)
        proj, head = cost(rows)
        decode_proj, decode_head = decode_proj + proj, decode_head + head
    kv_bytes_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    contexts = sum(
        n * len(p) + n * (n - 1) / 2 for p, n in zip(wl.prompts, wl.out_lens, strict=True)
    )
    x = torch.randn(16 * 1024 * 1024)  # 64 MB
    bandwidth = x.numel() * 4 / best_seconds(x.sum, 10)
    kv_read = contexts * kv_bytes_per_token / bandwidth
    floor = prefill + decode_proj + decode_head + kv_read
    # Requests sorted longest output first, so step t's running set is a prefix.
    order = sorted(range(len(wl.prompts)), key=lambda i: -wl.out_lens[i])
    steps = [
        [len(wl.prompts[i]) + t for i in order if wl.out_lens[i] > t]
        for t in range(1, max(wl.out_lens))
    ]
    torch_attention = torch_decode_attention_seconds(cfg, steps)
    torch_floor = floor - kv_read + torch_attention
    if args.hf_seq_seconds is None:
        args.hf_seq_seconds = hf_seq_seconds(wl)
    budget = args.hf_seq_seconds / 10
    print(f"# workload: {prompt_tokens} prompt tokens, {sum(wl.out_lens)} output tokens")
    print(f"prefill projections ({args.token_budget}-row chunks): {prefill:.1f} s")
    print(f"decode projections: {decode_proj:.1f} s, LM head: {decode_head:.1f} s")
    print(
        f"decode KV read once: {contexts * kv_bytes_per_token / 1e9:.1f} GB at "
        f"{bandwidth / 1e9:.1f} GB/s = {kv_read:.1f} s"
    )
    for rows in (1, 16, 32, 64, args.token_budget):
        proj, head = cost(rows)
        print(f"#   {rows} rows: projections {1e3 * proj:.1f} ms, LM head {1e3 * head:.1f} ms")
    print(
        f"floor {floor:.1f} s; 10x HF sequential ({args.hf_seq_seconds:.1f} s) needs {budget:.1f} s"
    )
    print(f"decode attention, the torch op at each step's contexts: {torch_attention:.1f} s")
    print(f"floor with the torch attention {torch_floor:.1f} s")
    print(
        f"RESULT floor_seconds={floor:.1f} max_x_hf_seq={args.hf_seq_seconds / floor:.2f} "
        f"torch_attention_floor_seconds={torch_floor:.1f} "
        f"max_x_hf_seq_torch_attention={args.hf_seq_seconds / torch_floor:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""bench.gpu's kernel parts: paged attention against the copy bandwidth, one decode step's
projections with and without the SGMV LoRA kernels, and a verify step's sampling on the host
against the fused rejection kernel on the device (see bench/gpu.py for what each measures)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from bench import gpu_common as common
from bench.gpu_common import SIZES, do_bench

WINDOW = 512  # the windowed decode's sliding window


def bench_attention(copy_bw: float, quick: bool) -> dict:
    """Per context: decode (one query per request), decode with the block table 4x wider (as a
    CUDA graph's, sized for the longest context allowed), decode in a 512-key sliding window
    (only its blocks are read), and verification (1 + 4 queries per request, the varlen kernel):
    the K/V bytes each must read, once, over time, against copy bandwidth."""
    from kernels.triton_attention import paged_attention
    from kernels.triton_decode import paged_decode_attention

    dev, dtype = common.DEV, common.DTYPE
    num_reqs, hq, hkv, contexts = SIZES["attention"]
    dim, bs = 64, 16
    out = {}
    for ctx in contexts[:-1] if quick else contexts:
        blocks_per_req = ctx // bs
        num_blocks = num_reqs * blocks_per_req + 1
        k_cache = torch.randn(hkv, num_blocks, bs, dim, device=dev, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        perm = torch.randperm(num_blocks - 1, device=dev) + 1
        tables = perm.view(num_reqs, blocks_per_req).to(torch.int32)
        wide = torch.zeros(num_reqs, 4 * blocks_per_req, dtype=torch.int32, device=dev)
        wide[:, :blocks_per_req] = tables
        seq_lens = torch.full((num_reqs,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(num_reqs, hq, dim, device=dev, dtype=dtype)
        qv = torch.randn(num_reqs * 5, hq, dim, device=dev, dtype=dtype)  # 1 + 4 queries each
        starts = torch.arange(num_reqs + 1, dtype=torch.int32, device=dev) * 5
        scale = dim**-0.5
        decode, verify = paged_decode_attention, paged_attention
        runs = {
            "decode": partial(decode, q, k_cache, v_cache, tables, seq_lens, scale),
            "decode_wide_table": partial(decode, q, k_cache, v_cache, wide, seq_lens, scale),
            "decode_window": partial(
                decode, q, k_cache, v_cache, tables, seq_lens, scale, sliding_window=WINDOW
            ),
            "verify": partial(verify, qv, k_cache, v_cache, tables, starts, seq_lens, scale, 5),
        }
        out[ctx] = {}
        for kind, fn in runs.items():
            keys = min(ctx, WINDOW) if kind == "decode_window" else ctx
            kv_bytes = 2 * num_reqs * keys * hkv * dim * dtype.itemsize  # K and V, read once
            ms = do_bench(fn)
            gbs = kv_bytes / ms / 1e6
            out[ctx][kind] = {
                "ms": ms,
                "bandwidth_gbs": gbs,
                "fraction_of_copy": gbs * 1e9 / copy_bw,
            }
            print(
                f"attention {kind} ctx={ctx}: {ms:.3f} ms, {gbs:.0f} GB/s, "
                f"{gbs * 1e9 / copy_bw:.2f} of copy"
            )
    return out


def bench_lora(model_dir: Path) -> dict:
    """One decode step's projections at 64 rows: base vs base + 8 adapters via the kernels."""
    from engine.device import to_device
    from engine.models.loader import load_model
    from lora.adapter import LoRAAdapter, projection_shapes
    from lora.batch import GROUPS, KernelLoRABatch, LoRASlots

    dev, dtype = common.DEV, common.DTYPE
    model, cfg, _ = load_model(model_dir, device=dev, dtype=dtype)
    rows, rank = SIZES["lora"]
    slots = LoRASlots(cfg, max_loras=8, max_rank=rank, device=dev, dtype=dtype)
    shapes = projection_shapes(cfg)
    for i in range(8):
        g = torch.Generator().manual_seed(i)
        weights = {
            (layer, proj): (
                torch.randn(size_in, rank, generator=g) * 0.01,
                torch.randn(rank, size_out, generator=g) * 0.01,
            )
            for layer in range(cfg.num_layers)
            for proj, (size_in, size_out) in shapes.items()
        }
        adapter = LoRAAdapter(f"a{i}", "", str(i), rank, weights)
        slots.activate([adapter])
    token_slots = [1 + r // 8 for r in range(rows)]
    batch = to_device(KernelLoRABatch.build(slots, token_slots), torch.device(dev))
    x = {
        "qkv": torch.randn(rows, cfg.hidden_size, device=dev, dtype=dtype),
        "o": torch.randn(rows, cfg.num_heads * cfg.head_dim, device=dev, dtype=dtype),
        "gate_up": torch.randn(rows, cfg.hidden_size, device=dev, dtype=dtype),
        "down": torch.randn(rows, cfg.intermediate_size, device=dev, dtype=dtype),
    }
    linears = {
        "qkv": "self_attn.qkv_proj",
        "o": "self_attn.o_proj",
        "gate_up": "mlp.gate_up_proj",
        "down": "mlp.down_proj",
    }

    def step(with_lora: bool):
        for i, layer in enumerate(model.layers):
            for group in GROUPS:
                y = layer.get_submodule(linears[group]).format(x[group])
                if with_lora:
                    batch.apply(i, group, x[group], y)

    base, lora = do_bench(lambda: step(False)), do_bench(lambda: step(True))
    print(f"lora: base {base:.3f} ms, 8 adapters {lora:.3f} ms, overhead {lora / base - 1:.2%}")
    return {"base_ms": base, "lora_ms": lora, "overhead": lora / base - 1}


def bench_verify(vocab: int) -> dict:
    """Sampling a verify step: the [R, V] logits to the host and verification there (the torch
    reference, as the engine did before sampling moved to the device) vs. the engine's path now,
    engine.rejection.verify_batched on the device with the fused kernel (softmax, the draws and
    both kernels there; tokens back in one copy)."""
    from engine.device import to_host
    from engine.rejection import VerifyRow, verify_batched
    from kernels.triton_rejection import rejection_verify

    dev, dtype = common.DEV, common.DTYPE
    num_reqs, num_drafts = SIZES["verify"]
    rows_each = num_drafts + 1
    num_rows = num_reqs * rows_each
    logits = torch.randn(num_rows, vocab, device=dev, dtype=dtype) * 3
    drafts = logits.view(num_reqs, rows_each, vocab)[:, :-1].argmax(-1).tolist()  # often kept
    rows = [VerifyRow(b * rows_each, drafts[b], None, False, None) for b in range(num_reqs)]
    host_generator = torch.Generator().manual_seed(0)
    device_generator = torch.Generator(dev).manual_seed(0)

    def on_host():
        pending = verify_batched(logits.float().cpu(), rows, host_generator)
        pending.results(pending.tokens.tolist(), pending.num_accepted.tolist())

    def on_device():
        pending = verify_batched(logits.float(), rows, device_generator, rejection_verify)
        tokens, accepted = to_host([pending.tokens, pending.num_accepted])  # the one sync
        pending.results(tokens.tolist(), accepted.tolist())

    host, fused = do_bench(on_host), do_bench(on_device)
    print(
        f"verify {num_reqs} x (1 + {num_drafts}) rows, vocab {vocab}: host {host:.3f} ms, "
        f"fused on device {fused:.3f} ms, {host / fused:.1f}x"
    )
    return {"host_ms": host, "fused_ms": fused, "x_host": host / fused}

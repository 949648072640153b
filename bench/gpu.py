"""GPU benchmark: the Triton kernels and the engine on CUDA, bf16, against the GPU's own copy
bandwidth and HF transformers on the same GPU and workload.

    python -m bench.gpu [--parts attention,lora,verify,decode,sweep] [--models smollm2,1b] [--quick]
    python -m bench.gpu --smoke     # the same code on CPU at toy sizes (Triton's interpreter)

Random-weight Llama models, saved as HF directories (safetensors, a word-level tokenizer over
the ids) in a temporary folder: SmolLM2-135M's shapes and a ~1B config (Llama-3.2-1B's shapes).
Timings are CUDA-event medians (triton.testing.do_bench) for kernels and wall clock after a
synchronize for whole runs; model loading and warm-up are excluded.

- copy: device-to-device copy of 1 GiB, bandwidth = bytes read + written / time (the roofline).
- attention: `paged_decode_attention` at 32 requests x contexts 1k..32k (1B's heads: 32 query,
  8 KV, dim 64; scattered blocks of 16), bandwidth = K/V bytes read / time, against copy; the
  same with a 4x wider block table (a CUDA graph's), and verification (1 + 4 queries per
  request, `paged_attention`).
- lora: one decode step's projections of every layer (1B) at 64 rows, base only vs. base plus the
  SGMV kernels (lora.batch.LoRABatch on the Triton path) with 8 distinct rank-16 adapters on all
  seven projections, 8 rows each.
- verify: one speculative step's sampling of 64 temperature-1 requests with 4 one-hot drafts
  each over the largest model's vocabulary: the [320, V] logits to the host and
  engine.rejection.verify there (the engine before sampling moved to the device) against the
  engine's path, engine.rejection.verify_batched with kernels.triton_rejection (softmax, the
  draws and both kernels on the device, 64 x 5 tokens back).
- decode: the engine at batch 1 (prompt 512, 128 new tokens): decode tokens/s against the
  roofline (weights + the KV read per step, over the copy bandwidth), with CUDA graphs and
  async scheduling (the defaults), with graphs and synchronous steps, and enforce_eager=True.
- sweep: the engine at batch 1..128 (prompt 128, 128 new tokens, EOS ignored, greedy) against
  HF `generate` one request at a time (sequential) and in static batches of the same size; then
  the largest batch sampled (temperature 0.8, top-p 0.95), and greedy with async scheduling
  off, against its greedy run.

Last line: RESULT decode_attention_bw_ratio=.. verify_attention_bw_ratio=..
decode_roofline_fraction_1b=..
throughput_x_hf_seq=.. lora_overhead_8=.. fused_verify_x_host=..
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

MODELS = {
    "smollm2": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
    "micro": dict(  # --smoke only
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=512,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    ),
}
# Workload sizes; --smoke swaps in SMOKE.
SIZES = dict(
    attention=(32, 32, 8, [1024, 4096, 16384, 32768]),  # requests, q heads, kv heads, contexts
    lora=(64, 16),  # rows, rank
    verify=(64, 4),  # requests, drafts each
    decode=(512, 128),  # prompt, new tokens
    sweep=(128, 128, [1, 8, 32, 128], 4),  # prompt, new tokens, batch sizes, hf_seq requests
)
SMOKE = dict(
    attention=(2, 4, 2, [64, 128]),
    lora=(16, 8),
    verify=(4, 2),
    decode=(32, 8),
    sweep=(16, 8, [1, 2], 2),
)


# Where it runs: CUDA in bf16; --smoke: CPU in fp32 at toy sizes, to check the code itself
# before a GPU session spends its time on it.
DEV, DTYPE = "cuda", torch.bfloat16


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def free_cached() -> None:
    """Gives the last engine's KV pool and graphs back before the next one sizes its own from
    free memory (collected first, in case a reference cycle still holds them)."""
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()


def do_bench(fn) -> float:
    """Median milliseconds: CUDA events with the L2 flushed between calls (CPU: 3 calls)."""
    if DEV != "cuda":
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return sorted(times)[1]
    from triton.testing import do_bench as triton_bench

    return triton_bench(fn, warmup=25, rep=200, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(1 << (30 if DEV == "cuda" else 24), dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def make_model_dir(root: Path, name: str) -> Path:
    """A random-weight Llama in bf16 with a word-level tokenizer ("<i>" for every id)."""
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    path = root / name
    shapes = MODELS[name]
    config = LlamaConfig(
        **shapes,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    with torch.device(DEV):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPE)
    model.save_pretrained(path)
    vocab = {f"<{i}>": i for i in range(shapes["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<2>", bos_token="<1>").save_pretrained(
        path
    )
    del model
    free_cached()
    return path


def param_bytes(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open is no dict)
                t = st.get_slice(key)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += DTYPE.itemsize * n
    return total


def bench_attention(copy_bw: float, quick: bool) -> dict:
    """Per context: decode (one query per request), decode with the block table 4x wider (as a
    CUDA graph's, sized for the longest context allowed), and verification (1 + 4 queries per
    request, the varlen kernel): K/V bytes read once over time, against copy bandwidth."""
    from kernels.triton_attention import paged_attention
    from kernels.triton_decode import paged_decode_attention

    num_reqs, hq, hkv, contexts = SIZES["attention"]
    dim, bs = 64, 16
    out = {}
    for ctx in contexts[:-1] if quick else contexts:
        blocks_per_req = ctx // bs
        num_blocks = num_reqs * blocks_per_req + 1
        k_cache = torch.randn(hkv, num_blocks, bs, dim, device=DEV, dtype=DTYPE)
        v_cache = torch.randn_like(k_cache)
        perm = torch.randperm(num_blocks - 1, device=DEV) + 1
        tables = perm.view(num_reqs, blocks_per_req).to(torch.int32)
        wide = torch.zeros(num_reqs, 4 * blocks_per_req, dtype=torch.int32, device=DEV)
        wide[:, :blocks_per_req] = tables
        seq_lens = torch.full((num_reqs,), ctx, dtype=torch.int32, device=DEV)
        q = torch.randn(num_reqs, hq, dim, device=DEV, dtype=DTYPE)
        qv = torch.randn(num_reqs * 5, hq, dim, device=DEV, dtype=DTYPE)  # 1 + 4 queries each
        starts = torch.arange(num_reqs + 1, dtype=torch.int32, device=DEV) * 5
        scale = dim**-0.5
        decode, verify = paged_decode_attention, paged_attention
        runs = {
            "decode": partial(decode, q, k_cache, v_cache, tables, seq_lens, scale),
            "decode_wide_table": partial(decode, q, k_cache, v_cache, wide, seq_lens, scale),
            "verify": partial(verify, qv, k_cache, v_cache, tables, starts, seq_lens, scale, 5),
        }
        kv_bytes = 2 * num_reqs * ctx * hkv * dim * DTYPE.itemsize  # K and V, read once
        out[ctx] = {}
        for kind, fn in runs.items():
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
    from lora.batch import GROUPS, LoRABatch, LoRASlots

    model, cfg, _ = load_model(model_dir, device=DEV, dtype=DTYPE)
    rows, rank = SIZES["lora"]
    slots = LoRASlots(cfg, max_loras=8, max_rank=rank, device=DEV, dtype=DTYPE)
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
    batch = to_device(
        LoRABatch.build(slots, [1 + r // 8 for r in range(rows)], "triton"), torch.device(DEV)
    )
    x = {
        "qkv": torch.randn(rows, cfg.hidden_size, device=DEV, dtype=DTYPE),
        "o": torch.randn(rows, cfg.num_heads * cfg.head_dim, device=DEV, dtype=DTYPE),
        "gate_up": torch.randn(rows, cfg.hidden_size, device=DEV, dtype=DTYPE),
        "down": torch.randn(rows, cfg.intermediate_size, device=DEV, dtype=DTYPE),
    }
    linears = {"qkv": "qkv_proj", "o": "o_proj", "gate_up": "gate_up_proj", "down": "down_proj"}

    def step(with_lora: bool):
        for i, layer in enumerate(model.layers):
            for group in GROUPS:
                y = getattr(layer, linears[group])(x[group])
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

    num_reqs, num_drafts = SIZES["verify"]
    rows_each = num_drafts + 1
    num_rows = num_reqs * rows_each
    logits = torch.randn(num_rows, vocab, device=DEV, dtype=DTYPE) * 3
    drafts = logits.view(num_reqs, rows_each, vocab)[:, :-1].argmax(-1).tolist()  # often kept
    rows = [VerifyRow(b * rows_each, drafts[b], None, False, None) for b in range(num_reqs)]
    host_generator = torch.Generator().manual_seed(0)
    device_generator = torch.Generator(DEV).manual_seed(0)

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


def engine_run(
    model_dir: Path,
    prompts,
    max_tokens: int,
    max_num_seqs: int,
    eager=False,
    sampled=False,
    overlap=True,
):
    """(seconds, output tokens, decode-only seconds, decode steps) for one engine run;
    eager: no CUDA graphs; sampled: temperature 0.8, top-p 0.95 instead of greedy; overlap:
    async scheduling (the default on CUDA; set here so that --smoke runs it on CPU too)."""
    from engine import LLM, SamplingParams

    llm = LLM(
        str(model_dir),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(2048, max_num_seqs),
        enable_prefix_caching=False,
        enforce_eager=eager,
        async_scheduling=overlap,
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if sampled:
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    sync()
    t0 = time.perf_counter()
    decode_s, decode_steps, tokens = 0.0, 0, 0
    sched = engine.scheduler
    while engine.has_unfinished_requests():
        s0, launched = time.perf_counter(), engine.num_steps
        # Decode-only: nobody waits, and every running request has its first token on the host
        # (under async scheduling the call that brings it also launched a decode step, while
        # waiting for the prefill) and one token to compute. Steps counted as launched: the
        # last call only collects.
        mixed = bool(sched.waiting) or any(
            r.num_output_tokens == 0 or r.num_uncomputed > 1 for r in sched.running
        )
        outs = engine.step()
        if not mixed:
            decode_s += time.perf_counter() - s0
            decode_steps += engine.num_steps - launched
        tokens += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
    sync()
    seconds = time.perf_counter() - t0
    del llm, engine
    free_cached()
    return seconds, tokens, decode_s, decode_steps


def bench_decode(model_dir: Path, name: str, copy_bw: float) -> dict:
    """Batch-1 decode tokens/s with CUDA graphs (async scheduling on, then off) and eagerly,
    against the roofline."""
    prompt_len, new = SIZES["decode"]
    prompt = [[(7 * i) % 400 + 10 for i in range(prompt_len)]]
    shapes = MODELS[name]
    kv_per_token = (
        shapes["num_hidden_layers"] * 2 * shapes["num_key_value_heads"] * 64 * DTYPE.itemsize
    )
    weights = param_bytes(model_dir)
    mean_ctx = prompt_len + new / 2
    roofline = copy_bw / (weights + kv_per_token * mean_ctx)  # tokens/s
    out = {"roofline_tok_s": roofline}
    for mode, eager, overlap in (
        ("graphs", False, True),
        ("graphs, sync steps", False, False),
        ("eager", True, True),
    ):
        _, _, decode_s, steps = engine_run(model_dir, prompt, new, 1, eager=eager, overlap=overlap)
        tok_s = steps / decode_s if steps else float("nan")
        out[mode] = {"tok_s": tok_s, "fraction": tok_s / roofline}
        print(
            f"decode {name} ({mode}): batch 1, {tok_s:.1f} tok/s over {steps} decode steps; "
            f"roofline {roofline:.0f} tok/s ({weights / 1e9:.2f} GB weights); "
            f"{tok_s / roofline:.1%}"
        )
    out["fraction"] = out["graphs"]["fraction"]
    return out


def hf_generate(model, prompts, max_tokens: int, batch: int) -> tuple[float, int]:
    """HF generate in batches of `batch` (equal prompt lengths: no padding); (seconds, tokens)."""
    vocab = model.config.vocab_size
    sync()
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[i : i + batch], device=DEV)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=vocab,  # unreachable: exactly max_tokens each
            pad_token_id=0,
        )
        tokens += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    sync()
    return time.perf_counter() - t0, tokens


def bench_sweep(model_dir: Path, name: str, quick: bool) -> dict:
    from transformers import AutoModelForCausalLM

    prompt_len, new, batches, num_seq = SIZES["sweep"]
    batches = batches[:-1] if quick else batches
    prompts = [
        [(31 * i + 7 * j) % 400 + 10 for j in range(prompt_len)] for i in range(max(batches))
    ]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPE).to(DEV).eval()
    hf_generate(hf, prompts[:1], 8, 1)  # warm-up
    seq_s, seq_tok = hf_generate(hf, prompts[:num_seq], new, 1)
    hf_seq = seq_tok / seq_s
    rows = {}
    for b in batches:
        st_s, st_tok = hf_generate(hf, prompts[:b], new, b)
        rows[b] = {"hf_static_tok_s": st_tok / st_s}
    del hf
    free_cached()
    for b in batches:
        seconds, tokens, _, _ = engine_run(model_dir, prompts[:b], new, b)
        rows[b]["tandem_tok_s"] = tokens / seconds
        rows[b]["x_hf_seq"] = rows[b]["tandem_tok_s"] / hf_seq
        rows[b]["x_hf_static"] = rows[b]["tandem_tok_s"] / rows[b]["hf_static_tok_s"]
        print(
            f"sweep {name} batch {b}: tandem {rows[b]['tandem_tok_s']:.0f} tok/s, HF static "
            f"{rows[b]['hf_static_tok_s']:.0f}, HF sequential {hf_seq:.0f}: "
            f"{rows[b]['x_hf_seq']:.1f}x seq, {rows[b]['x_hf_static']:.2f}x static"
        )
    # Sampling on the device: the largest batch again with temperature and top-p.
    b = batches[-1]
    seconds, tokens, _, _ = engine_run(model_dir, prompts[:b], new, b, sampled=True)
    sampled = {"batch": b, "tandem_tok_s": tokens / seconds}
    sampled["x_greedy"] = sampled["tandem_tok_s"] / rows[b]["tandem_tok_s"]
    print(
        f"sweep {name} batch {b} sampled (temperature 0.8, top-p 0.95): "
        f"{sampled['tandem_tok_s']:.0f} tok/s, {sampled['x_greedy']:.2f}x greedy"
    )
    # Async scheduling off at the largest batch: what overlapping the host with the device buys.
    seconds, tokens, _, _ = engine_run(model_dir, prompts[:b], new, b, overlap=False)
    sync_steps = {"batch": b, "tandem_tok_s": tokens / seconds}
    sync_steps["async_x_sync"] = rows[b]["tandem_tok_s"] / sync_steps["tandem_tok_s"]
    print(
        f"sweep {name} batch {b} with synchronous steps: {sync_steps['tandem_tok_s']:.0f} "
        f"tok/s (async scheduling {sync_steps['async_x_sync']:.2f}x)"
    )
    return {"hf_seq_tok_s": hf_seq, "batches": rows, "sampled": sampled, "sync": sync_steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="attention,lora,verify,decode,sweep")
    ap.add_argument("--models", default="smollm2,1b")
    ap.add_argument("--quick", action="store_true", help="fewer contexts and batch sizes")
    ap.add_argument("--json", help="also write every figure to this file")
    ap.add_argument("--smoke", action="store_true", help="CPU, toy sizes: checks the code only")
    args = ap.parse_args(argv)
    global DEV, DTYPE
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
        DEV, DTYPE = "cpu", torch.float32
        SIZES.update(SMOKE)
        args.models = "micro"
    elif not torch.cuda.is_available():
        raise SystemExit("bench.gpu needs a CUDA device (or --smoke)")
    import transformers
    import triton

    parts, names = args.parts.split(","), args.models.split(",")
    device = torch.cuda.get_device_name() if DEV == "cuda" else "CPU (smoke run)"
    print(
        f"# {device}, torch {torch.__version__}, triton {triton.__version__}, "
        f"transformers {transformers.__version__}, {DTYPE}"
    )
    results: dict = {"device": device}
    copy_bw = copy_bandwidth()
    results["copy_gbs"] = copy_bw / 1e9
    print(f"copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + write)")
    if "attention" in parts:
        results["attention"] = bench_attention(copy_bw, args.quick)
    if "verify" in parts:  # the largest model's vocabulary
        results["verify"] = bench_verify(MODELS[names[-1]]["vocab_size"])
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {name: make_model_dir(Path(tmp), name) for name in names}
        if "lora" in parts:  # the largest model asked for
            results["lora"] = bench_lora(dirs[names[-1]])
        for name in names:
            if "decode" in parts:
                results[f"decode_{name}"] = bench_decode(dirs[name], name, copy_bw)
            if "sweep" in parts:
                results[f"sweep_{name}"] = bench_sweep(dirs[name], name, args.quick)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))

    def fmt(v):
        return "n/a" if v is None else f"{v:.3f}"

    att = results.get("attention")
    longest = att[max(att)]["decode"]["fraction_of_copy"] if att else None
    verify = att[max(att)]["verify"]["fraction_of_copy"] if att else None
    dec = results.get(f"decode_{names[-1]}", {}).get("fraction")
    sweeps = [results[k] for k in results if k.startswith("sweep_")]
    best_x = max((r["x_hf_seq"] for s in sweeps for r in s["batches"].values()), default=None)
    lora = results.get("lora", {}).get("overhead")
    fused = results.get("verify", {}).get("x_host")
    print(
        f"RESULT decode_attention_bw_ratio={fmt(longest)} verify_attention_bw_ratio={fmt(verify)} "
        f"decode_roofline_fraction_1b={fmt(dec)} "
        f"throughput_x_hf_seq={fmt(best_x)} lora_overhead_8={fmt(lora)} "
        f"fused_verify_x_host={fmt(fused)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

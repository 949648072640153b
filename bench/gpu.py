"""GPU benchmark: the Triton kernels and the engine on CUDA, bf16, against the GPU's own copy
bandwidth and HF transformers on the same GPU and workload.

    python -m bench.gpu [--parts attention,lora,verify,decode,sweep,spec] [--models smollm2,1b]
                        [--quick]
    python -m bench.gpu --smoke     # the same code on CPU at toy sizes (Triton's interpreter)

Random-weight Llama models, saved as HF directories (safetensors, a word-level tokenizer over
the ids) in a temporary folder: SmolLM2-135M's shapes and a ~1B config (Llama-3.2-1B's shapes).
Timings are CUDA-event medians (triton.testing.do_bench) for kernels and wall clock after a
synchronize for whole runs; model loading and warm-up are excluded.

- copy: device-to-device copy of 1 GiB, bandwidth = bytes read + written / time (the roofline).
- attention: `paged_decode_attention` at 32 requests x contexts 1k..32k (1B's heads: 32 query,
  8 KV, dim 64; scattered blocks of 16), bandwidth = K/V bytes read / time, against copy; the
  same with a 4x wider block table (a CUDA graph's), in a 512-key sliding window (bytes: the
  window's), and verification (1 + 4 queries per request, `paged_attention`).
- lora: one decode step's projections of every layer (1B) at 64 rows, base only vs. base plus the
  SGMV kernels (lora.batch.KernelLoRABatch, the Triton path) with 8 distinct rank-16 adapters on
  all seven projections, 8 rows each.
- verify: one speculative step's sampling of 64 temperature-1 requests with 4 one-hot drafts
  each over the largest model's vocabulary: the [320, V] logits to the host and
  engine.rejection.verify there (the engine before sampling moved to the device) against the
  engine's path, engine.rejection.verify_batched with kernels.triton_rejection (softmax, the
  draws and both kernels on the device, 64 x 5 tokens back).
- decode: the engine at batch 1 (prompt 512, 128 new tokens): decode tokens/s against the
  roofline (weights + the KV read per step, over the copy bandwidth), with CUDA graphs and
  async scheduling (the defaults), with graphs and synchronous steps, and enforce_eager=True.
- spec: n-gram speculation (adaptive k) against plain decoding at batch 1 and 32, greedy, in
  float32, on prompts that repeat a phrase; outputs must be equal (exit code 1 if not).
- sweep: the engine at batch 1..128 (prompt 128, 128 new tokens, EOS ignored, greedy) against
  HF `generate` one request at a time (sequential) and in static batches of the same size; then
  the largest batch sampled (temperature 0.8, top-p 0.95), and greedy with async scheduling
  off, against its greedy run.

Last line: RESULT decode_attention_bw_ratio=.. verify_attention_bw_ratio=..
decode_roofline_fraction_1b=..
throughput_x_hf_seq=.. lora_overhead_8=.. fused_verify_x_host=..

The kernel parts (attention, lora, verify) are in bench/gpu_kernels.py; what every part shares
(device, timing, model shapes and sizes, the model directories) in bench/gpu_common.py.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench import gpu_common as common
from bench.gpu_common import (
    MODELS,
    SIZES,
    copy_bandwidth,
    free_cached,
    make_model_dir,
    param_bytes,
    sync,
)
from bench.gpu_kernels import bench_attention, bench_lora, bench_verify


def engine_run(
    model_dir: Path,
    prompts,
    max_tokens: int,
    max_num_seqs: int,
    eager=False,
    sampled=False,
    overlap=True,
    outputs: dict | None = None,
    speculation: dict | None = None,
    **config,
):
    """(seconds, output tokens, decode-only seconds, decode steps) for one engine run;
    eager: no CUDA graphs; sampled: temperature 0.8, top-p 0.95 instead of greedy; overlap:
    async scheduling (the default on CUDA; set here so that --smoke runs it on CPU too);
    outputs: filled with each request's token ids; speculation: filled with the snapshot's
    speculation view after the timed run (counts include the warm-up's); config: more
    EngineConfig fields."""
    from engine import LLM, SamplingParams

    llm = LLM(
        str(model_dir),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(2048, max_num_seqs),
        enable_prefix_caching=False,
        enforce_eager=eager,
        async_scheduling=overlap,
        **config,
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if sampled:
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, ignore_eos=True)
    # Warm-up on the timed prompts themselves, long enough for speculation to verify drafts:
    # Triton specializes kernels on argument sizes, so a shorter warm-up leaves a compile inside
    # the timed run (the H200's batch-1 sweep: 192 tok/s against the decode part's 565; n-gram
    # at 0.68x plain when only plain steps had been warmed).
    llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
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
        if outputs is not None:
            outputs.update({o.request_id: o.outputs[0].token_ids for o in outs if o.finished})
    sync()
    seconds = time.perf_counter() - t0
    if speculation is not None:
        speculation.update(engine.snapshot()["speculation"])
    del llm, engine
    free_cached()
    return seconds, tokens, decode_s, decode_steps


def bench_decode(model_dir: Path, name: str, copy_bw: float) -> dict:
    """Batch-1 decode tokens/s with CUDA graphs (async scheduling on, then off) and eagerly,
    against the roofline."""
    prompt_len, new = SIZES["decode"]
    prompt = [[(7 * i) % 400 + 10 for i in range(prompt_len)]]
    shapes = MODELS[name]
    itemsize = common.DTYPE.itemsize
    kv_per_token = shapes["num_hidden_layers"] * 2 * shapes["num_key_value_heads"] * 64 * itemsize
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
        ids = torch.tensor(prompts[i : i + batch], device=common.DEV)
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
    dev, dtype = common.DEV, common.DTYPE
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(dev).eval()
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


def bench_spec(model_dir: Path, name: str) -> dict:
    """n-gram speculation (adaptive k, cap 4) against plain decoding, greedy, at batch 1 and
    the quick sweep's largest batch: prompts that repeat a phrase, so the lookup finds drafts
    where the model continues the pattern. In float32, where outputs must be equal (exit code 1
    otherwise): in bf16 a row's logits depend on how many rows share the GEMM (cuBLAS picks its
    kernel by shape), so even plain batch-1 and batch-8 outputs part ways there."""
    prompt_len, new, batches, _ = SIZES["sweep"]
    out = {}
    for b in (1, batches[-2]):
        prompts = [[(j % (5 + i % 7)) * 3 + 10 + i for j in range(prompt_len)] for i in range(b)]
        plain: dict = {}
        spec: dict = {}
        p_s, p_tok, _, _ = engine_run(model_dir, prompts, new, b, outputs=plain, dtype="float32")
        view: dict = {}
        s_s, s_tok, _, _ = engine_run(
            model_dir, prompts, new, b, outputs=spec, speculation=view, dtype="float32",
            speculative_method="ngram",
        )  # fmt: skip
        equal = plain == spec
        out[b] = {"plain_tok_s": p_tok / p_s, "ngram_tok_s": s_tok / s_s, "equal": equal}
        out[b]["x_plain"] = out[b]["ngram_tok_s"] / out[b]["plain_tok_s"]
        out[b]["speculation"] = view
        print(
            f"spec {name} batch {b}: n-gram {out[b]['ngram_tok_s']:.0f} tok/s, plain "
            f"{out[b]['plain_tok_s']:.0f}: {out[b]['x_plain']:.2f}x, outputs equal: {equal}"
        )
        # why: how many drafts the planner asked for, how many held, what it thinks steps cost
        keys = ("num_drafts", "num_accepted", "num_steps", "acceptance_rate")
        seen = {k: view.get(k) for k in keys}
        print(f"  drafts {seen}, verify {view.get('verify_seconds', 0):.2f} s, "
              f"planner {view.get('adaptive')}")  # fmt: skip
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="attention,lora,verify,decode,sweep")
    ap.add_argument("--models", default="smollm2,1b")
    ap.add_argument("--quick", action="store_true", help="fewer contexts and batch sizes")
    ap.add_argument("--json", help="also write every figure to this file")
    ap.add_argument("--smoke", action="store_true", help="CPU, toy sizes: checks the code only")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        common.use_cpu()
        args.models = "micro"
    elif not torch.cuda.is_available():
        raise SystemExit("bench.gpu needs a CUDA device (or --smoke)")
    parts, names = args.parts.split(","), args.models.split(",")
    results = run_parts(parts, names, args.quick)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print(result_line(results, names))
    unequal = [
        k
        for k in results
        if k.startswith("spec_") and not all(r["equal"] for r in results[k].values())
    ]
    return 1 if unequal else 0


def run_parts(parts: list[str], names: list[str], quick: bool) -> dict:
    """Runs the parts asked for (printing as it goes); every figure, by part and model."""
    results: dict = {"device": print_versions()}
    copy_bw = copy_bandwidth()
    results["copy_gbs"] = copy_bw / 1e9
    print(f"copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + write)")
    if "attention" in parts:
        results["attention"] = bench_attention(copy_bw, quick)
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
                results[f"sweep_{name}"] = bench_sweep(dirs[name], name, quick)
            if "spec" in parts:
                results[f"spec_{name}"] = bench_spec(dirs[name], name)
    return results


def print_versions() -> str:
    """Prints the device and library versions; returns the device's name."""
    import transformers
    import triton

    device = torch.cuda.get_device_name() if common.DEV == "cuda" else "CPU (smoke run)"
    print(
        f"# {device}, torch {torch.__version__}, triton {triton.__version__}, "
        f"transformers {transformers.__version__}, {common.DTYPE}"
    )
    return device


def result_line(results: dict, names: list[str]) -> str:
    """The last line: one headline figure per part, "n/a" for a part not run."""

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
    return (
        f"RESULT decode_attention_bw_ratio={fmt(longest)} verify_attention_bw_ratio={fmt(verify)} "
        f"decode_roofline_fraction_1b={fmt(dec)} "
        f"throughput_x_hf_seq={fmt(best_x)} lora_overhead_8={fmt(lora)} "
        f"fused_verify_x_host={fmt(fused)}"
    )


if __name__ == "__main__":
    raise SystemExit(main())

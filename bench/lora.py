"""Multi-LoRA throughput: one batch whose requests use 0, 1, 4, 8 or 32 distinct adapters.

    python -m bench.lora [--batch 32] [--max-tokens 64] [--repeats 2] [--no-hf]

SmolLM2-135M-Instruct, one thread, greedy, EOS ignored; rank-8 PEFT adapters on all seven
projections (q/k/v/o/gate/up/down, A and B random), saved with `save_pretrained` to a temporary
directory. Each mode runs the same 32 prompts in one batch: **base** (no adapter), then 1, 4, 8
and 32 distinct adapters spread round-robin over the requests (max_loras = 32, so every step
holds them all). Throughput = output tokens / wall seconds, best of --repeats alternating runs;
ratios are against base in the same run. Also, unless --no-hf: HF transformers + PEFT
`generate()` on the same batch (left-padded) with 8 adapters mixed through PEFT's
`adapter_names`, and outputs compared with ours.
Last line: RESULT lora_throughput_ratio_8=.. lora_throughput_ratio_32=..
"""

from __future__ import annotations

import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import gc
import random
import tempfile
import time
from pathlib import Path

import torch

MODEL = "smollm2-135m-instruct"
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base: Path, root: Path, n: int, rank: int) -> list[Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    peft_model = get_peft_model(
        model, LoraConfig(r=rank, lora_alpha=16, target_modules=ALL7, lora_dropout=0.0)
    )
    paths = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        path = root / f"adapter{i}"
        peft_model.save_pretrained(str(path))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--counts", default="1,4,8,32")
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from engine import LLM, SamplingParams
    from engine.models.registry import resolve_model
    from lora import LoRARequest

    counts = [int(c) for c in args.counts.split(",")]
    base_dir = resolve_model(MODEL)
    root = Path(tempfile.mkdtemp(prefix="tandem-lora-bench-"))
    paths = make_adapters(base_dir, root, max(counts), rank=8)
    llm = LLM(
        MODEL,
        quantization=None,
        num_threads=1,
        enable_lora=True,
        max_loras=max(counts),
        max_lora_rank=8,
        max_num_seqs=max(args.batch, 1),
        enable_prefix_caching=False,
    )
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, 49000) for _ in range(rng.randint(16, 64))] for _ in range(args.batch)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    modes = {"base": None} | {f"{c} adapters": c for c in counts}

    def loras(count):
        if count is None:
            return None
        return [LoRARequest(f"a{i % count}", str(paths[i % count])) for i in range(args.batch)]

    for count in counts:  # load outside the timings
        for lora in loras(count):
            llm.load_lora(lora)
    print(
        f"# lora bench: {MODEL}, fp32, torch threads=1, batch {args.batch}, "
        f"{args.max_tokens} tokens each, rank 8 on {len(ALL7)} projections"
    )
    best, outputs = dict.fromkeys(modes, float("inf")), {}
    for _ in range(args.repeats):
        for mode, count in modes.items():
            gc.collect()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras(count))
            best[mode] = min(best[mode], time.perf_counter() - t0)
            outputs[mode] = [o.outputs[0].token_ids for o in outs]
    tokens = args.batch * args.max_tokens
    print("\n| mode | seconds | tok/s | vs base |\n|---|---|---|---|")
    for mode in modes:
        print(
            f"| {mode} | {best[mode]:.2f} | {tokens / best[mode]:.1f} | "
            f"{best['base'] / best[mode]:.3f} |"
        )
    changed = sum(
        a != b for a, b in zip(outputs["base"], outputs[f"{counts[-1]} adapters"], strict=True)
    )
    print(
        f"# requests whose output differs from base with {counts[-1]} adapters: "
        f"{changed}/{args.batch}"
    )
    if not args.no_hf and 8 in counts:
        hf_seconds, same = hf_mixed(base_dir, paths[:8], prompts, args.max_tokens, outputs)
        print(
            f"# HF + PEFT generate(), 8 adapters mixed via adapter_names, batch {args.batch}: "
            f"{hf_seconds:.2f} s ({tokens / hf_seconds:.1f} tok/s); tandem "
            f"{hf_seconds / best['8 adapters']:.2f}x; outputs equal {same}/{args.batch}"
        )
    r8 = best["base"] / best["8 adapters"] if 8 in counts else float("nan")
    r32 = best["base"] / best["32 adapters"] if 32 in counts else float("nan")
    print(f"RESULT lora_throughput_ratio_8={r8:.3f} lora_throughput_ratio_32={r32:.3f}")
    return 0


def hf_mixed(base_dir, paths, prompts, max_tokens, outputs) -> tuple[float, int]:
    """HF + PEFT with the 8 adapters loaded and mixed per row (adapter_names), left-padded."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(paths[0]), adapter_name="a0")
    for i, path in enumerate(paths[1:], start=1):
        model.load_adapter(str(path), adapter_name=f"a{i}")
    model.eval()
    width = max(len(p) for p in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    names = [f"a{i % 8}" for i in range(len(prompts))]
    t0 = time.perf_counter()
    with torch.no_grad():
        # EOS ignored as in our runs: an unreachable eos id, not min_new_tokens (which would
        # ban EOS from the argmax where our greedy may pick it).
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=model.config.vocab_size,
            adapter_names=names,
        )
    seconds = time.perf_counter() - t0
    ours = outputs["8 adapters"]
    same = sum(out[i, width:].tolist() == ours[i] for i in range(len(prompts)))
    return seconds, same


if __name__ == "__main__":
    raise SystemExit(main())

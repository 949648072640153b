"""Multi-LoRA throughput: one batch whose requests use no adapter, or 1, 4, 8 or 32 distinct
adapters.

    python -m bench.lora [--batch 32] [--max-tokens 64] [--repeats 3] [--counts 1,4,8,32]
                         [--no-hf]

SmolLM2-135M-Instruct fp32, one thread, greedy, EOS ignored, prefix caching off; rank-8 PEFT
adapters on all seven projections (q/k/v/o/gate/up/down, A and B random), saved with
`save_pretrained` to a temporary directory of this process. Each mode runs the same prompts
(random ids, 16-64 tokens) in one `LLM.generate` batch: **base** (no adapter), and **loraN**
for each N of --counts: N distinct adapters spread round-robin over the requests (max_loras =
the largest N, so one step holds them all; every adapter is loaded before the timings). Unless
--no-hf, **hf+peft8**: HF transformers + PEFT `generate()` at bench.hf_baselines' HF_FASTEST setting
on the same batch (left-padded), the 8 adapters mixed per row through PEFT's `adapter_names`.
The modes alternate (bench/harness.py: a warm-up each, then --repeats rounds); each reports the
median wall seconds of the batch and the spread, throughput = output tokens / seconds.
Equality: once, outside the timed rounds, HF + PEFT runs every request alone (batch 1, no
padding) with the adapter each mode gives it (or none); every request of every mode must equal
that reference token for token (exit 1 otherwise).
Last line: RESULT lora_throughput_ratio_8=.. lora_throughput_ratio_32=.. [tandem_x_hf_8=..]
(loraN's throughput over base's; tandem_x_hf_8: hf+peft8's seconds over lora8's)
"""

from __future__ import annotations

import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.harness import Run, Timings, alternate, first_difference, summary
from bench.hf_baselines import HF_FASTEST, generate

MODEL = "smollm2-135m-instruct"
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 8
HF_ADAPTERS = 8  # adapters mixed in the hf+peft mode (its outputs are lora8's)
Pair = tuple[int, int | None]  # (request index, adapter index or None for the base model)


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


def make_prompts(batch: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randint(16, 64))] for _ in range(batch)]


def adapters_of(count: int | None, batch: int) -> list[int | None]:
    """Each request's adapter index in a mode with `count` adapters (None: base), round-robin."""
    return [None if count is None else i % count for i in range(batch)]


def engine_mode(llm, prompts: list[list[int]], max_tokens: int, loras) -> Callable[[], Run]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def run() -> Run:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        seconds = time.perf_counter() - t0
        ids = [o.outputs[0].token_ids for o in outs]
        return Run({"seconds": seconds}, ids, {"tokens": sum(map(len, ids))})

    return run


def load_peft(base_dir: Path, paths: list[Path]):
    """HF + PEFT at HF_FASTEST with every adapter loaded, as a0, a1, ..."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(base_dir), dtype=torch.float32, attn_implementation=HF_FASTEST["attn_implementation"]
    )
    model = PeftModel.from_pretrained(model, str(paths[0]), adapter_name="a0")
    for i, path in enumerate(paths[1:], start=1):
        model.load_adapter(str(path), adapter_name=f"a{i}")
    return model.eval()


def hf_mixed(model, prompts: list[list[int]], max_tokens: int, adapters: list[int]) -> list:
    """The prompts in one left-padded batch, each row with its adapter (PEFT's `adapter_names`),
    EOS ignored as in our runs."""
    return generate(model, prompts, max_tokens, adapter_names=[f"a{a}" for a in adapters])


def hf_alone(model, prompt: list[int], max_tokens: int, adapter: int | None) -> list[int]:
    """One request, batch 1, no padding, through PEFT's plain single-adapter path (the
    adapter made active, or every adapter disabled for the base model)."""
    if adapter is None:
        with model.disable_adapter():
            return generate(model, [prompt], max_tokens)[0]
    model.set_adapter(f"a{adapter}")
    return generate(model, [prompt], max_tokens)[0]


def hf_mode(model, prompts: list[list[int]], max_tokens: int) -> Callable[[], Run]:
    adapters = adapters_of(HF_ADAPTERS, len(prompts))

    def run() -> Run:
        t0 = time.perf_counter()
        ids = hf_mixed(model, prompts, max_tokens, adapters)
        seconds = time.perf_counter() - t0
        return Run({"seconds": seconds}, ids, {"tokens": sum(map(len, ids))})

    return run


def reference(model, prompts: list[list[int]], max_tokens: int, pairs: set[Pair]) -> dict:
    """HF + PEFT on each (request, adapter) pair alone."""
    return {(i, a): hf_alone(model, prompts[i], max_tokens, a) for i, a in pairs}


def mode_counts(counts: list[int], hf: bool) -> dict[str, int | None]:
    """Mode name -> its number of adapters (None: base)."""
    modes = {"base": None} | {f"lora{c}": c for c in counts}
    return modes | ({f"hf+peft{HF_ADAPTERS}": HF_ADAPTERS} if hf else {})


def measure(
    batch: int, max_tokens: int, counts: list[int], repeats: int, hf: bool = True
) -> tuple[dict[str, Timings], dict[str, list[list[int]]]]:
    """Every mode alternated on one batch, and each mode's expected outputs (the reference).
    The adapters live in a temporary directory for this call only."""
    from engine import LLM
    from engine.models.registry import resolve_model
    from lora import LoRARequest

    torch.set_num_threads(1)
    base_dir, prompts = resolve_model(MODEL), make_prompts(batch)
    modes = mode_counts(counts, hf)
    num_adapters = max(c or 0 for c in modes.values())
    with tempfile.TemporaryDirectory(prefix="tandem-lora-bench-") as root:
        paths = make_adapters(base_dir, Path(root), num_adapters, RANK)
        llm = LLM(
            MODEL,
            quantization=None,
            num_threads=1,
            enable_lora=True,
            max_loras=num_adapters,
            max_lora_rank=RANK,
            max_num_seqs=batch,
            enable_prefix_caching=False,
        )
        loras = [LoRARequest(f"a{i}", str(path)) for i, path in enumerate(paths)]
        for lora in loras:  # loaded outside the timings
            llm.load_lora(lora)
        peft_model = load_peft(base_dir, paths)
        runs = {}
        for name, count in modes.items():
            if name.startswith("hf"):
                runs[name] = hf_mode(peft_model, prompts, max_tokens)
            else:
                chosen = [None if a is None else loras[a] for a in adapters_of(count, batch)]
                runs[name] = engine_mode(llm, prompts, max_tokens, chosen)
        timings = alternate(runs, repeats, threads=1)
        wanted = {name: list(enumerate(adapters_of(c, batch))) for name, c in modes.items()}
        ref = reference(peft_model, prompts, max_tokens, {p for ps in wanted.values() for p in ps})
    return timings, {name: [ref[p] for p in pairs] for name, pairs in wanted.items()}


def mismatches(timings: dict[str, Timings], expected: dict[str, list[list[int]]]) -> dict:
    """Modes whose outputs differ from their reference, with where."""
    found = {}
    for name, t in timings.items():
        diff = first_difference(expected[name], t.outputs)
        if diff:
            found[name] = diff
    return found


def differ_from_base(timings: dict[str, Timings], name: str) -> int:
    """Requests whose output in mode `name` differs from the base model's: the adapters'
    effect (0 would mean the adapters changed nothing and the benchmark measured nothing)."""
    return sum(a != b for a, b in zip(timings["base"].outputs, timings[name].outputs, strict=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--counts", default="1,4,8,32")
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    print(
        f"# lora bench: {MODEL}, fp32, 1 thread, batch {args.batch}, {args.max_tokens} tokens "
        f"each, rank {RANK} on {len(ALL7)} projections, {args.repeats} rounds",
        flush=True,
    )
    timings, expected = measure(args.batch, args.max_tokens, counts, args.repeats, not args.no_hf)
    tokens = args.batch * args.max_tokens
    print("batch seconds\n" + summary(timings, "seconds"))
    base = timings["base"].median("seconds")
    for name, t in timings.items():
        seconds = t.median("seconds")
        print(
            f"{name:12s} {tokens / seconds:7.1f} tok/s  vs base {base / seconds:.3f}  "
            f"outputs unlike base {differ_from_base(timings, name)}/{args.batch}"
        )
    bad = mismatches(timings, expected)
    for name, where in bad.items():
        print(f"MISMATCH {name} against HF + PEFT alone: {where}")

    def ratio(a: str, b: str) -> str:
        if a not in timings or b not in timings:
            return "nan"
        return f"{timings[a].median('seconds') / timings[b].median('seconds'):.3f}"

    hf = f"hf+peft{HF_ADAPTERS}"
    result = f"lora_throughput_ratio_8={ratio('base', 'lora8')} "
    result += f"lora_throughput_ratio_32={ratio('base', 'lora32')}"
    result += f" tandem_x_hf_8={ratio(hf, 'lora8')}" if hf in timings else ""
    print(f"RESULT {result}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

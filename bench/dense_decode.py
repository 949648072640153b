"""Offline decode tokens/s on dense float32 weights (`quantization=None`): the one-call C++
layers (kernels/cpu/dense_layer.cpp) against the per-op torch layers.

    python -m bench.dense_decode --trees head=/tmp/tandem-head,branch=. [options]
    python -m bench.dense_decode --inproc [options]
    options: [--models smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct] [--batches 1,8]
             [--threads 1,2] [--rounds 3] [--tokens 24] [--prompt-len 128]

A run of a batch size: `batch` requests of `prompt-len` random token ids (seeded, the same in
every run), greedy, EOS ignored, prefix caching off, all prefilled in one step; decode
tokens/s = batch x decode steps / the seconds of the decode steps (the prefill excluded).
--trees: two checkouts (e.g. `git archive HEAD` into /tmp), each (model, threads) running every
tree once per round in a subprocess whose working directory is that tree (so `engine` is that
checkout's), the order reversed every other round; a subprocess loads the model once and
measures each batch size after a warm-up pass.
--inproc: one process loads the model twice, one engine on the C++ layers and one whose model
is refused them (`model.fuse(dense=False)`: HEAD's per-op layers, the same code path), and
alternates them run by run (reversed every other round), which keeps a busy machine's drift
out of the ratio better than a subprocess per run.
Medians over the rounds with their spread, the 1-minute load average before each run, and
whether every run produced the same token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def decode_run(eng, prompts, batch: int, n: int) -> tuple[float, float, list[list[int]]]:
    """Decode tokens/s of `batch` requests of `n` tokens, their prefill's prompt tokens/s, and
    their token ids."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    ids = [f"{time.monotonic_ns()}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, prompts[:batch], strict=False):
        eng.add_request(rid, prompt, params)
    start = time.perf_counter()
    eng.step()  # the prefill (and first token)
    prefill = batch * len(prompts[0]) / (time.perf_counter() - start)
    steps, start, final = 0, time.perf_counter(), {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            final[o.request_id] = o.outputs[0].token_ids
        steps += 1
    seconds = time.perf_counter() - start
    return batch * steps / seconds, prefill, [list(final[r]) for r in ids]


def prompts_of(prompt_len: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, 5000, (prompt_len,), generator=g).tolist() for _ in range(8)]


def child(model: str, threads: int, batches: list[int], tokens: int, prompt_len: int) -> dict:
    import engine
    from engine import LLM

    eng = LLM(model, quantization=None, num_threads=threads, enable_prefix_caching=False).engine
    prompts = prompts_of(prompt_len)
    out = {"engine": str(Path(engine.__file__).parent.parent), "tok_s": {}, "prefill": {}}
    out["ids"] = {}
    for b in batches:
        decode_run(eng, prompts, b, 4)  # warm-up
        out["tok_s"][b], out["prefill"][b], out["ids"][b] = decode_run(eng, prompts, b, tokens)
    return out


def inproc(model: str, threads: int, batches: list[int], args) -> None:
    """Both layer kinds in this process, alternated run by run."""
    import gc

    from engine import LLM

    engines = {}
    for name in ("per-op", "fused"):
        llm = LLM(model, quantization=None, num_threads=threads, enable_prefix_caching=False)
        if name == "per-op":
            llm.engine.runner.model.fuse(dense=False)
        assert llm.engine.runner.model.fused_layers == (name == "fused")
        engines[name] = llm.engine
    prompts = prompts_of(args.prompt_len)
    runs = {name: [] for name in engines}
    loads = []
    for eng in engines.values():
        for b in batches:
            decode_run(eng, prompts, b, 4)  # warm-up
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        for name in order:
            result = {"engine": name, "tok_s": {}, "prefill": {}, "ids": {}}
            for b in batches:
                loads.append(os.getloadavg()[0])
                tok_s, prefill, ids = decode_run(engines[name], prompts, b, args.tokens)
                result["tok_s"][str(b)], result["ids"][str(b)] = tok_s, ids
                result["prefill"][str(b)] = prefill
            runs[name].append(result)
    report(model, threads, batches, runs, loads)
    engines.clear()
    gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", help="name=path,... (each a Tandem checkout)")
    ap.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--inproc", action="store_true")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        result = child(args.models, int(args.threads), batches, args.tokens, args.prompt_len)
        print("RESULT " + json.dumps(result))
        return
    if args.inproc:
        import torch

        for model in args.models.split(","):
            for threads in [int(t) for t in args.threads.split(",")]:
                torch.set_num_threads(threads)
                inproc(model, threads, batches, args)
        return
    trees = dict(t.split("=", 1) for t in args.trees.split(","))
    for model in args.models.split(","):
        for threads in [int(t) for t in args.threads.split(",")]:
            runs: dict[str, list[dict]] = {name: [] for name in trees}
            loads = []
            for r in range(args.rounds):
                order = list(trees) if r % 2 == 0 else list(trees)[::-1]
                for name in order:
                    loads.append(os.getloadavg()[0])
                    cmd = [sys.executable, "-m", "bench.dense_decode", "--child", "--trees", "-",
                           "--models", model, "--threads", str(threads), "--batches",
                           args.batches, "--tokens", str(args.tokens), "--prompt-len",
                           str(args.prompt_len)]  # fmt: skip
                    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
                    done = subprocess.run(
                        cmd, cwd=trees[name], env=env, capture_output=True, text=True
                    )
                    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
                    if done.returncode != 0 or not line:
                        sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
                    runs[name].append(json.loads(line[0][7:]))
            report(model, threads, batches, runs, loads)


def report(model, threads, batches, runs, loads) -> None:
    names = list(runs)
    print(f"# {model}, {threads} thread(s), load {min(loads):.2f}-{max(loads):.2f}")
    for name in names:
        print(f"#   {name}: {runs[name][0]['engine']}")
    for b in batches:
        for metric in ("tok_s", "prefill"):
            cells, medians = [], {}
            for name in names:
                values = [run[metric][str(b)] for run in runs[name]]
                medians[name] = statistics.median(values)
                spread = max(values) - min(values)
                cells.append(f"{name} {medians[name]:.2f} (spread {spread:.2f})")
            ids = {json.dumps(run["ids"][str(b)]) for name in names for run in runs[name]}
            ratio = medians[names[-1]] / medians[names[0]]
            what = "decode tok/s" if metric == "tok_s" else "prefill tok/s"
            print(
                f"batch {b} {what}: " + " | ".join(cells) + f" | {names[-1]}/{names[0]} "
                f"{ratio:.2f}x | same ids: {len(ids) == 1}"
            )
    sys.stdout.flush()


if __name__ == "__main__":
    main()

"""Offline decode tokens/s on dense float32 weights (`quantization=None`), two checkouts A/B.

    python -m bench.dense_decode --trees head=/tmp/tandem-head,branch=. \
        [--models smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct] [--batches 1,8]
        [--threads 1,2] [--rounds 3] [--tokens 24] [--prompt-len 128]

Each (model, threads) runs every tree once per round, in a subprocess whose working directory
is that tree (so `engine` is that checkout's), the order reversed every other round; a run
loads the model once and measures each batch size after a warm-up pass: `batch` requests of
`prompt-len` random token ids (seeded, the same in every run), greedy, EOS ignored, prefix
caching off, all prefilled in one step; decode tokens/s = batch x decode steps / the seconds
of the decode steps (the prefill step excluded). Medians over the rounds with their spread,
the 1-minute load average before each run, and whether every run produced the same token ids.
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


def child(model: str, threads: int, batches: list[int], tokens: int, prompt_len: int) -> dict:
    import torch

    import engine
    from engine import LLM, SamplingParams

    llm = LLM(model, quantization=None, num_threads=threads, enable_prefix_caching=False)
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 5000, (prompt_len,), generator=g).tolist() for _ in range(8)]
    out = {"engine": str(Path(engine.__file__).parent.parent), "tok_s": {}, "ids": {}}

    def run(batch: int, n: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        ids = [f"{time.monotonic_ns()}-{i}" for i in range(batch)]
        for rid, prompt in zip(ids, prompts[:batch], strict=False):
            eng.add_request(rid, prompt, params)
        eng.step()  # the prefill (and first token)
        steps, start, final = 0, time.perf_counter(), {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                final[o.request_id] = o.outputs[0].token_ids
            steps += 1
        seconds = time.perf_counter() - start
        return batch * steps / seconds, [list(final[r]) for r in ids]

    for batch in batches:
        run(batch, 4)  # warm-up
        out["tok_s"][batch], out["ids"][batch] = run(batch, tokens)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", required=True, help="name=path,... (each a Tandem checkout)")
    ap.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        result = child(args.models, int(args.threads), batches, args.tokens, args.prompt_len)
        print("RESULT " + json.dumps(result))
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
        cells, medians = [], {}
        for name in names:
            values = [run["tok_s"][str(b)] for run in runs[name]]
            medians[name] = statistics.median(values)
            cells.append(f"{name} {medians[name]:.2f} (spread {max(values) - min(values):.2f})")
        ids = {json.dumps(run["ids"][str(b)]) for name in names for run in runs[name]}
        ratio = medians[names[-1]] / medians[names[0]]
        print(
            f"batch {b}: " + " | ".join(cells) + f" | {names[-1]}/{names[0]} {ratio:.2f}x"
            f" | same ids: {len(ids) == 1}"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()

"""Hostile schemas: a trivial constraint's compile + TTFT while slow constraints are in flight.

    python -m bench.hostile_schemas [--repeats 7] [--hostile 4] [--unbounded]

SmolLM2-135M-Instruct with the engine's defaults (grammar_compile_timeout 10 s, 8 compile
workers, schema limits), driven through AsyncEngine as the server drives it. Each trivial
request is a fresh choice constraint ["yes", "no", "n<i>"] (a cache miss: it compiles) on a
short prompt with max_tokens=1; its time runs from submission to its first output (compile +
TTFT). idle: nothing else runs; loaded: --hostile schemas stay in flight all along, each 880
string properties with a pattern (53 KB, under every limit but the time: seconds to compile),
killed at the timeout and replaced by a new one. Trivial requests alternate idle and loaded
rounds; figures are medians. Also timed: refusing the issue's deep schema (arrays nested 600
deep) and how long one hostile compile runs unbounded in-process (--unbounded, slow).
Last line:
    RESULT idle_ms=.. loaded_ms=.. loaded_over_idle=.. refuse_deep_ms=.. hostile_timeouts=..
"""

from __future__ import annotations

import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import asyncio
import statistics
import time

MODEL = "smollm2-135m-instruct"
PROMPT = "Is the sky blue? Answer yes or no."


def hostile_schema(i: int) -> dict:
    props = {f"p{j}": {"type": "string", "pattern": f"[a-z]{{3}}[0-9]+x{j}"} for j in range(880)}
    return {"type": "object", "properties": props, "title": f"hostile {i}"}


def nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


async def trivial(aengine, i: int) -> tuple[float, float]:
    """(seconds from submission to the first output, of which compiling) of a fresh choice
    request; the compile is awaited first as add_request does, which then finds it cached."""
    from engine import SamplingParams

    p = SamplingParams(
        temperature=0, max_tokens=1, structured_outputs={"choice": ["yes", "no", f"n{i}"]}
    )
    t0 = time.perf_counter()
    await aengine.engine.compile_constraint_async(p.structured_outputs)
    t1 = time.perf_counter()
    stream = await aengine.add_request(f"trivial-{i}", PROMPT, p)
    async for _ in stream:
        break
    return time.perf_counter() - t0, t1 - t0


async def keep_hostile(aengine, slot: int, stop: asyncio.Event, counts: dict) -> None:
    """One hostile request after another, so one is always compiling."""
    from engine import SamplingParams

    k = 0
    while not stop.is_set():
        p = SamplingParams(
            max_tokens=1, structured_outputs={"json": hostile_schema(slot * 1000 + k)}
        )
        k += 1
        try:
            stream = await aengine.add_request(f"hostile-{slot}-{k}", PROMPT, p)
            stream.close()
            counts["compiled"] += 1
        except ValueError as e:
            counts["timeouts" if "grammar_compile_timeout" in str(e) else "other"] += 1


async def measure(args) -> dict:
    from engine import LLM
    from engine.entrypoints.async_engine import AsyncEngine

    aengine = AsyncEngine(LLM(MODEL).engine)
    try:
        for i in range(2):  # warm-up: the compile workers' forkserver, the model's first steps
            await trivial(aengine, -1 - i)
        idle, loaded, counts = [], [], {"compiled": 0, "timeouts": 0, "other": 0}
        stop = asyncio.Event()
        for r in range(args.repeats):
            await asyncio.sleep(1.0)  # idle: the last round's workers replaced, nothing running
            idle.append(await trivial(aengine, 2 * r))
            tasks = [
                asyncio.ensure_future(keep_hostile(aengine, r * 100 + s, stop, counts))
                for s in range(args.hostile)
            ]
            await asyncio.sleep(1.0)  # all in flight, past their workers' demotion
            loaded.append(await trivial(aengine, 2 * r + 1))
            stop.set()
            await asyncio.gather(*tasks)  # the last hostile ones end at their timeout
            stop.clear()
        t0 = time.perf_counter()
        try:
            await aengine.engine.compile_constraint_async(_so(nested_arrays(600)))
        except ValueError as e:
            refused = str(e)
        refuse_s = time.perf_counter() - t0
    finally:
        aengine.shutdown()
    return {"idle": idle, "loaded": loaded, "counts": counts, "refuse_s": refuse_s, "why": refused}


def _so(schema: dict):
    from engine.grammar import StructuredOutputs

    return StructuredOutputs(json=schema)


def unbounded_seconds() -> float:
    """One hostile schema compiled in-process with no limit (what a thread used to run)."""
    import json

    import xgrammar as xgr
    from transformers import AutoTokenizer

    from engine.grammar.compiler import tokenizer_info
    from engine.models.registry import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(MODEL))
    compiler = xgr.GrammarCompiler(tokenizer_info(tok, 49152, {2}), max_threads=1)
    t0 = time.perf_counter()
    compiler.compile_json_schema(json.dumps(hostile_schema(0)))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--hostile", type=int, default=4)
    ap.add_argument("--unbounded", action="store_true")
    args = ap.parse_args()
    out = asyncio.run(measure(args))
    idle_ms = statistics.median(t for t, _ in out["idle"]) * 1e3
    loaded_ms = statistics.median(t for t, _ in out["loaded"]) * 1e3
    for mode in ("idle", "loaded"):
        runs = " ".join(f"{t * 1e3:.0f} ({c * 1e3:.0f})" for t, c in out[mode])
        print(f"{mode:6} ms, compile + TTFT (compile): {runs}")
    print("hostile outcomes:", out["counts"])
    print("deep schema refused:", out["why"])
    if args.unbounded:
        print(f"one hostile schema unbounded in-process: {unbounded_seconds():.1f} s")
    print(
        f"RESULT idle_ms={idle_ms:.0f} loaded_ms={loaded_ms:.0f} "
        f"loaded_over_idle={loaded_ms / idle_ms:.2f} refuse_deep_ms={out['refuse_s'] * 1e3:.1f} "
        f"hostile_timeouts={out['counts']['timeouts']}"
    )


if __name__ == "__main__":
    main()

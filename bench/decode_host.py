"""Python per token at batch 1 on the default path: what a greedy decode spends outside C++.

    python -m bench.decode_host [--models NAME ...] [--threads 1 2] [--repeats 5]

For each embedded model (default: SmolLM2) and thread count, one chat prompt, 128 greedy
tokens (EOS ignored), three ways the engine runs it:
- generate: `LLM.generate` (FINAL_ONLY outputs), so lookahead: num_scheduler_steps (4) tokens
  a scheduling round, embedding to argmax in one C++ call (LayerStack.decode);
- one step: the same with num_scheduler_steps=1: a round, and that one call, per token;
- stream: `LLM.stream` (DELTA outputs, what the server asks for): a round per token.
C++ time is every call into the layer stack (`decode`, and `forward` for the prompt) and the
prompt's LM head; the rest of the wall time, scheduling, inputs, outputs, detokenizing and stop
checks included, is Python's. Per token: over the 128 tokens (the prompt's one step of Python is
in it, ~1% of the whole). Modes alternate, a warm-up each, median (min-max) of --repeats.
The three must give the same tokens (exit status 1 otherwise). Last line:
    RESULT python_ms_generate_t1=.. python_ms_one_step_t1=.. python_ms_stream_t1=..
    ms_per_token_generate_t1=.. ms_per_token_stream_t1=..   (the first model; t2 likewise)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

NEW_TOKENS = 128
PROMPT = "Write a short story about a lighthouse keeper and a storm."


class CppClock:
    """Seconds spent in the layer stack's C++ calls and the LM head's (model: a CausalLM)."""

    def __init__(self, model):
        self.seconds = 0.0
        stack, clock = model.stack, self
        inner = stack.op

        class Timed:  # the custom class's methods, timed (its attributes are read-only)
            def __getattr__(self, name):
                method = getattr(inner, name)

                def timed(*args):
                    t0 = time.perf_counter()
                    try:
                        return method(*args)
                    finally:
                        clock.seconds += time.perf_counter() - t0

                return timed

        stack.op = Timed()
        head = model.lm_head.format
        forward = head.forward

        def head_forward(x):
            t0 = time.perf_counter()
            try:
                return forward(x)
            finally:
                clock.seconds += time.perf_counter() - t0

        head.forward = head_forward


def one_run(llm, clock: CppClock, prompt: list[int], mode: str) -> tuple[float, float, list[int]]:
    """(wall seconds, C++ seconds, token ids) of one request run `mode`'s way."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    clock.seconds = 0.0
    t0 = time.perf_counter()
    if mode == "stream":
        ids = [t for out in llm.stream(prompt, params) for t in out.outputs[0].token_ids]
    else:
        ids = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    wall = time.perf_counter() - t0
    assert len(ids) == NEW_TOKENS, len(ids)
    return wall, clock.seconds, list(ids)


def measure(name: str, threads: int, repeats: int) -> dict[str, tuple[list[float], list[float]]]:
    """Per mode: (Python ms per token, wall ms per token) of each repeat."""
    from engine import LLM

    torch.set_num_threads(threads)
    engines = {
        "generate": LLM(name, num_threads=threads, enable_prefix_caching=False),
        "one step": LLM(
            name, num_threads=threads, enable_prefix_caching=False, num_scheduler_steps=1
        ),
    }
    engines["stream"] = engines["generate"]
    for llm in engines.values():
        if llm.engine.runner.model.stack is None or not llm.engine.runner.model.stack.decodes:
            sys.exit(f"{name}: the default path has no C++ decode here (no kernels?)")
    clocks = {id(llm): CppClock(llm.engine.runner.model) for llm in set(engines.values())}
    llm = engines["generate"]
    if getattr(llm.tokenizer, "chat_template", None):
        prompt = llm.apply_chat_template([{"role": "user", "content": PROMPT}])
    else:  # (a base model: Gemma 3 270M)
        prompt = llm.tokenizer.encode(PROMPT)
    got: dict[str, tuple[list[float], list[float]]] = {m: ([], []) for m in engines}
    tokens: dict[str, list[int]] = {}  # the first run's, which every run must repeat
    for rep in range(repeats + 1):  # the first: warm-up
        order = list(engines) if rep % 2 == 0 else list(reversed(engines))
        for mode in order:
            engine = engines[mode]
            wall, cpp, ids = one_run(engine, clocks[id(engine)], prompt, mode)
            if ids != tokens.setdefault("first", ids):
                sys.exit(f"{name}: {mode} gave other tokens than the first run")
            if rep:
                got[mode][0].append(1e3 * (wall - cpp) / NEW_TOKENS)
                got[mode][1].append(1e3 * wall / NEW_TOKENS)
    return got


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    first: dict[str, float] = {}
    for name in args.models:
        for threads in args.threads:
            got = measure(name, threads, args.repeats)
            for mode, (python, wall) in got.items():
                print(
                    f"{name} t{threads} {mode:>8}: Python {spread(python)} ms/token, "
                    f"wall {spread(wall)} ms/token",
                    flush=True,
                )
                if name == args.models[0]:
                    key = mode.replace(" ", "_")
                    first[f"python_ms_{key}_t{threads}"] = statistics.median(python)
                    if mode != "one step":
                        first[f"ms_per_token_{key}_t{threads}"] = statistics.median(wall)
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in first.items()))


if __name__ == "__main__":
    main()

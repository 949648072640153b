"""Tool calls: what grammar-forced drafts save when the call's fixed text is forced.

    python -m bench.tools [--repeats 5] [--threads 1] [--max-tokens 96]

SmolLM2-135M-Instruct (exact weights), greedy, `LLM.chat` with two function tools and six user
questions, one request at a time, in two modes alternated --repeats times:

- masks: the tool-call constraint's masks only (grammar-forced tokens off, no proposer);
- forced: the same, with grammar-forced tokens as free drafts (a call's opening
  `<tool_call>\\n{"name": "...", "arguments": {"`, keys and punctuation are forced).

Each question runs under tool_choice `required` and a named function (the question's own tool).
Outputs of the two modes must be equal token for token (exit 1 otherwise). Reported: median and
spread of the total seconds per mode; tool_forced_speedup = masks / forced (medians);
tool_forced_share = forced tokens accepted / output tokens. Last line:
    RESULT tool_forced_speedup=.. tool_forced_share=.. outputs_equal=..
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from engine import LLM, SamplingParams

MODEL = "smollm2-135m-instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
            },
            "required": ["city", "unit", "days"],
        },
    },
}
BOOK = {
    "type": "function",
    "function": {
        "name": "book_restaurant_table",
        "description": "Book a table at a restaurant",
        "parameters": {
            "type": "object",
            "properties": {
                "restaurant_name": {"type": "string"},
                "number_of_guests": {"type": "integer"},
                "reservation_time": {"type": "string"},
            },
            "required": ["restaurant_name", "number_of_guests", "reservation_time"],
        },
    },
}
TOOLS = [WEATHER, BOOK]
QUESTIONS = [
    ("What will the weather be in Paris for the next 3 days?", "get_weather"),
    ("Is it going to rain in Tokyo tomorrow? Answer in fahrenheit.", "get_weather"),
    ("Weather forecast for Lyon this week, please.", "get_weather"),
    ("Book a table for 4 at Chez Marcel at 8pm.", "book_restaurant_table"),
    ("Reserve dinner for two at Luigi's tomorrow at 19:30.", "book_restaurant_table"),
    ("Can you get us a table for 6 at The Ivy at noon?", "book_restaurant_table"),
]


def jobs() -> list[tuple[list[dict], object]]:
    out = []
    for question, name in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        out.append((messages, "required"))
        out.append((messages, {"type": "function", "function": {"name": name}}))
    return out


def run(llm: LLM, max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    tokens, start = [], time.perf_counter()
    for messages, choice in jobs():
        (out,) = llm.chat(messages, params, use_tqdm=False, tools=TOOLS, tool_choice=choice)
        tokens.append(out.outputs[0].token_ids)
    return time.perf_counter() - start, tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    common = dict(quantization=None, num_kv_blocks=256, num_threads=args.threads)
    llms = {
        "masks": LLM(MODEL, grammar_forced_tokens=False, **common),
        "forced": LLM(MODEL, grammar_forced_tokens=True, **common),
    }
    for llm in llms.values():  # warm-up: compile the constraints, touch every code path
        run(llm, args.max_tokens)
    seconds: dict[str, list[float]] = {mode: [] for mode in llms}
    outputs: dict[str, list[list[int]]] = {}
    stats = llms["forced"].engine.speculation.stats
    forced_before = stats.num_forced_accepted
    for _ in range(args.repeats):
        for mode, llm in llms.items():
            took, outputs[mode] = run(llm, args.max_tokens)
            seconds[mode].append(took)
    num_tokens = sum(map(len, outputs["forced"])) * args.repeats
    share = (stats.num_forced_accepted - forced_before) / num_tokens
    equal = sum(a == b for a, b in zip(outputs["masks"], outputs["forced"], strict=True))
    print(f"{len(jobs())} tool-call requests, {args.threads} thread(s), {args.repeats} repeats")
    for mode, values in seconds.items():
        spread = max(values) - min(values)
        print(f"{mode:>7}: median {statistics.median(values):.3f} s, spread {spread:.3f} s")
    speedup = statistics.median(seconds["masks"]) / statistics.median(seconds["forced"])
    print(
        f"RESULT tool_forced_speedup={speedup:.2f} tool_forced_share={share:.2f} "
        f"outputs_equal={equal}/{len(jobs())}"
    )
    return 0 if equal == len(jobs()) else 1


if __name__ == "__main__":
    sys.exit(main())

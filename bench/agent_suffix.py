"""Suffix decoding on an agent loop: each turn resends the growing conversation, whose tool
results re-read the same source file (with the previous turns' edits applied) and whose answers
rewrite its functions.

    python -m bench.agent_suffix [--turns 4] [--max-tokens 160] [--repeats 3] [--file textwrap]

SmolLM2-135M-Instruct on the default path (its GGUF, quantization="auto"), one thread, greedy,
batch 1 (one request at a time, as an agent waits for each answer), prefix caching on (as a
server runs it: each turn's prompt extends the last). The text is real: the Python standard
library's own source (`--file`: a module name; its window of functions is read by a "read_file"
tool). Each turn asks for one edit of one function, shows the tool's result (the file's window
as it is after the edits so far: the agent's edit tool applied the canonical change) and
generates the answer; the answer joins the conversation for the next turn.

Modes, each its own engine: none (no speculation), ngram (prompt lookup, the engine's default k
and adaptive planner), suffix (spec.suffix: the request's own text and its tenant's finished
requests, the default cap of 15 drafts, adaptive); `--modes` adds ngram-k15 (n-gram with
suffix's cap, to show what the longer cap alone buys). Every run is a new tenant (its own
cache_salt): nothing of an earlier run, neither KV blocks nor suffix text, helps a later one.

Timed: the decode phase of every turn (first token to last: what speculation changes; prefill
is the same in every mode), summed over the conversation; tokens/s = (output tokens - 1 per
turn) / those seconds. Fair by construction (bench/harness.py: a warm-up each, then rounds that
alternate the modes; medians with spread). Every mode must produce the same tokens as none,
else the script exits 1 (RESULT printed anyway). Last line:
    RESULT suffix_vs_ngram=.. suffix_vs_none=.. ngram_vs_none=.. suffix_accept_len=..
           ngram_accept_len=.. exact=0|1
"""

from __future__ import annotations

import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import importlib
import inspect
import itertools
from collections.abc import Callable

from bench.harness import Run, alternate, summary, unequal

SMOLLM = "smollm2-135m-instruct"
MODES = {
    "none": {},
    "ngram": {"speculative_method": "ngram"},
    "suffix": {"speculative_method": "suffix"},
    "ngram-k15": {"speculative_method": "ngram", "num_speculative_tokens": 15},
}
SYSTEM = (
    "You are a coding agent. You can call read_file(path) to read a file. When asked to change "
    "a function, answer with the complete updated function in a Python code block, and nothing "
    "else."
)
# (function, the request, the canonical edit applied to the file afterwards: old -> new)
EDITS = {
    "textwrap": [
        ("indent", "Rename the parameter `predicate` to `keep` in `indent`.", "predicate", "keep"),
        ("dedent", "In `dedent`, rename the variable `margin` to `common`.", "margin", "common"),
        ("shorten", "In `shorten`, rename the variable `w` to `wrapper`.", "w = ", "wrapper = "),
        ("indent", "In `indent`, rename `prefixed_lines` to `lines`.", "prefixed_lines", "lines"),
        ("dedent", "In `dedent`, remove the sanity check.", "    # sanity check", "    # check"),
    ],
}


def file_window(module: str) -> str:
    """The module's functions that the edits touch, as the file has them (real text)."""
    mod = importlib.import_module(module)
    names = dict.fromkeys(name for name, *_ in EDITS[module])
    return "\n\n".join(inspect.getsource(getattr(mod, name)) for name in names)


def conversation_mode(
    llm, module: str, turns: int, max_tokens: int, salts: Callable[[], str]
) -> Callable[[], Run]:
    """One run: the whole agent conversation, turn after turn, as a new tenant."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)

    def run() -> Run:
        salt, window = salts(), file_window(module)
        chat = [{"role": "system", "content": SYSTEM}]
        before = counters(llm)
        outputs, decode_seconds, decode_tokens = [], 0.0, 0
        for _, ask, old, new in itertools.islice(itertools.cycle(EDITS[module]), turns):
            chat += [
                {"role": "user", "content": f"{ask} The file is {module}.py."},
                {"role": "assistant", "content": f"read_file('{module}.py')"},
                {"role": "user", "content": f"read_file result:\n```python\n{window}\n```"},
            ]
            out = generate(llm, llm.apply_chat_template(chat), params, salt)
            completion = out.outputs[0]
            outputs.append(completion.token_ids)
            decode_seconds += out.metrics.finished_time - out.metrics.first_token_time
            decode_tokens += len(completion.token_ids) - 1
            chat.append({"role": "assistant", "content": completion.text})
            window = window.replace(old, new)  # the agent's edit tool applied the change
        steps, drafts, accepted = (b - a for a, b in zip(before, counters(llm), strict=True))
        metrics = {"decode_seconds": decode_seconds, "tokens_per_second": 0.0}
        metrics["tokens_per_second"] = decode_tokens / decode_seconds
        info = {"steps": steps, "drafts": drafts, "accepted": accepted, "tokens": decode_tokens}
        return Run(metrics, outputs, info)

    return run


def generate(llm, prompt_ids: list[int], params, salt: str):
    """One request to the end, under the given cache salt (its tenant)."""
    engine = llm.engine
    request_id = f"agent-{next(_ids)}"
    engine.add_request(request_id, prompt_ids, params, cache_salt=salt)
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out


_ids = itertools.count()


def counters(llm) -> tuple[int, int, int]:
    s = llm.engine.speculation.stats
    return s.num_steps, s.num_drafts, s.num_accepted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--file", default="textwrap", choices=sorted(EDITS))
    parser.add_argument("--modes", default="none,ngram,suffix", help=f"of {sorted(MODES)}")
    args = parser.parse_args()
    from engine import LLM

    names = args.modes.split(",")
    counter = itertools.count()
    modes = {}
    for name in names:
        llm = LLM(SMOLLM, num_threads=1, **MODES[name])
        salts = lambda name=name: f"{name}-run-{next(counter)}"  # noqa: E731 (a new tenant)
        modes[name] = conversation_mode(llm, args.file, args.turns, args.max_tokens, salts)
    print(
        f"{args.file}.py window: {len(file_window(args.file).splitlines())} lines, "
        f"{args.turns} turns, max_tokens {args.max_tokens}, load {os.getloadavg()[0]:.2f}"
    )
    timings = alternate(modes, args.repeats, threads=1)
    print(summary(timings, "tokens_per_second", label="decode tokens/s"))
    for name, t in timings.items():
        info = t.info
        accept = 1 + info["accepted"] / info["steps"] if info["steps"] else 1.0
        print(
            f"{name:12s} tokens {info['tokens']}, verification steps {info['steps']}, drafts "
            f"{info['drafts']}, accepted {info['accepted']}, mean accepted length {accept:.2f}"
        )
    bad = unequal(timings, "none", [n for n in names if n != "none"])
    for name, where in bad.items():
        print(f"MISMATCH {name}: {where}")

    def speed(name: str) -> float:
        return timings[name].median("tokens_per_second")

    def accept_len(name: str) -> str:
        info = timings[name].info
        return f"{1 + info['accepted'] / info['steps']:.2f}" if info["steps"] else "na"

    ratio = {
        pair: f"{speed(pair[0]) / speed(pair[1]):.2f}" if set(pair) <= set(names) else "na"
        for pair in (("suffix", "ngram"), ("suffix", "none"), ("ngram", "none"))
    }
    print(
        f"RESULT suffix_vs_ngram={ratio['suffix', 'ngram']}"
        f" suffix_vs_none={ratio['suffix', 'none']} ngram_vs_none={ratio['ngram', 'none']}"
        f" suffix_accept_len={accept_len('suffix') if 'suffix' in names else 'na'}"
        f" ngram_accept_len={accept_len('ngram') if 'ngram' in names else 'na'}"
        f" exact={int(not bad)}"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""What a reader follows to understand one decode step: the functions of ours that
`LLMEngine.step()` calls (transitively) during a steady greedy decode step, their lines, their
files and the deepest call chain under step().

    python -m bench.step_reading            # plain greedy decode, then with a draft model

The figure issue 26 started from (at 4263d99): ~40 functions, ~800 lines, 7 files, 6 calls deep
for a plain greedy decode; ~57 functions in 10 files with a draft model. Counted: functions in
engine/, spec/, lora/, kernels/ (comprehensions and lambdas belong to the function that holds
them); lines = each function's span, first line to last. The tiny random Llama of the tests,
torch backend, one thread, prefix caching off.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = tuple(str(ROOT / p) + "/" for p in ("engine", "spec", "lora", "kernels"))
INNER = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<lambda>")


def trace_step(engine) -> dict:
    """Run one engine.step() under a profiler hook; what of ours it called."""
    seen: dict[tuple[str, str], int] = {}  # (file, qualname) -> lines
    depth = {"max": 0}
    stack: list[bool] = []  # per frame on the hook's stack: is it ours

    def hook(frame, event, _arg):
        if event == "call":
            code = frame.f_code
            ours = code.co_filename.startswith(OURS) and code.co_name not in INNER
            stack.append(ours)
            if ours:
                last = max((line for *_, line in code.co_lines() if line), default=0)
                key = (code.co_filename, code.co_qualname)
                seen[key] = max(seen.get(key, 0), last - code.co_firstlineno + 1)
                depth["max"] = max(depth["max"], sum(stack))
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(hook)
    try:
        engine.step()
    finally:
        sys.setprofile(None)
    files = {f for f, _ in seen}
    return {
        "functions": len(seen),
        "lines": sum(seen.values()),
        "files": len(files),
        "depth": depth["max"] - 1,  # calls below step() itself
        "by_file": sorted(
            (Path(f).relative_to(ROOT).as_posix(), sum(n for (g, _), n in seen.items() if g == f))
            for f in files
        ),
    }


def decode_engine(model_dir: Path, draft: Path | None):
    from engine import EngineConfig, LLMEngine, SamplingParams

    config = EngineConfig(
        model=str(model_dir),
        num_kv_blocks=64,
        block_size=16,
        enable_prefix_caching=False,
        num_threads=1,
        attention_backend="torch",
        **(
            {"speculative_method": "draft", "draft_model": str(draft), "num_speculative_tokens": 3}
            if draft
            else {}
        ),
    )
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    engine.add_request("r", list(range(3, 40)), params)
    for _ in range(6):  # prefill and a few decode steps: the measured step is a steady one
        engine.step()
    return engine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args()
    sys.path.append(str(ROOT / "tests"))  # tests/models.py: the tiny checkpoints
    from models import make_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        target = make_tiny_model(Path(tmp) / "target")
        draft = make_tiny_model(Path(tmp) / "draft", seed=1)
        for name, d in (("greedy", None), ("draft_model", draft)):
            found = trace_step(decode_engine(target, d))
            rows.append((name, found))
            print(
                f"{name}: {found['functions']} functions, {found['lines']} lines, "
                f"{found['files']} files, {found['depth']} calls deep under step()"
            )
            for path, lines in found["by_file"]:
                print(f"    {path:40s} {lines:5d}")
    greedy, drafted = rows[0][1], rows[1][1]
    print(
        f"RESULT greedy_functions={greedy['functions']} greedy_lines={greedy['lines']} "
        f"greedy_files={greedy['files']} greedy_depth={greedy['depth']} "
        f"draft_functions={drafted['functions']} draft_files={drafted['files']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Compare two saved runs of the pytest-benchmark suite; fail on a regression.

    python -m bench.compare [BASE] [--new NEW] [--threshold 0.25] [--storage .benchmarks]
    make bench-compare [BASE=0001]

`make bench` saves every run (pytest-benchmark's --benchmark-autosave) under .benchmarks/. BASE
and NEW name saved runs by their number ("0003") or a path; NEW defaults to the newest run and
BASE to the one before it. Every benchmark present in both is compared by its median: a
benchmark regressed when NEW's median exceeds BASE's by more than --threshold (a fraction).
Exit 1 when any regressed, 2 when there is nothing to compare or the runs come from different
CPUs (their timings measure the machines, not the code; --any-machine compares anyway).

The default threshold (0.25) comes from measured noise: two back-to-back quick runs of the same
commit on the 2-core AMD EPYC VM (bench/RESULTS.md, "Run-to-run noise") differed by up to the
figure quoted there in a benchmark's median; the threshold sits above that so the same code does
not fail against itself, and a real regression of a quarter or more shows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

THRESHOLD = 0.25


def saved_runs(storage: Path) -> list[Path]:
    """Every saved run, oldest first (pytest-benchmark numbers them 0001_..., per machine kind)."""
    return sorted(storage.glob("*/[0-9][0-9][0-9][0-9]_*.json"), key=lambda p: p.name)


def pick(runs: list[Path], name: str | None, default: int) -> Path:
    if name is None:
        return runs[default]
    if Path(name).is_file():
        return Path(name)
    found = [p for p in runs if p.name.startswith(name)]
    if len(found) != 1:
        raise SystemExit(f"no single saved run matches {name!r} among {[p.name for p in runs]}")
    return found[0]


def cpu(run: dict) -> str:
    info = run.get("machine_info", {}).get("cpu", {})
    return f"{info.get('brand_raw', '?')} x{info.get('count', '?')}"


def medians(run: dict) -> dict[str, float]:
    return {b["fullname"]: b["stats"]["median"] for b in run["benchmarks"]}


def compare(base: dict, new: dict, threshold: float) -> tuple[list[str], list[str]]:
    """Table lines (one per common benchmark, slowest change first) and the regressed names."""
    old, now = medians(base), medians(new)
    common = [name for name in now if name in old]
    rows = sorted(common, key=lambda name: now[name] / old[name], reverse=True)
    lines, regressed = [], []
    for name in rows:
        ratio = now[name] / old[name]
        flag = "REGRESSION" if ratio > 1 + threshold else ""
        if flag:
            regressed.append(name)
        lines.append(f"{ratio:6.3f}x  {old[name]:10.4f} s -> {now[name]:10.4f} s  {name} {flag}")
    return lines, regressed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", nargs="?", default=None)
    parser.add_argument("--new", default=None)
    parser.add_argument("--threshold", type=float, default=THRESHOLD)
    parser.add_argument("--storage", type=Path, default=Path(".benchmarks"))
    parser.add_argument("--any-machine", action="store_true")
    args = parser.parse_args(argv)
    runs = saved_runs(args.storage)
    if len(runs) < 2 and not (args.base and args.new):
        print(f"need two saved runs in {args.storage} (make bench saves one per run)")
        return 2
    base_path, new_path = pick(runs, args.base, -2), pick(runs, args.new, -1)
    base, new = (json.loads(p.read_text()) for p in (base_path, new_path))
    print(f"base {base_path.name} ({cpu(base)})\nnew  {new_path.name} ({cpu(new)})")
    if cpu(base) != cpu(new) and not args.any_machine:
        print("different CPUs: their timings compare machines, not code (--any-machine)")
        return 2
    lines, regressed = compare(base, new, args.threshold)
    if not lines:
        print("no benchmark in both runs")
        return 2
    print("\n".join(["new/base  base median -> new median  benchmark", *lines]))
    print(
        f"RESULT compared={len(lines)} regressed={len(regressed)} "
        f"threshold={args.threshold:.2f} worst={float(lines[0].split('x')[0]):.3f}"
    )
    return 1 if regressed else 0


if __name__ == "__main__":
    sys.exit(main())

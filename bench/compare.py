"""Compare two saved runs of the pytest-benchmark suite; fail on a regression.

    python -m bench.compare [BASE] [--new NEW] [--threshold 0.30] [--storage .benchmarks]
    make bench-compare [BASE=0001]
    python -m bench.compare --table [--new NEW]   # one run's medians as markdown, per group

`make bench` saves every run (pytest-benchmark's --benchmark-autosave) under .benchmarks/. BASE
and NEW name saved runs by their number ("0003") or a path; NEW defaults to the newest run and
BASE to the one before it. Every benchmark present in both is compared by its median: a
benchmark regressed when NEW's median exceeds BASE's by more than --threshold (a fraction) and
every NEW round is slower than every BASE round.
Exit 1 when any regressed, 2 when there is nothing to compare, when one run is quick and the
other full (a quick benchmark does less work than the full one of the same name), or when the
runs come from different CPUs (their timings measure the machines, not the code; --any-machine
compares anyway).

The default threshold (0.30) comes from measured noise on the 2-core AMD EPYC VM (bench/RESULTS.md,
"Run-to-run noise"): three quick runs of the same engine code moved 65 of the 66 benchmarks'
medians by 0.86x-1.21x (the 2-thread decode rows the most: the VM's second core is shared); the
threshold sits above that, so the same code does not fail against itself, and a real regression
of 30% or more shows. The 66th, the 64-token prompt's TTFT on 2 threads, is bimodal between
runs (89 / 95 / 141 ms, steady within each run) and fails the third run against the first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

THRESHOLD = 0.30


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


def stats(run: dict) -> dict[str, dict]:
    return {b["fullname"]: b["stats"] for b in run["benchmarks"]}


def compare(base: dict, new: dict, threshold: float) -> tuple[list[str], list[str]]:
    """Table lines (one per common benchmark, slowest change first) and the regressed names: a
    median grown by more than `threshold` whose new rounds are all slower than every base round
    (rounds that overlap do not resolve the difference)."""
    old, now = stats(base), stats(new)
    common = [name for name in now if name in old]
    ratios = {name: now[name]["median"] / old[name]["median"] for name in common}
    lines, regressed = [], []
    for name in sorted(common, key=ratios.get, reverse=True):
        ratio = ratios[name]
        apart = now[name]["min"] > old[name]["max"]
        flag = "REGRESSION" if ratio > 1 + threshold and apart else ""
        if flag:
            regressed.append(name)
        a, b = old[name]["median"], now[name]["median"]
        lines.append(f"{ratio:6.3f}x  {a:10.4f} s -> {b:10.4f} s  {name} {flag}")
    return lines, regressed


def table(run: dict) -> str:
    """Markdown: per group, each benchmark's median and spread (max - min) over its rounds."""
    lines = ["| group | benchmark | median | spread | rounds |", "|---|---|---|---|---|"]
    for b in sorted(run["benchmarks"], key=lambda b: (b["group"] or "", b["name"])):
        st = b["stats"]
        scale, unit = (1e3, "ms") if st["median"] < 1 else (1.0, "s")
        lines.append(
            f"| {b['group']} | {b['param'] or b['name']} | {st['median'] * scale:.2f} {unit} "
            f"| {(st['max'] - st['min']) * scale:.2f} {unit} | {st['rounds']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", nargs="?", default=None)
    parser.add_argument("--new", default=None)
    parser.add_argument("--threshold", type=float, default=THRESHOLD)
    parser.add_argument("--storage", type=Path, default=Path(".benchmarks"))
    parser.add_argument("--any-machine", action="store_true")
    parser.add_argument("--table", action="store_true", help="print NEW's medians, compare none")
    args = parser.parse_args(argv)
    runs = saved_runs(args.storage)
    if args.table:
        print(table(json.loads(pick(runs, args.new, -1).read_text())))
        return 0
    if len(runs) < 2 - bool(args.base) - bool(args.new):  # BASE / NEW may name files
        print(f"need two saved runs in {args.storage} (make bench saves one per run)")
        return 2
    base_path, new_path = pick(runs, args.base, -2), pick(runs, args.new, -1)
    base, new = (json.loads(p.read_text()) for p in (base_path, new_path))
    print(f"base {base_path.name} ({cpu(base)})\nnew  {new_path.name} ({cpu(new)})")
    if cpu(base) != cpu(new) and not args.any_machine:
        print("different CPUs: their timings compare machines, not code (--any-machine)")
        return 2
    kinds = [run.get("suite", {}).get("quick") for run in (base, new)]  # None: saved before
    if None not in kinds and kinds[0] != kinds[1]:  # the suite recorded it
        print(f"one run is quick and the other is not (quick: {kinds[0]} / {kinds[1]})")
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

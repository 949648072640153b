"""The benchmark harness: alternation order, output checks, the hand-over of alternated rounds to
pytest-benchmark (its saved JSON), and bench.compare's regression rule."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from bench import compare
from bench.harness import Run, alternate, first_difference, unequal

ROOT = Path(__file__).resolve().parents[2]


def test_alternate_warms_every_mode_up_then_reverses_the_order_each_round():
    log = []

    def mode(name, seconds):
        def run():
            log.append(name)
            return Run({"seconds": seconds.pop(0)}, [[len(log)]])

        return run

    modes = {"a": mode("a", [9.0, 3.0, 1.0, 2.0]), "b": mode("b", [9.0, 5.0, 7.0, 6.0])}
    timings = alternate(modes, repeats=3)
    assert log == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert timings["a"].values("seconds") == [3.0, 1.0, 2.0]  # the warm-up is not kept
    assert (timings["a"].median("seconds"), timings["a"].spread("seconds")) == (2.0, 2.0)
    assert (timings["b"].median("seconds"), timings["b"].spread("seconds")) == (6.0, 2.0)
    assert len(timings["b"].loads) == 3


def test_unequal_names_the_mode_request_and_token_where_outputs_first_differ():
    assert first_difference([[1, 2, 3]], [[1, 2, 3]]) is None
    assert first_difference([[1, 2], [5, 6, 7]], [[1, 2], [5, 9, 7]]) == (
        "request 1 differs at token 1 (lengths 3 and 3)"
    )
    assert (
        first_difference([[1, 2]], [[1, 2, 3]]) == "request 0 differs at token 2 (lengths 2 and 3)"
    )
    runs = {}
    for name, out in {"ref": [[1, 2]], "same": [[1, 2]], "other": [[1, 3]]}.items():
        runs[name] = alternate({name: lambda out=out: Run({"s": 1.0}, out)}, 1)[name]
    assert unequal(runs, "ref", ["same", "other"]) == {
        "other": "request 0 differs at token 1 (lengths 2 and 2)"
    }


BENCH_FILE = """
from bench.harness import Run, alternate
from bench.suite.common import record

def test_recorded(benchmark):
    values = iter([9.0, 3.0, 1.0, 2.0])
    timings = alternate({"m": lambda: Run({"seconds": next(values)}, None, {"tokens": 7})}, 3)
    record(benchmark, "group-x", timings["m"], "seconds", equal=True)
"""


def test_record_hands_the_alternated_rounds_to_pytest_benchmark(tmp_path):
    """The rounds a group measured become the benchmark's rounds in pytest-benchmark's saved
    JSON (what --benchmark-autosave writes and bench.compare reads), with group and extra_info."""
    (tmp_path / "bench_x.py").write_text(textwrap.dedent(BENCH_FILE))
    out = tmp_path / "run.json"
    command = [sys.executable, "-m", "pytest", str(tmp_path / "bench_x.py"), "-q"]
    command += ["-p", "no:cacheprovider", "-o", "python_files=bench_*.py", "-o", "addopts="]
    command += ["--rootdir", str(tmp_path), f"--benchmark-json={out}", "-W", "error"]
    command += ["-p", "bench.suite.conftest"]  # the suite's options and JSON hook
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    (bench,) = json.loads(out.read_text())["benchmarks"]
    stats = bench["stats"]
    assert (stats["rounds"], stats["median"], stats["min"], stats["max"]) == (3, 2.0, 1.0, 3.0)
    assert bench["group"] == "group-x"
    assert json.loads(out.read_text())["suite"] == {"quick": False}  # conftest's hook
    assert bench["extra_info"]["metric"] == "seconds"
    assert bench["extra_info"]["tokens"] == 7 and bench["extra_info"]["equal"] is True
    assert isinstance(bench["extra_info"]["load_average"], float)


def _save(
    storage: Path,
    number: int,
    medians: dict[str, float],
    cpu: str = "EPYC",
    quick: bool = True,
    spread: float = 0.05,
) -> None:
    folder = storage / "Linux-CPython-3.11-64bit"
    folder.mkdir(parents=True, exist_ok=True)
    run = {
        "machine_info": {"cpu": {"brand_raw": cpu, "count": 2}},
        "suite": {"quick": quick},
        "benchmarks": [
            {
                "fullname": k,
                "stats": {"median": v, "min": (1 - spread) * v, "max": (1 + spread) * v},
            }
            for k, v in medians.items()
        ],
    }
    (folder / f"{number:04d}_abc_20261124.json").write_text(json.dumps(run))


def test_compare_fails_only_beyond_the_threshold_and_only_on_one_machine(tmp_path, capsys):
    _save(tmp_path, 1, {"a": 1.0, "b": 2.0, "gone": 1.0})
    _save(tmp_path, 2, {"a": 1.2, "b": 1.0, "new": 1.0})
    assert compare.main(["--storage", str(tmp_path), "--threshold", "0.25"]) == 0
    capsys.readouterr()
    _save(tmp_path, 3, {"a": 1.3, "b": 1.1})
    assert compare.main(["--storage", str(tmp_path), "0001", "--threshold", "0.25"]) == 1
    assert "REGRESSION" in capsys.readouterr().out.splitlines()[3]  # a, the worst row
    assert compare.main(["--storage", str(tmp_path), "0002", "--threshold", "0.25"]) == 0
    _save(tmp_path, 4, {"a": 1.35}, spread=0.5)  # 1.35x, but its rounds overlap 0001's
    assert compare.main(["--storage", str(tmp_path), "0001", "--threshold", "0.25"]) == 0
    _save(tmp_path, 5, {"a": 1.0}, quick=False)  # same names, more work: not comparable
    assert compare.main(["--storage", str(tmp_path)]) == 2
    _save(tmp_path, 6, {"a": 1.0}, cpu="Xeon")
    assert compare.main(["--storage", str(tmp_path), "0003"]) == 2  # quick on both, other CPUs
    assert compare.main(["--storage", str(tmp_path), "0003", "--any-machine"]) == 0
    assert compare.main(["--storage", str(tmp_path / "empty")]) == 2

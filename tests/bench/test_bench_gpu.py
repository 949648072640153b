"""bench/gpu.py's own code, run at toy sizes on CPU (`--smoke`: Triton's interpreter, fp32),
so that a GPU session does not spend its device time finding a bug in the benchmark."""

from __future__ import annotations

from bench import gpu


def test_gpu_benchmark_smoke(capsys):
    assert gpu.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    assert last.startswith("RESULT decode_attention_bw_ratio=")
    assert "n/a" not in last, last  # every part produced its figure
    assert "sweep micro batch 2" in out and "lora: base" in out

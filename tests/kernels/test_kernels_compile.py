"""The Triton kernels compile for NVIDIA GPUs (sm_80, sm_90) at the engine's launches, without
spilling registers or overrunning shared memory: bench/compile_check, which lowers them with
the Triton wheel's own compiler and ptxas, no GPU needed. The interpreter the other kernel tests
use never lowers a kernel, so it cannot see these failures; the broken variants below pass under
it and fail here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
{patch}
from bench import compile_check
results = compile_check.check({models}, ["bfloat16"], {block_sizes}, [80, 90], {kernels})
print(json.dumps([
    dict(kernel=r.launch.kernel.fn.__name__, arch=r.arch, case=r.launch.case, regs=r.regs,
         spill=r.spill_bytes, shared=r.shared, errors=r.errors)
    for r in results
]))
"""


def compile_all(
    models: list[str],
    patch: str = "",
    block_sizes: tuple[int, ...] = (16, 32),
    kernels: list[str] | None = None,
) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            "-c",
            SCRIPT.format(
                patch=patch, models=models, block_sizes=list(block_sizes), kernels=kernels
            ),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_kernels_compile_for_sm80_and_sm90():
    # SmolLM2 (head dim 64, GQA 3) and Qwen2.5-1.5B (head dim 128, GQA 6), blocks of 16 and 32.
    results = compile_all(["smollm2", "qwen-1.5b"])
    kernels = {r["kernel"] for r in results}
    assert kernels == {
        "_store_kv_kernel",
        "_paged_attention_kernel",
        "_decode_split_kernel",
        "_decode_merge_kernel",
        "_lora_shrink_kernel",
        "_lora_expand_kernel",
        "_candidate_kernel",
        "_accept_kernel",
    }
    assert {r["arch"] for r in results} == {80, 90}
    assert [r for r in results if r["errors"]] == []
    assert all(0 < r["regs"] <= 255 for r in results)


def test_a_merge_tile_that_spills_fails_the_check():
    """The decode merge reading up to 1024 splits in one tile (what it did before MERGE_SPLITS,
    with splits of 16 blocks): exact under the interpreter, 255 registers and spills on a GPU."""
    patch = (
        "import kernels.triton_decode as t; "
        "t.MERGE_SPLITS = t.MAX_SPLITS = 1024; t.DECODE_PROGRAMS = 1 << 20"
    )
    results = compile_all(["smollm2"], patch, (16,), ["_decode_merge_kernel"])
    spilled = {r["case"] for r in results if r["errors"]}
    assert spilled == {"smollm2 bfloat16 bs16 decode ctx 131072"}  # 1024 splits; 1000: 63
    assert all("local memory" in e for r in results for e in r["errors"])


def test_tiles_over_shared_memory_fail_the_check():
    """LoRA tiles of 1024 rows: the interpreter runs them (it has no shared memory), a GPU
    cannot launch them."""
    patch = "import kernels.triton_lora as t; t.BLOCK_M = 1024"
    results = compile_all(["smollm2"], patch, (16,), ["_lora_shrink_kernel"])
    over = [r for r in results if any(e.startswith("shared memory") for e in r["errors"])]
    assert {r["arch"] for r in over} == {80, 90}

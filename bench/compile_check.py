"""Compile the Triton kernels for NVIDIA GPUs on a machine without one.

    python -m bench.compile_check [--arch 80,90] [--models smollm2,...] [--dtypes bfloat16]

The interpreter (TRITON_INTERPRET=1, how the tests run the kernels on CPU) executes a kernel's
Python with numpy: it never lowers it, so it cannot see what only the GPU compiler rejects or
what makes a kernel slow there (an operand type tl.dot refuses, a tile that spills registers,
shared memory over the chip's limit). This module records the launches the engine makes at real
model shapes (the launchers are called as the engine calls them, through engine.attention and
lora.batch, with the kernels swapped for recorders), specializes each launch's arguments as
Triton's launcher would (integer 1 as a constant, 16-byte alignment), compiles it to cubin for
each architecture with the Triton wheel's own ptxas, and reads ptxas's resource usage:
registers, spilled bytes, shared memory, and the grid against CUDA's limits.

Needs the regular triton wheel (it ships ptxas) and TRITON_INTERPRET unset: it compiles the
kernels' real `triton.jit` functions. Last line: RESULT compiled=.. failed=.. spilled=..
max_regs=.. max_shared_kb=..
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import triton
from triton import knobs

# Attention heads and projection sizes of the models the project serves and benchmarks.
MODELS = {
    "smollm2": dict(heads=9, kv_heads=3, head_dim=64, hidden=576, intermediate=1536, vocab=49152),
    "qwen-0.5b": dict(
        heads=14, kv_heads=2, head_dim=64, hidden=896, intermediate=4864, vocab=151936
    ),
    "qwen-1.5b": dict(
        heads=12, kv_heads=2, head_dim=128, hidden=1536, intermediate=8960, vocab=151936
    ),
    "llama-1b": dict(
        heads=32, kv_heads=8, head_dim=64, hidden=2048, intermediate=8192, vocab=128256
    ),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Shared memory one block may use (opt-in maximum), per compute capability.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
GRID_LIMIT = (2**31 - 1, 65535, 65535)
# Registers spilled to local memory, bytes per thread, over which a launch fails. ptxas, run
# with Triton's flags, parks a few values of a loop now and then (4 B for the varlen kernel on
# sm_80 at Qwen2.5-1.5B's shapes); a tile that does not fit spills hundreds.
SPILL_BUDGET = 32
KERNEL_MODULES = (
    "kernels.triton_attention",
    "kernels.triton_decode",
    "kernels.triton_lora",
    "kernels.triton_rejection",
)


@dataclass
class Launch:
    kernel: triton.JITFunction
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict
    case: str  # which engine call made it


@dataclass
class Compiled:
    launch: Launch
    arch: int
    seconds: float
    regs: int = 0
    spill_bytes: int = 0  # local memory per thread: registers that did not fit
    shared: int = 0  # dynamic shared memory, bytes
    errors: list[str] = field(default_factory=list)


class _Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self, kernel: triton.JITFunction, sink: list[Launch], case: list[str]):
        self.kernel, self.sink, self.case = kernel, sink, case

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            grid_ = tuple(grid) + (1,) * (3 - len(grid))
            self.sink.append(Launch(self.kernel, grid_, args, kwargs, self.case[0]))

        return launch


@contextmanager
def recording() -> Iterator[tuple[list[Launch], list[str]]]:
    """Every launch of the kernel modules inside the block is recorded, none runs. Yields the
    launches and a one-item list whose item labels the launches that follow."""
    import importlib

    launches: list[Launch] = []
    case = [""]
    saved = []
    for name in KERNEL_MODULES:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if attr.endswith("_kernel"):
                if not isinstance(value, triton.JITFunction):
                    raise RuntimeError(
                        f"{name}.{attr} is not a triton.JITFunction: unset TRITON_INTERPRET"
                    )
                saved.append((module, attr, value))
    try:
        for module, attr, value in saved:
            setattr(module, attr, _Recorder(value, launches, case))
        yield launches, case
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


def engine_launches(model: str, dtype: torch.dtype, block_size: int) -> list[Launch]:
    """The launches of one layer's attention for a decode step, a verify step (1 + 4 tokens) and
    a prefill chunk, at short and 128k contexts, of the LoRA kernels at rank 16 and 64 over
    the fused qkv and gate/up projections (8 adapters, 8 rows each), through the same calls the
    engine makes, and of the fused rejection sampler over the model's vocabulary."""
    from engine.attention import varlen_metadata

    shape = MODELS[model]
    heads, kv_heads, head_dim = shape["heads"], shape["kv_heads"], shape["head_dim"]
    num_blocks = 64  # the cache's size does not change any kernel's code
    k_cache = torch.zeros(kv_heads, num_blocks, block_size, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)

    def attend(seq_lens: list[int], query_lens: list[int]) -> None:
        tables = [[1 + j % (num_blocks - 1) for j in range(-(-n // block_size))] for n in seq_lens]
        num_tokens = sum(query_lens)
        slots = torch.arange(num_tokens, dtype=torch.long) % (num_blocks * block_size)
        meta = varlen_metadata(seq_lens, query_lens, tables, slots, block_size)
        q = torch.zeros(num_tokens, heads, head_dim, dtype=dtype)
        kv = torch.zeros(num_tokens, kv_heads, head_dim, dtype=dtype)
        meta.attend(q, kv, kv, k_cache, v_cache, head_dim**-0.5)

    with recording() as (launches, case):
        for context in (1000, 131072):
            case[0] = f"decode ctx {context}"
            attend([context, 17], [1, 1])
            case[0] = f"verify ctx {context}"
            attend([context, 17], [5, 5])
            case[0] = f"prefill ctx {context}"
            attend([context, 512], [512, 512])
        for rank in (16, 64):
            case[0] = f"lora rank {rank}"
            _lora_launches(shape, dtype, rank)
        case[0] = "rejection 64 x (1 + 4)"
        _rejection_launches(shape["vocab"])
    return launches


def _lora_launches(shape: dict, dtype: torch.dtype, rank: int) -> None:
    from kernels.triton_lora import lora_expand, lora_shrink

    tokens, slots = 64, 9
    rows = torch.arange(tokens, dtype=torch.int32)  # as lora.batch.KernelLoRABatch builds them
    seg_starts = torch.arange(0, tokens + 1, 8, dtype=torch.int32)
    seg_slots = torch.arange(1, slots, dtype=torch.int32)
    hidden, head_dim = shape["hidden"], shape["head_dim"]
    qkv = (shape["heads"] + 2 * shape["kv_heads"]) * head_dim
    for size_in, size_out in ((hidden, qkv), (hidden, 2 * shape["intermediate"])):
        x = torch.zeros(tokens, size_in, dtype=dtype)
        a = torch.zeros(slots, size_in, rank, dtype=dtype)
        b = torch.zeros(slots, rank, size_out, dtype=dtype)
        y = torch.zeros(tokens, size_out, dtype=dtype)
        shrunk = lora_shrink(x, a, rows, seg_starts, seg_slots, 8)
        lora_expand(shrunk, b, y, 0, rows, seg_starts, seg_slots, 8)


def _rejection_launches(vocab: int, num_reqs: int = 64, max_rows: int = 5) -> None:
    from kernels.triton_rejection import rejection_verify

    num_rows = num_reqs * max_rows
    probs = torch.zeros(num_rows, vocab)
    rows = torch.zeros(num_rows, dtype=torch.int64)
    flags = torch.zeros(num_reqs, dtype=torch.bool)
    cu_rows = torch.arange(0, num_rows + 1, max_rows)
    rejection_verify(probs, rows, probs, cu_rows, flags, flags, rows.float(), probs, max_rows)


@dataclass
class _Bound:
    """A launch's arguments as Triton's launcher specializes them for one architecture."""

    launch: Launch
    target: object  # triton.backends.compiler.GPUTarget
    backend: object
    kwargs: dict
    bound: dict
    specialization: list
    options: object

    @classmethod
    def of(cls, launch: Launch, arch: int) -> _Bound:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature

        kernel, kwargs = launch.kernel, dict(launch.kwargs, debug=False)
        target = GPUTarget("cuda", arch, 32)
        backend = make_backend(target)
        # What JITFunction.run does before it looks up or compiles a kernel.
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*launch.args, **kwargs)
        return cls(launch, target, backend, kwargs, bound, specialization, options)

    def key(self) -> tuple:
        """Launches with equal keys compile to the same code (Triton's own cache key)."""
        return (self.launch.kernel.fn.__name__, str(self.specialization), str(self.options))


def _compile(b: _Bound) -> Compiled:
    from triton.compiler import ASTSource

    launch, arch = b.launch, b.target.arch
    result = Compiled(launch, arch, 0.0)
    for dim, (size, limit) in enumerate(zip(launch.grid, GRID_LIMIT, strict=True)):
        if size > limit:
            result.errors.append(f"grid dimension {dim} is {size}, over CUDA's {limit}")
    options, signature, constexprs, attrs = launch.kernel._pack_args(
        b.backend, b.kwargs, b.bound, b.specialization, b.options
    )
    start = time.perf_counter()
    log = io.StringIO()
    try:
        # Triton prints ptxas's -v report when asked; a cached kernel is compiled again for it.
        with (
            knobs.nvidia.scope(),
            knobs.compilation.scope(),
            contextlib.redirect_stdout(log),
        ):
            knobs.nvidia.dump_ptxas_log = True
            knobs.compilation.always_compile = True
            compiled = triton.compile(
                ASTSource(launch.kernel, signature, constexprs, attrs),
                target=b.target,
                options=options.__dict__,
            )
    except Exception as exc:  # noqa: BLE001 - any compiler error is the finding
        result.errors.append(f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1]}")
        return result
    result.seconds = time.perf_counter() - start
    result.regs, result.spill_bytes = _ptxas_usage(log.getvalue())
    result.shared = compiled.metadata.shared
    if result.spill_bytes > SPILL_BUDGET:
        result.errors.append(
            f"spills {result.spill_bytes} B per thread to local memory (budget {SPILL_BUDGET} B)"
        )
    limit = SHARED_LIMIT.get(arch)
    if limit is not None and result.shared > limit:
        result.errors.append(f"shared memory {result.shared} B over sm_{arch}'s {limit} B")
    return result


def _ptxas_usage(log: str) -> tuple[int, int]:
    """(registers per thread, bytes of registers spilled per thread) from ptxas -v."""
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    if regs is None or spills is None:
        raise RuntimeError(f"no resource usage in ptxas's report: {log[-300:]!r}")
    return int(regs.group(1)), int(spills.group(1))


def check(
    models: list[str],
    dtypes: list[str],
    block_sizes: list[int],
    archs: list[int],
    kernels: list[str] | None = None,
) -> list[Compiled]:
    """Compile each distinct launch of the given configurations once per architecture (of the
    named kernels only, if given)."""
    launches = []
    for model in models:
        for dtype in dtypes:
            for block_size in block_sizes:
                for launch in engine_launches(model, DTYPES[dtype], block_size):
                    if kernels is None or launch.kernel.fn.__name__ in kernels:
                        launch.case = f"{model} {dtype} bs{block_size} {launch.case}"
                        launches.append(launch)
    distinct: dict[tuple, _Bound] = {}
    for launch in launches:
        for arch in archs:
            bound = _Bound.of(launch, arch)
            distinct.setdefault((arch, bound.key()), bound)
    return [_compile(b) for b in distinct.values()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="80,90", help="compute capabilities, e.g. 80,90")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--block-sizes", default="16,32")
    parser.add_argument("--kernels", help="only these, e.g. _decode_merge_kernel")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")
    results = check(
        args.models.split(","),
        args.dtypes.split(","),
        [int(b) for b in args.block_sizes.split(",")],
        [int(a) for a in args.arch.split(",")],
        args.kernels.split(",") if args.kernels else None,
    )
    print(f"{'kernel':<24} {'arch':>4} {'regs':>4} {'spill':>5} {'smem KB':>7} {'s':>5}  case")
    for r in results:
        name = r.launch.kernel.fn.__name__
        print(
            f"{name:<24} {r.arch:>4} {r.regs:>4} {r.spill_bytes:>5} {r.shared / 1024:>7.1f} "
            f"{r.seconds:>5.2f}  {r.launch.case}"
        )
        for error in r.errors:
            print(f"  ERROR {error}")
    failed = [r for r in results if r.errors]
    print(
        f"RESULT compiled={len(results) - len(failed)} failed={len(failed)} "
        f"spilled={sum(r.spill_bytes > 0 for r in results)} "
        f"max_regs={max(r.regs for r in results)} "
        f"max_shared_kb={max(r.shared for r in results) / 1024:.1f}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

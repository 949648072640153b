"""Tandem's C++ CPU kernels (kernels/cpu/*.cpp): built on this machine, loaded as torch ops.

The library is compiled for the CPU it runs on (-march=native: AVX-512 VNNI, AVX-VNNI or AVX2
code paths, chosen by the compiler's view of this machine) into the Tandem cache, keyed by the
sources, torch's version and the CPU's flags, so a cache shared between machines never loads a
build for another CPU. `make install` builds it ahead (`python -m kernels.cpu`); otherwise the
first model load does (2-3 minutes on 2 cores). Without a C++ compiler, on a CPU without AVX2
and FMA, or with TANDEM_CPU_KERNELS=0, `load()` says why and returns None, and the quantized
layers use torch's own int4 kernel instead (engine/models/quantized.py).

    python -m kernels.cpu          # build (if needed) and print the instruction set in use
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

SOURCES = sorted((Path(__file__).parent / "cpu").glob("*.cpp"))
# TANDEM_CPU_MARCH=haswell builds the AVX2 path on any newer x86 CPU (tests use it).
MARCH = os.environ.get("TANDEM_CPU_MARCH", "native")
FLAGS = [
    f"-march={MARCH}",
    "-O3",
    "-ffp-contract=off",
    "-fopenmp",
    "-std=c++20",
    "-shared",
    "-fPIC",
]


def _cpu_flags() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    import platform

    return platform.processor() or platform.machine()


def library_path() -> Path:
    """In the Tandem cache ($TANDEM_CACHE_DIR, default ~/.cache/tandem, as the model registry's),
    under a name keyed by what the build depends on."""
    cache = os.environ.get("TANDEM_CACHE_DIR")
    cache_dir = Path(cache).expanduser() if cache else Path.home() / ".cache" / "tandem"
    key = hashlib.sha256()
    for source in SOURCES:
        key.update(source.read_bytes())
    for header in sorted((Path(__file__).parent / "cpu").glob("*.h")):
        key.update(header.read_bytes())
    key.update(" ".join([torch.__version__, *FLAGS, _cpu_flags()]).encode())
    return cache_dir / "kernels" / f"tandem_cpu_{key.hexdigest()[:16]}.so"


def build(verbose: bool = False) -> Path:
    """Compile the library if this machine has no build of the current sources; its path."""
    out = library_path()
    if out.is_file():
        return out
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (set CXX or install g++)")
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        target = Path(tmp) / out.name
        command = [
            compiler,
            *FLAGS,
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-I{torch_dir / 'include'}",
            f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
            *map(str, SOURCES),
            "-o",
            str(target),
            f"-L{torch_dir / 'lib'}",
            "-lc10",
            "-ltorch_cpu",
            f"-Wl,-rpath,{torch_dir / 'lib'}",
        ]
        if verbose:
            print(" ".join(command), file=sys.stderr)
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building {out.name} failed:\n{done.stderr[-4000:]}")
        os.replace(target, out)  # atomic: a concurrent loader sees all of it or nothing
    return out


@functools.cache
def load() -> str | None:
    """Build and load the library once; its instruction set ("avx512-vnni", "avx-vnni",
    "avx2"), or None (with a warning saying why) where it cannot run here."""
    if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
        return None
    try:
        torch.ops.load_library(str(build()))
    except (RuntimeError, OSError) as e:
        warnings.warn(f"Tandem's CPU kernels are unavailable ({e}); using torch's", stacklevel=2)
        return None
    isa = torch.ops.tandem_cpu.isa()
    return None if isa == "none" else isa


if __name__ == "__main__":
    path = build(verbose=True)
    print(f"{path}: {load() or 'no kernel for this CPU'}")

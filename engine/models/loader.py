"""Load a model directory (config.json with *.safetensors, or a GGUF beside its config) into its
architecture's model (engine.models.architectures), and the engine's target and draft."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from engine.config import QUANTIZATIONS, EngineConfig
from engine.models import huge_pages, kv_cache
from engine.models.architectures import Checkpoint, architecture
from engine.models.causal_lm import CausalLM
from engine.models.config import ModelConfig
from engine.models.gguf_loader import GGUFWeights
from engine.models.layers import onednn_linear_available
from engine.models.parallel import Parallel, local_config
from engine.models.quant import cpu_has_fast_bf16, int8_linear_available
from engine.models.registry import resolve_model

logger = logging.getLogger(__name__)


def _safetensor_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {str(path)!r} has no *.safetensors weights")
    return files


def _load_state(path: Path) -> dict[str, torch.Tensor]:
    state = {}
    for file in _safetensor_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    state[name.removeprefix("model.")] = f.get_tensor(name).float()
        except Exception as e:  # truncated, corrupt, not safetensors at all
            raise ValueError(f"cannot read weights {str(file)!r}: {e}") from None
    return state


def release_freed_memory() -> None:
    """Hand the heap memory a load freed back to the OS (glibc keeps it otherwise): decoding a
    GGUF allocates and drops several transient copies of every tensor, and without this the
    process kept about as much again as the weights in freed pages (bench/RESULTS.md)."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def gguf_file(path: str | Path) -> Path | None:
    """The GGUF a model directory holds next to its config (embedded models keep theirs)."""
    files = sorted(Path(path).glob("*.gguf"))
    return files[0] if files else None


def resolve_quantization(quantization: str | None, path: Path, device: torch.device) -> str | None:
    """What `quantization` means for this model on this device: "gguf" (the file's own
    blocks), "int4" / "int8" (weight-only, quantized from the dense checkpoint) or None.
    "auto" is "gguf" for a directory with a GGUF file on CPU, else None: on CUDA the dense
    weights in the model's dtype (the same values as the GGUF's blocks, dequantized) until a
    GPU measures a quantized kernel."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if quantization != "auto":
        return quantization
    return "gguf" if not needs_dense(quantization, device) and gguf_file(path) else None


def needs_dense(quantization: str | None, device: torch.device) -> bool:
    """Whether a load with `quantization` reads the dense checkpoint: all but "auto" on CPU,
    which runs a directory's GGUF (an embedded model's float32 copy is then never written)."""
    return quantization != "auto" or device.type != "cpu"


def draft_load_args(draft_quantization: str | None, path: Path, device: torch.device) -> dict:
    """load_model's arguments for a draft model: "auto" runs a GGUF draft's own blocks and
    otherwise the dynamic int8 projections (CPU float32; dense elsewhere)."""
    if draft_quantization == "auto":
        draft_quantization = resolve_quantization("auto", path, device) or "dynamic-int8"
    if draft_quantization == "dynamic-int8":
        return {"quantization": None, "int8": True}
    return {"quantization": draft_quantization}


def load_model(
    path: str | Path,
    max_len: int | None = None,
    pack_weights: bool = True,
    int8: bool = False,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    quantization: str | None = None,
    group=None,
):
    """Returns (model, ModelConfig, hf_config). max_len: the engine's context (None: the
    model's max_position_embeddings), which picks LongRoPE's factors.

    quantization: None (dense weights in dtype, the exact reference), "auto", "gguf", "int4" or
    "int8" (see resolve_quantization and engine.models.quantized). pack_weights: on CPU, hand dense
    linear weights to oneDNN's blocked layout (see `Linear.pack`); False keeps plain dense
    weights. int8: the draft models' int8 projections and LM head instead (lossy, see
    engine.models.quant), where the backend supports it. Both are CPU float32 layouts.
    group: a tensor-parallel group (engine.distributed.tensor_parallel): the model is then this
    rank's shard, split as the weights load, before they move or are packed.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    device = torch.device(device)
    if quantization != "gguf":
        quantization = resolve_quantization(quantization, path, device)
    hf_config = AutoConfig.from_pretrained(str(path))
    arch = architecture(hf_config.model_type)
    cfg = arch.config(hf_config)
    context = min(max_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    model = arch.build(cfg, hf_config, context, Parallel.of(group))
    model = model.eval()
    if quantization == "gguf":
        source = gguf_file(path)
        if source is None:
            raise ValueError(f"model directory {str(path)!r} has no GGUF file")
        weights = arch.gguf_weights(cfg, GGUFWeights(source))
    else:
        checkpoint = Checkpoint(_load_state(path))
        weights = arch.hf_weights(cfg, checkpoint)
    for name, *tensors in weights:  # each projection takes this rank's share as it loads
        model.load_weight(name, *tensors, device=device, dtype=dtype)
    if quantization != "gguf":
        checkpoint.check_all_taken()
    model.check_loaded()
    model = model.to(device=device, dtype=dtype)  # (the norms)
    for rotary in model.rotary.values():
        rotary.place(device, dtype)
    if quantization in ("int4", "int8"):
        model.quantize(4 if quantization == "int4" else 8)
    elif device.type == "cpu" and dtype == torch.float32 and quantization is None:
        if int8 and int8_linear_available():
            model.quantize_int8()
        elif pack_weights and onednn_linear_available():
            model.pack_linear_weights()
    model.fuse()
    if device.type == "cpu":  # decode streams the weights: from huge pages, read faster
        huge_pages.move_storages(huge_pages.module_tensors(model))
    release_freed_memory()  # the checkpoint's copies, the unpacked or unsplit weights
    return model, cfg, hf_config


def read_generation_eos(path: str | Path) -> set[int]:
    """EOS ids from generation_config.json (may list several), if present."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return set()
    eos = json.loads(file.read_text()).get("eos_token_id")
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {eos}


@dataclass
class EngineModels:
    path: Path  # the target's directory
    model: CausalLM
    cfg: ModelConfig
    draft: tuple[CausalLM, ModelConfig] | None  # with a draft_model
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: set[int]  # the generation config's and the tokenizer's
    shard_cfg: ModelConfig  # the shape of this rank's shard of the target (cfg on one rank)
    # The target's KV cache elements and the draft's (engine.models.kv_cache.kv_cache_format)
    kv_formats: tuple[torch.dtype, torch.dtype | None] = (torch.float32, None)

    def kv_bytes_per_block(self, block_size: int) -> int:
        """This process's bytes per block: the draft model's KV (on rank 0 only, whole) lives
        in the same blocks as the target's share."""
        shapes = [(self.shard_cfg, self.kv_formats[0])]
        if self.draft:
            shapes.append((self.draft[1], self.kv_formats[1]))
        return sum(kv_cache.kv_bytes_per_block(c, block_size, f) for c, f in shapes)


def load_target(config: EngineConfig, group=None) -> tuple[CausalLM, ModelConfig, Path]:
    """The target model as the config says (with a tensor-parallel group: this rank's shard),
    and its directory. draft_model="self" drafts with the target's own quantized copy, so the
    target itself then loads exact (dense)."""
    device, dtype = config.torch_device, config.torch_dtype
    quantization = target_quantization(config)
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_fast_bf16():
        logger.warning("dtype=bfloat16 on a CPU without AVX512-BF16 or AMX: slower than float32")
    path = target_path(config)
    model, cfg, _ = load_model(
        path, config.max_model_len, device=device, dtype=dtype, quantization=quantization,
        group=group,
    )  # fmt: skip
    return model, cfg, path


def target_quantization(config: EngineConfig) -> str | None:
    return None if config.draft_model == "self" else config.quantization


def target_path(config: EngineConfig) -> Path:
    """The target's directory, converted (once) to what its load reads: a dense checkpoint
    only when the load needs one."""
    dense = needs_dense(target_quantization(config), config.torch_device)
    return resolve_model(config.model, dense=dense)


def load_engine_models(config: EngineConfig, group=None) -> EngineModels:
    """The target model (with a tensor-parallel group, rank 0's shard) and, with
    a draft_model, the draft model (whole, on rank 0), as the config says."""
    device, dtype = config.torch_device, config.torch_dtype
    model, cfg, path = load_target(config, group)
    shard_cfg = cfg if group is None else local_config(cfg, group.world)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    eos = read_generation_eos(path) | {tokenizer.eos_token_id} - {None}
    target_kv = kv_cache.kv_cache_format(config.kv_cache_dtype, model)
    if not config.draft_model:  # (alone, or after suffix drafts)
        return EngineModels(path, model, cfg, None, tokenizer, eos, shard_cfg, (target_kv, None))
    dense = needs_dense(config.draft_quantization, device)
    draft_path = path if config.draft_model == "self" else resolve_model(config.draft_model, dense)
    draft_model, draft_cfg, _ = load_model(
        draft_path,
        config.max_model_len,
        device=device,
        dtype=dtype,
        **draft_load_args(config.draft_quantization, draft_path, device),
    )
    if draft_cfg.vocab_size != cfg.vocab_size:
        raise ValueError(
            f"draft_model vocabulary ({draft_cfg.vocab_size}) differs from the target's "
            f"({cfg.vocab_size}); the two models must share a tokenizer"
        )
    # The draft's KV is int8 too where its layers run on the C++ kernels, else in its dtype.
    draft_kv = kv_cache.kv_cache_format(config.kv_cache_dtype, draft_model, strict=False)
    draft = (draft_model, draft_cfg)
    return EngineModels(path, model, cfg, draft, tokenizer, eos, shard_cfg, (target_kv, draft_kv))

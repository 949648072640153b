"""Load an HF-format directory (config.json + *.safetensors) into our Llama-family module."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from engine.config import QUANTIZATIONS, EngineConfig
from engine.models.config import ModelConfig
from engine.models.gguf_loader import load_gguf_weights
from engine.models.llama import LlamaForCausalLM, onednn_linear_available
from engine.models.quant import int8_linear_available
from engine.models.registry import resolve_model

SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3", "yarn", "longrope"}


def rope_parameters(hf_config) -> tuple[torch.Tensor, float]:
    """inv_freq [head_dim // 2] and the cos/sin scaling, via transformers' own RoPE functions."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: {sorted(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        cfg = ModelConfig.from_hf(hf_config)
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = cfg.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    return inv_freq.float(), float(scaling)


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


def _fused_state(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map HF parameter names to ours, concatenating q/k/v and gate/up."""
    out = {
        "embed_tokens.weight": hf.pop("embed_tokens.weight"),
        "norm.weight": hf.pop("norm.weight"),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head_weight"] = hf.pop("lm_head.weight")
    hf.pop("lm_head.weight", None)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        att, mlp = p + "self_attn.", p + "mlp."
        out[p + "qkv_proj.weight"] = torch.cat([hf.pop(att + f"{n}_proj.weight") for n in "qkv"])
        if cfg.qkv_bias:
            out[p + "qkv_proj.bias"] = torch.cat([hf.pop(att + f"{n}_proj.bias") for n in "qkv"])
        out[p + "o_proj.weight"] = hf.pop(att + "o_proj.weight")
        gate_up = [hf.pop(mlp + "gate_proj.weight"), hf.pop(mlp + "up_proj.weight")]
        out[p + "gate_up_proj.weight"] = torch.cat(gate_up)
        out[p + "down_proj.weight"] = hf.pop(mlp + "down_proj.weight")
        if cfg.mlp_bias:
            bias = [hf.pop(mlp + "gate_proj.bias"), hf.pop(mlp + "up_proj.bias")]
            out[p + "gate_up_proj.bias"] = torch.cat(bias)
            out[p + "down_proj.bias"] = hf.pop(mlp + "down_proj.bias")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[p + norm + ".weight"] = hf.pop(p + norm + ".weight")
    leftover = [k for k in hf if not k.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise ValueError(f"unexpected weights in checkpoint: {leftover[:5]}")
    return out


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
    """Returns (model, ModelConfig, hf_config). max_len bounds the RoPE table.

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
    cfg = ModelConfig.from_hf(hf_config)
    inv_freq, scaling = rope_parameters(hf_config)
    model = LlamaForCausalLM(cfg, inv_freq, scaling, max_len or cfg.max_position_embeddings)
    model.eval().requires_grad_(False)
    if quantization == "gguf":
        source = gguf_file(path)
        if source is None:
            raise ValueError(f"model directory {str(path)!r} has no GGUF file")
        split = None
        if group is not None:
            from engine.distributed.tensor_parallel import Split, shard_model

            split = Split(cfg, group.rank, group.world)
        load_gguf_weights(model, source, device, dtype, split)
        if group is not None:
            shard_model(model, group)  # (the projections came split)
        release_freed_memory()
        model = model.to(device=device, dtype=dtype)
        model.fuse()
        return model, cfg, hf_config
    state = _fused_state(cfg, _load_state(path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head_weight")]
    if missing or unexpected:
        raise ValueError(
            f"weights do not match the model: missing={missing} unexpected={unexpected}"
        )
    if group is not None:
        from engine.distributed.tensor_parallel import shard_model

        shard_model(model, group)
    if device.type != "cpu" or dtype != torch.float32:
        # The RoPE tables go to dtype too, as HF casts cos/sin to the activations' dtype.
        model = model.to(device=device, dtype=dtype)
    if quantization in ("int4", "int8"):
        model.quantize(4 if quantization == "int4" else 8)
        model.fuse()
    elif device.type == "cpu" and dtype == torch.float32:
        if int8 and int8_linear_available():
            model.quantize_int8()
        elif pack_weights and onednn_linear_available():
            model.pack_linear_weights()
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
    model: LlamaForCausalLM
    cfg: ModelConfig
    draft: tuple[LlamaForCausalLM, ModelConfig] | None  # with spec_method="draft"
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: set[int]  # the generation config's and the tokenizer's
    shard_cfg: ModelConfig  # the shape of this rank's shard of the target (cfg on one rank)

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """This process's bytes per block: the draft model's KV (on rank 0 only, whole) lives
        in the same blocks as the target's share."""
        cfgs = [self.shard_cfg] + ([self.draft[1]] if self.draft else [])
        element_bytes = torch.empty((), dtype=dtype).element_size()
        return sum(c.kv_bytes_per_block(block_size, element_bytes) for c in cfgs)


def load_target(config: EngineConfig, group=None) -> tuple[LlamaForCausalLM, ModelConfig, Path]:
    """The target model as the config says (with a tensor-parallel group: this rank's shard),
    and its directory. draft_model="self" drafts with the target's own quantized copy, so the
    target itself then loads exact (dense)."""
    device, dtype = config.torch_device, config.torch_dtype
    quantization = target_quantization(config)
    path = target_path(config)
    model, cfg, _ = load_model(
        path, device=device, dtype=dtype, quantization=quantization, group=group
    )
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
    spec_method="draft", the draft model (whole, on rank 0), as the config says."""
    device, dtype = config.torch_device, config.torch_dtype
    model, cfg, path = load_target(config, group)
    shard_cfg = cfg
    if group is not None:
        from engine.distributed.tensor_parallel import local_config

        shard_cfg = local_config(cfg, group.world)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    eos = read_generation_eos(path) | {tokenizer.eos_token_id} - {None}
    if config.spec_method != "draft":
        return EngineModels(path, model, cfg, None, tokenizer, eos, shard_cfg)
    dense = needs_dense(config.draft_quantization, device)
    draft_path = path if config.draft_model == "self" else resolve_model(config.draft_model, dense)
    draft_model, draft_cfg, _ = load_model(
        draft_path,
        device=device,
        dtype=dtype,
        **draft_load_args(config.draft_quantization, draft_path, device),
    )
    if draft_cfg.vocab_size != cfg.vocab_size:
        raise ValueError(
            f"draft_model vocabulary ({draft_cfg.vocab_size}) differs from the target's "
            f"({cfg.vocab_size}); the two models must share a tokenizer"
        )
    return EngineModels(path, model, cfg, (draft_model, draft_cfg), tokenizer, eos, shard_cfg)

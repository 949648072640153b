"""Load a GGUF file's weights in their own quantized form into our Llama-family module.

The file is memory-mapped (gguf.GGUFReader) and each tensor's blocks are decoded straight into
codes with a scale and offset per 32 values (engine/models/gguf_blocks.py): no float32 copy of
a projection ever exists. Q/K/V and gate/up are fused as in the dense loader by stacking
rows; llama.cpp stores a Llama model's Q and K rows permuted for its RoPE kernel, and we undo
that permutation on the rows (transformers' GGUF loader does the same to the floats). Norms and
biases stay float32.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader

from engine.models.config import ModelConfig
from engine.models.gguf_blocks import decode, dequantize_rows
from engine.models.llama import LlamaForCausalLM
from engine.models.quantized import QuantizedWeight

_PERMUTED_ARCHITECTURES = {"llama", "mistral"}  # Q/K rows permuted by llama.cpp's converter


class GGUFWeights:
    """A GGUF file's tensors by name; quantized matrices as QuantizedWeight."""

    def __init__(self, path: str | Path):
        try:
            self.reader = GGUFReader(str(path))
        except Exception as e:  # not GGUF, truncated
            raise ValueError(f"cannot read GGUF file {str(path)!r}: {e}") from None
        self.tensors = {t.name: t for t in self.reader.tensors}

    def has(self, name: str) -> bool:
        return name in self.tensors

    def _tensor(self, name: str):
        if name not in self.tensors:
            raise ValueError(f"GGUF file has no tensor {name!r}")
        return self.tensors[name]

    def dense(self, name: str) -> torch.Tensor:  # float32, the tensor's shape (rows first)
        t = self._tensor(name)
        in_features = int(t.shape[0])
        rows = np.asarray(t.data).reshape(-1, t.data.shape[-1])
        return dequantize_rows(rows, t.tensor_type, in_features).reshape(
            tuple(reversed([int(s) for s in t.shape]))
        )

    def quantized(self, name: str, row_order: torch.Tensor | None = None) -> QuantizedWeight:
        t = self._tensor(name)
        in_features = int(t.shape[0])
        rows = np.asarray(t.data).reshape(int(t.shape[1]), -1)  # bytes, or floats for F32/F16
        weight = decode(rows, t.tensor_type, in_features)
        return weight if row_order is None else weight.rows(row_order)


def unpermute_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation: its converter interleaves each head's
    two RoPE halves (row (h, i, j) for half i, pair j goes to (h, j, i))."""
    half = num_rows // num_heads // 2
    return torch.arange(num_rows).reshape(num_heads, half, 2).transpose(1, 2).reshape(-1)


def layer_weights(w: GGUFWeights, cfg: ModelConfig, index: int) -> dict[str, QuantizedWeight]:
    """Layer `index`'s projections under our names, fused and in HF's row order."""
    p = f"blk.{index}."
    q_order = k_order = None
    if cfg.model_type in _PERMUTED_ARCHITECTURES:
        q_order = unpermute_rows(cfg.num_heads * cfg.head_dim, cfg.num_heads)
        k_order = unpermute_rows(cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads)
    qkv = [
        w.quantized(p + "attn_q.weight", q_order),
        w.quantized(p + "attn_k.weight", k_order),
        w.quantized(p + "attn_v.weight"),
    ]
    gate_up = [w.quantized(p + "ffn_gate.weight"), w.quantized(p + "ffn_up.weight")]
    return {
        "qkv_proj": QuantizedWeight.cat_rows(qkv),
        "o_proj": w.quantized(p + "attn_output.weight"),
        "gate_up_proj": QuantizedWeight.cat_rows(gate_up),
        "down_proj": w.quantized(p + "ffn_down.weight"),
    }


def load_gguf_weights(
    model: LlamaForCausalLM,
    gguf_path: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    split=None,
) -> None:
    """Fill `model` (built from the same checkpoint's config) with the GGUF's weights:
    projections, embedding and LM head quantized, the rest dense. split(name, weight[, bias]):
    a tensor-parallel rank's share of each projection, split.vocab(head) its LM head rows
    (engine.distributed.tensor_parallel.Split)."""
    cfg: ModelConfig = model.config
    if cfg.mlp_bias:
        raise ValueError("GGUF models with MLP biases are not supported")
    w = GGUFWeights(gguf_path)

    def put(param: torch.nn.Parameter, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            param.copy_(tensor)

    put(model.norm.weight, w.dense("output_norm.weight"))
    for i, layer in enumerate(model.layers):
        p = f"blk.{i}."
        put(layer.input_layernorm.weight, w.dense(p + "attn_norm.weight"))
        put(layer.post_attention_layernorm.weight, w.dense(p + "ffn_norm.weight"))
        if cfg.qkv_bias:
            bias = torch.cat([w.dense(p + f"attn_{n}.bias") for n in "qkv"])
            bias = split("qkv_proj", bias) if split else bias
            layer.qkv_proj.bias = torch.nn.Parameter(bias, requires_grad=False)
        for name, weight in layer_weights(w, cfg, i).items():
            weight = split(name, weight) if split else weight
            getattr(layer, name).set_quantized(weight, device, dtype)
    embed = w.quantized("token_embd.weight")
    head = w.quantized("output.weight") if w.has("output.weight") else embed
    rows = head.out_features
    head = split.vocab(head) if split else head  # (the embedding stays whole)
    model.set_quantized_embeddings(embed, head, device, dtype)
    model.lm_head_rows = rows  # the whole head's, before a split

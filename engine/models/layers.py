"""The layers architectures are built from: projections, norms, rotary tables, attention over
the paged KV cache, gated MLPs, the token embedding and the LM head.

A step's attention metadata decides its numerics: `RowAttention` (a model whose every layer
runs on our C++ kernels, kernels/cpu/fused_layer.cpp) takes the C++ pieces for norms, RoPE,
attention and the activation, so each row's numbers depend on its own tokens only; any other
metadata takes the torch reference ops. Layers know their tensor-parallel share when built
(engine.models.parallel) and their weights' format is chosen at load (engine.models.weights).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, RowAttention
from engine.models.config import ModelConfig
from engine.models.parallel import ONE_RANK, Parallel
from engine.models.quantized import QuantizedEmbedding, QuantizedLinear, QuantizedWeight
from engine.models.weights import Dense, DenseHead

if TYPE_CHECKING:
    from lora.batch import LoRABatch


class Linear(nn.Module):
    """y = x W^T + b through its weight format, set by `load`. Built knowing its share under
    tensor parallelism: split "column" keeps the rank's share of each of `parts`' output rows,
    "row" its share of the inputs (its product is then a partial sum, which it all-reduces;
    rank 0 alone adds the bias). lora: (layer index, group) whose adapter updates it adds
    (lora.batch.GROUPS), before the all-reduce."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        split: str | None = None,
        parts: list[int] | None = None,
        parallel: Parallel = ONE_RANK,
        lora: tuple[int, str] | None = None,
    ):
        super().__init__()
        self.split = split if parallel.world > 1 else None
        self.parts, self.parallel, self.lora, self.has_bias = parts, parallel, lora, bias
        world = parallel.world
        self.in_features = in_features // world if self.split == "row" else in_features
        self.out_features = out_features // world if self.split == "column" else out_features
        self.format: nn.Module | None = None  # engine.models.weights, or QuantizedLinear

    def load(self, weight, bias: torch.Tensor | None, device, dtype: torch.dtype) -> None:
        """The whole layer's weight ([out, in] floats, or a QuantizedWeight) and bias; this
        rank keeps its share, in the form the weight came in."""
        if (bias is not None) != self.has_bias:
            raise ValueError(f"a bias was {'not ' * self.has_bias}expected")
        weight, bias = self._share(weight, bias)
        if bias is not None:
            bias = bias.to(device=device, dtype=dtype)
        if isinstance(weight, QuantizedWeight):
            self.format = QuantizedLinear(weight, bias, device, dtype)
        else:
            self.format = Dense(weight.to(device=device, dtype=dtype), bias)

    def _share(self, weight, bias):
        p, quantized = self.parallel, isinstance(weight, QuantizedWeight)
        if self.split == "column":
            rows = p.rows(self.parts or [weight.out_features if quantized else weight.shape[0]])
            weight = weight.rows(rows) if quantized else weight[rows].contiguous()
            return weight, None if bias is None else bias[rows].contiguous()
        if self.split == "row":
            start, end = p.columns(weight.in_features if quantized else weight.shape[1])
            weight = weight.columns(start, end) if quantized else weight[:, start:end].contiguous()
            return weight, bias if bias is None or p.rank == 0 else torch.zeros_like(bias)
        return weight, bias

    def pack(self) -> None:  # CPU float32: oneDNN's blocked layout
        self.format = self.format.packed()

    def dynamic_int8(self) -> None:  # CPU float32, draft models
        self.format = self.format.dynamic_int8()

    def quantize(self, bits: int) -> None:
        """Weight-only quantization (engine.models.quantized) of the dense weight."""
        dense = self.format
        bias = None if dense.bias is None else dense.bias.detach()
        weight = QuantizedWeight.quantize(dense.weight, bits)
        self.format = QuantizedLinear(weight, bias, dense.weight.device, dense.weight.dtype)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        y = self.format(x)
        if lora is not None and self.lora is not None:
            lora.apply(*self.lora, x, y)
        if self.split == "row" and self.parallel.all_reduce is not None:
            y = self.parallel.all_reduce(y)
        return y


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def load(self, weight: torch.Tensor, device, dtype: torch.dtype) -> None:
        self.weight = nn.Parameter(weight.to(device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, rows: bool = False) -> torch.Tensor:
        """In float32 whatever x's dtype (as HF), the weight applied in x's dtype; rows: the
        C++ layers' norm."""
        if rows:
            return torch.ops.tandem_cpu.rms_norm(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, H, D]; cos/sin: [N, 1, D]. HF's rotate-half convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3", "yarn", "longrope"}


def rope_parameters(hf_config, head_dim: int, layer_type: str | None = None):
    """inv_freq [head_dim // 2] and the cos/sin scaling, via transformers' own RoPE functions;
    layer_type: a model whose layer types have RoPE parameters of their own (Gemma 3)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: {sorted(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", **kwargs)
    return inv_freq.float(), float(scaling)


class RotaryTables(nn.Module):
    """cos and sin for every position up to max_len ([max_len, D]) from inv_freq [D / 2]."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_len: int):
        super().__init__()
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    @classmethod
    def of(cls, hf_config, head_dim: int, max_len: int, layer_type: str | None = None):
        return cls(*rope_parameters(hf_config, head_dim, layer_type), max_len)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [N, 1, D]


class Attention(nn.Module):
    """Fused QKV projection, RoPE, paged attention over this rank's heads, output projection."""

    def __init__(self, cfg: ModelConfig, index: int, parallel: Parallel = ONE_RANK):
        super().__init__()
        d, world = cfg.head_dim, parallel.world
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads // world,
            cfg.num_kv_heads // world,
            d,
        )
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.scale = cfg.attn_scale or d**-0.5
        self.window = cfg.window_of(index) or 0  # 0: the whole context
        q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
        self.qkv_proj = Linear(
            cfg.hidden_size, q + 2 * kv, cfg.qkv_bias, "column", [q, kv, kv], parallel,
            (index, "qkv"),
        )  # fmt: skip
        self.o_proj = Linear(q, cfg.hidden_size, False, "row", None, parallel, (index, "o"))
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def head_norms(self) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
        """(q_norm weight, k_norm weight, eps) as the C++ pieces take them (None: none)."""
        if self.q_norm is None:
            return None, None, 0.0
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps

    def forward(
        self,
        h: torch.Tensor,  # [N, hidden], normed
        cos: torch.Tensor,  # [N, 1, D]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, Hkv, num_blocks, block_size, D]
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:  # [N, hidden], this rank's heads' share reduced
        qkv = self.qkv_proj(h, lora)  # [N, q + 2 kv]
        if isinstance(meta, RowAttention):
            ops = torch.ops.tandem_cpu
            ops.rope_store(
                qkv, cos, sin, kv_cache[0], kv_cache[1], meta.slot_mapping, self.num_heads,
                self.num_kv_heads, *self.head_norms(),
            )  # fmt: skip
            attn = ops.attend(
                qkv, kv_cache[0], kv_cache[1], meta.block_tables, meta.row_tables, meta.seq_lens,
                self.num_heads, self.num_kv_heads, self.head_dim, self.scale, self.window,
            )  # fmt: skip
        else:
            n = h.shape[0]
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(n, self.num_heads, self.head_dim)
            k = k.view(n, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            v = v.view(n, self.num_kv_heads, self.head_dim)
            if isinstance(meta, dict):  # layers with windows of their own: a layout each
                meta = meta[self.window or None]
            attn = meta.attend(q, k, v, kv_cache[0], kv_cache[1], self.scale)
            attn = attn.reshape(n, self.q_size)
        return self.o_proj(attn, lora)


class GatedMLP(nn.Module):
    """down(act(gate(h)) * up(h)), gate and up fused into one projection; act: silu, or GELU's
    tanh approximation (cfg.hidden_act "gelu_tanh")."""

    def __init__(self, cfg: ModelConfig, index: int, parallel: Parallel = ONE_RANK):
        super().__init__()
        self.gelu = cfg.hidden_act == "gelu_tanh"
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = Linear(
            hidden, 2 * inter, cfg.mlp_bias, "column", [inter, inter], parallel, (index, "gate_up")
        )
        self.down_proj = Linear(inter, hidden, cfg.mlp_bias, "row", None, parallel, (index, "down"))

    def forward(self, h: torch.Tensor, rows: bool, lora: LoRABatch | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(h, lora)  # [N, 2 inter]
        if rows:
            ops = torch.ops.tandem_cpu
            act = ops.gelu_tanh_mul(gate_up) if self.gelu else ops.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up
        return self.down_proj(act, lora)


class Embedding(nn.Module):
    """Token embedding: dense rows, or a QuantizedWeight's rows dequantized on lookup."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.shape = (vocab_size, hidden_size)
        self.format: nn.Module | None = None

    def load(self, weight, device, dtype: torch.dtype) -> None:
        if isinstance(weight, QuantizedWeight):
            self.format = QuantizedEmbedding(weight, device, dtype)
        else:
            self.format = nn.Embedding(*self.shape, _weight=weight.to(device=device, dtype=dtype))
            self.format.weight.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, hidden]
        return self.format(ids)


class LMHead(nn.Module):
    """Logits of the hidden rows. Under tensor parallelism each rank holds its vocabulary rows
    and rank 0 gathers the ranks' logits side by side."""

    def __init__(self, parallel: Parallel = ONE_RANK):
        super().__init__()
        self.parallel = parallel
        self.total_rows = 0  # the whole head's rows (a GGUF's may be padded past the vocab)
        self.format: nn.Module | None = None

    def load(self, weight, device, dtype: torch.dtype) -> None:
        """The whole head: [vocab, hidden] floats (an embedding's own Parameter when tied, then
        shared) or a QuantizedWeight; this rank keeps its rows (a fresh tensor)."""
        quantized = isinstance(weight, QuantizedWeight)
        self.total_rows = weight.out_features if quantized else weight.shape[0]
        if self.parallel.world > 1:
            start, end = self.parallel.vocab_rows(self.total_rows)
            weight = (
                weight.rows(torch.arange(start, end)) if quantized else weight[start:end].clone()
            )
        if quantized:
            self.format = QuantizedLinear(weight, None, device, dtype)
        elif isinstance(weight, nn.Parameter):
            self.format = DenseHead(weight)
        else:
            self.format = DenseHead(weight.to(device=device, dtype=dtype))

    def pack(self) -> None:
        self.format = self.format.packed()

    def dynamic_int8(self) -> None:
        self.format = self.format.dynamic_int8()

    def quantize(self, bits: int, weight: QuantizedWeight | None = None) -> None:
        """This rank's rows quantized (weight: already quantized, a tied embedding's)."""
        dense = self.format.weight
        weight = weight or QuantizedWeight.quantize(dense, bits)
        self.format = QuantizedLinear(weight, None, dense.device, dense.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [M, hidden] -> [M, total rows]
        logits = self.format(hidden)  # [M, this rank's rows]
        if self.parallel.gather_columns is None:
            return logits
        return self.parallel.gather_columns(logits, self.total_rows)

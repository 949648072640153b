"""The layers architectures are built from: projections, norms, rotary tables, attention over
the paged KV cache, gated MLPs, the token embedding, the LM head, and the pre-norm decoder
block most architectures share.

A step's attention metadata decides its numerics: `RowAttention` (a model whose every layer
runs on our C++ kernels, kernels/cpu/fused_layer.cpp) takes the C++ pieces for norms, RoPE,
attention and the activation, so each row's numbers depend on its own tokens only; any other
metadata takes the torch reference ops. Layers know their tensor-parallel share when built
(engine.models.parallel) and their weights' format is chosen at load.

Weight formats: one object per Linear (its `format`), each mapping x [M, in] to [M, out], bias
included.
- `Dense`: [out, in] in the model's dtype, F.linear: the exact reference, and CUDA's.
- `Packed`: oneDNN's blocked copy of a float32 weight (CPU). MKL's sgemm is slow at the few rows
  of decode, where oneDNN's packed GEMM is well ahead (bench.choices; bench/RESULTS.md
  "Measurements behind the core's choices"); at one row and at a few hundred they are even.
- `DynamicInt8`: per-channel int8 weights, activations quantized per call (draft models on
  CPU, engine.models.quant).
- engine.models.quantized.QuantizedLinear: integer codes with a scale and offset per 32 inputs
  (a GGUF's blocks, or int4 / int8 from a dense checkpoint).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, RowAttention
from engine.models.config import ModelConfig
from engine.models.parallel import ONE_RANK, Parallel
from engine.models.quant import linear_int8, pack_int8
from engine.models.quantized import (
    QUANTIZED,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedWeight,
    segment_operands,
)

if TYPE_CHECKING:
    from lora.batch import LoRABatch


def onednn_linear_available() -> bool:
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def padded_rows(num_rows: int) -> int:
    """The row count a packed GEMM runs at: exact up to 32 rows, above that rounded up to an
    eighth of the power of two below (at most 12.5% padding; 8 sizes per doubling)."""
    if num_rows <= 32:
        return num_rows
    step = 1 << (num_rows.bit_length() - 4)
    return -(-num_rows // step) * step


class Dense(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def layer_operands(self) -> tuple[str, tuple] | None:
        """What the one-call C++ layer takes of this projection: ("dense", (weight, bias))
        for a CPU float32 weight (kernels/cpu/dense_layer.cpp runs F.linear over it)."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.float32:
            return None
        return "dense", (w, self.bias)

    def packed(self) -> Packed:
        return Packed(self.weight.detach(), self.bias)

    def dynamic_int8(self) -> DynamicInt8:
        return DynamicInt8(self.weight.detach(), self.bias)


class Packed(nn.Module):
    """oneDNN's blocked copy of a float32 weight, its GEMM run over x's rows padded to
    padded_rows(M).

    oneDNN builds and keeps state for every input shape it sees (primitives, JIT code,
    buffers), so a server whose steps keep bringing new row counts keeps growing: over
    M = 1..1024 through SmolLM2's four projections the live heap grew by ~113 KB per (shape,
    projection), 83 -> 546 MB, and glibc held 1.86 GB more freed around it (RSS 254 -> 2591
    MB). Padded to these sizes RSS stopped at 440 MB and stayed there on a second pass.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)  # opaque
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        num_rows = x.shape[0]
        padded = padded_rows(num_rows)
        if padded != num_rows:
            x = F.pad(x, (0, 0, 0, padded - num_rows))
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")[
            :num_rows
        ]

    def layer_operands(self) -> tuple[str, tuple]:  # (dense_layer.cpp pads rows as above)
        return "dense", (self.weight, self.bias)


class DynamicInt8(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = pack_int8(weight, None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_int8(x, self.weight)


class DenseHead(Dense):
    """An LM head's dense weight (the embedding's own Parameter when tied), with oneDNN's
    packed copy beside it once packed: the copy from two rows on; at one row MKL's gemv, which
    is faster there depends on the head's shape and the CPU (bench.choices measures both)."""

    def __init__(self, weight: nn.Parameter | torch.Tensor):
        super().__init__(weight, None)
        if isinstance(weight, nn.Parameter):  # shared with the embedding (tied)
            self.weight = weight
        self.copy: Packed | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy is not None and x.shape[0] > 1:
            return self.copy(x)
        return F.linear(x, self.weight)

    def packed(self) -> DenseHead:
        self.copy = Packed(self.weight.detach(), None)
        return self


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
        self.format: nn.Module | None = None  # Dense, Packed, DynamicInt8, QuantizedLinear

    def load(self, weight, bias: torch.Tensor | None, device, dtype: torch.dtype) -> None:
        """The whole layer's weight ([out, in] floats, a QuantizedWeight or QuantizedRows)
        and bias; this rank keeps its share, in the form the weight came in."""
        if (bias is not None) != self.has_bias:
            raise ValueError(f"a bias was {'not ' * self.has_bias}expected")
        weight, bias = self._share(weight, bias)
        if bias is not None:
            bias = bias.to(device=device, dtype=dtype)
        if isinstance(weight, QUANTIZED):
            self.format = QuantizedLinear(weight, bias, device, dtype)
        else:
            self.format = Dense(weight.to(device=device, dtype=dtype), bias)

    def _share(self, weight, bias):
        p, quantized = self.parallel, isinstance(weight, QUANTIZED)
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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: int) -> torch.Tensor:
    """x: [N, H, D]; cos/sin: [N, 1, D]. HF's rotate-half convention over the first `rotary`
    dims; the rest pass through (their cos is 1 and sin 0: x * 1 + y * 0 is x exactly)."""
    half = rotary // 2
    rotated = torch.cat((-x[..., half:rotary], x[..., :half], x[..., rotary:]), dim=-1)
    return x * cos + rotated * sin


SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3", "yarn", "longrope"}


def rope_parameters(hf_config, head_dim: int, context: int, layer_type: str | None = None):
    """inv_freq [rotary dims / 2] and the cos/sin scaling, via transformers' own RoPE functions;
    layer_type: a model whose layer types have RoPE parameters of their own (Gemma 3).

    LongRoPE (Phi-3) has two sets of factors, and HF picks per forward call by its length (long
    past original_max_position_embeddings); a paged cache needs one rotation per position for
    good, so the engine's context decides as in vLLM and llama.cpp: the long factors when
    `context` exceeds the original context, else the short ones (HF's choice for any sequence
    that fits in it)."""
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
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    if rope_type == "longrope":
        kwargs["seq_len"] = context
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", **kwargs)
    return inv_freq.float(), float(scaling)


class RotaryTables(nn.Module):
    """cos and sin of positions ([N] -> [N, 1, D]) from inv_freq [R / 2]: the first R columns
    rotate, the rest (partial rotary, R < D) have cos 1 and sin 0. `place` says where they come
    from: on CPU in float32 with the C++ kernels, each step's rows computed from their positions
    (kernels/cpu/rotary.cpp: no table, whose D x max_len x 8 bytes were Gemma 3 270M's largest
    part after its embedding); elsewhere tables of every position up to max_len in the model's
    dtype. `of` builds the model's: max_position_embeddings positions, for an engine whose
    context is `context` (LongRoPE's choice)."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_len: int, head_dim: int):
        super().__init__()
        self.inv_freq, self.scaling = inv_freq.float(), scaling  # [R / 2] (not cast by .to)
        self.max_len, self.head_dim = max_len, head_dim
        self.register_buffer("cos", None, persistent=False)  # [max_len, D] once placed
        self.register_buffer("sin", None, persistent=False)

    @classmethod
    def of(cls, hf_config, head_dim: int, context: int, layer_type: str | None = None):
        inv_freq, scaling = rope_parameters(hf_config, head_dim, context, layer_type)
        return cls(inv_freq, scaling, hf_config.max_position_embeddings, head_dim)

    def place(self, device: torch.device, dtype: torch.dtype) -> None:
        """Tables on `device` in `dtype` (as HF casts cos and sin to the activations' dtype),
        or none where the C++ kernels compute the rows."""
        from engine.models.quantized import tandem_kernel_available

        if device.type == "cpu" and dtype == torch.float32 and tandem_kernel_available():
            self.cos = self.sin = None
            return
        freqs = torch.arange(self.max_len, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, R]
        rest = self.head_dim - emb.shape[1]
        cos = torch.cat((emb.cos() * self.scaling, torch.ones(self.max_len, rest)), dim=-1)
        sin = torch.cat((emb.sin() * self.scaling, torch.zeros(self.max_len, rest)), dim=-1)
        self.cos, self.sin = cos.to(device, dtype), sin.to(device, dtype)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos is None:  # [N, 1, D] each
            ops = torch.ops.tandem_cpu
            return ops.rope_rows(positions, self.inv_freq, self.scaling, self.head_dim)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


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
        self.rotary_dim = cfg.rotary_dim or d  # the rotated dims of each head
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
        kv_cache: torch.Tensor,  # [2, Hkv, num_blocks, block_size, D] (int8: a (K, V) pair)
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:  # [N, hidden], this rank's heads' share reduced
        qkv = self.qkv_proj(h, lora)  # [N, q + 2 kv]
        if isinstance(meta, RowAttention):
            return self.o_proj(self._rows(qkv, cos, sin, kv_cache, meta), lora)
        n = h.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin, self.rotary_dim), apply_rope(k, cos, sin, self.rotary_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if isinstance(meta, dict):  # layers with windows of their own: a layout each
            meta = meta[self.window or None]
        attn = meta.attend(q, k, v, kv_cache[0], kv_cache[1], self.scale)
        return self.o_proj(attn.reshape(n, self.q_size), lora)

    def _rows(self, qkv, cos, sin, kv_cache, meta: RowAttention) -> torch.Tensor:  # [N, q]
        """The C++ pieces: RoPE (and head norms) with the store into the cache, attention."""
        ops = torch.ops.tandem_cpu
        ops.rope_store(
            qkv, cos, sin, kv_cache[0], kv_cache[1], meta.slot_mapping, self.num_heads,
            self.num_kv_heads, *self.head_norms(), self.rotary_dim,
        )  # fmt: skip
        return ops.attend(
            qkv, kv_cache[0], kv_cache[1], meta.block_tables, meta.row_tables, meta.seq_lens,
            self.num_heads, self.num_kv_heads, self.head_dim, self.scale, self.window,
        )  # fmt: skip


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


def projections(attn: Attention, mlp: GatedMLP) -> tuple[Linear, ...]:
    """A decoder layer's four projections, in the order the C++ layer takes them."""
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def on_tandem_kernel(linears) -> bool:
    """Whether every one of these projections runs on the C++ quantized kernel (CPU)."""
    return all(isinstance(m.format, QuantizedLinear) and m.format.backend == "tandem"
               for m in linears)  # fmt: skip


def layer_call(linears, dense: bool = True) -> tuple | None:
    """The one C++ call that runs a decoder layer over its four projections (qkv, o, gate_up,
    down), and the operands their weight formats give it: fused_layer over the quantized
    kernel's tiles (each projection's segments: (codes, scales, offsets) each, their widths
    and rows, and how many a projection has; no MLP bias), dense_layer over CPU float32
    weights, plain or oneDNN-packed (any biases; dense=False: none, as under the Triton
    backend, whose kernels attend dense layers' rows). None where the formats share no such
    call or the C++ kernels cannot run."""
    formats = [m.format for m in linears]
    if on_tandem_kernel(linears):
        if formats[2].bias is not None:
            return None
        weights, bits, rows = segment_operands([s for f in formats for s in f.segments])
        parts = [len(f.segments) for f in formats]
        return torch.ops.tandem_cpu.fused_layer, (weights, bits, rows, parts, formats[0].bias)
    operands = [getattr(f, "layer_operands", lambda: None)() for f in formats]
    if not dense or any(o is None or o[0] != "dense" for o in operands):
        return None
    from kernels import cpu  # (built on first use, as for the quantized layers)

    if cpu.load() is None:
        return None
    weights, biases = zip(*(o[1] for o in operands), strict=True)
    return torch.ops.tandem_cpu.dense_layer, (list(weights), list(biases))


class LayerOperands(NamedTuple):
    """A decoder layer's operands for its one C++ call besides inputs and projections: the
    norms' weights (None: none; one eps for all), the attention's heads, scale and window, the
    per-head norms, the rotary dims, and the MLP's activation (GELU or SiLU)."""

    pre_attn: torch.Tensor
    pre_mlp: torch.Tensor
    post_attn: torch.Tensor | None
    post_mlp: torch.Tensor | None
    eps: float
    num_heads: int
    num_kv_heads: int
    scale: float
    window: int
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    head_eps: float
    rotary_dim: int
    gelu: bool


class DecoderLayer(nn.Module):
    """The pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)). A layer whose
    projections' formats have a C++ layer (layer_call: the quantized kernel's, or CPU float32
    weights) runs a step without adapters as one C++ call (kernels/cpu/fused_layer.cpp,
    dense_layer.cpp), the same numbers as its pieces composed here; a step with adapters
    composes those pieces around the adapters' products. Subclasses with norms of their own
    (Gemma 3) say which through `norms`."""

    def __init__(self, cfg: ModelConfig, index: int, parallel: Parallel):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, index, parallel)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg, index, parallel)
        self.whole = parallel.world == 1  # a tensor-parallel layer sums between its halves
        self.fused: tuple | None = None  # (the C++ layer op, its weight operands): layer_call

    def norms(self) -> tuple[RMSNorm, RMSNorm, RMSNorm | None, RMSNorm | None]:
        """As the C++ layer takes them: before attention, before the MLP, and of attention's
        and the MLP's outputs before their residual sums (None: none); one eps for all."""
        return self.input_layernorm, self.post_attention_layernorm, None, None

    def fuse(self, dense: bool = True) -> bool:
        """Whether every row can run on the C++ kernels (see layer_call)."""
        self.fused = layer_call(projections(self.self_attn, self.mlp), dense)
        return self.fused is not None

    def one_call(self, meta: AttentionMetadata, lora: LoRABatch | None) -> bool:
        """Whether this step runs the layer as its one C++ call: rows on the C++ kernels, no
        adapter rows, no tensor-parallel sum between the halves."""
        rows = isinstance(meta, RowAttention)
        return rows and lora is None and self.whole and self.fused is not None

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden]
        cos: torch.Tensor,  # [N, 1, D]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, Hkv, num_blocks, block_size, D] (int8: a (K, V) pair)
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,  # per-row adapters, when any row has one
    ) -> torch.Tensor:
        if self.one_call(meta, lora):
            return self._fused(x, cos, sin, kv_cache, meta)
        rows = isinstance(meta, RowAttention)  # the C++ kernels' numerics
        h = self.input_layernorm(x, rows)
        x = x + self.self_attn(h, cos, sin, kv_cache, meta, lora)
        return x + self.mlp(self.post_attention_layernorm(x, rows), rows, lora)

    def operands(self) -> LayerOperands:
        """What the layer's one C++ call takes besides its inputs and weights (the layer stack
        reads them here too)."""
        attn = self.self_attn
        pre_attn, pre_mlp, post_attn, post_mlp = (None if n is None else n.weight
                                                  for n in self.norms())  # fmt: skip
        return LayerOperands(
            pre_attn, pre_mlp, post_attn, post_mlp, self.input_layernorm.eps, attn.num_heads,
            attn.num_kv_heads, attn.scale, attn.window, *attn.head_norms(), attn.rotary_dim,
            self.mlp.gelu,
        )  # fmt: skip

    def _fused(self, x, cos, sin, kv_cache, meta: RowAttention) -> torch.Tensor:  # x updated
        op, weights = self.fused
        o = self.operands()
        op(
            x, *weights, o.pre_attn, o.pre_mlp, o.eps, cos, sin, kv_cache[0], kv_cache[1],
            meta.slot_mapping, meta.block_tables, meta.row_tables, meta.seq_lens, o.num_heads,
            o.num_kv_heads, o.scale, o.window, o.q_norm, o.k_norm, o.head_eps, o.rotary_dim,
            o.post_attn, o.post_mlp, o.gelu,
        )  # fmt: skip
        return x

"""The Llama family (Llama, Mistral, Qwen2) in plain PyTorch over a paged KV cache.

Q/K/V and gate/up are fused into one matmul each (fewer, larger GEMMs on CPU); the loader
concatenates the HF weights. Qwen2 differs only by a bias on the QKV projection and an untied
LM head, Mistral by an optional sliding window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, RowAttention
from engine.models.config import ModelConfig
from engine.models.quant import linear_int8, pack_int8
from engine.models.quantized import QuantizedEmbedding, QuantizedLinear, QuantizedWeight

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


def packed_linear(
    x: torch.Tensor,  # [M, in]
    packed: torch.Tensor,  # oneDNN's blocked [out, in]
    bias: torch.Tensor | None,
) -> torch.Tensor:  # [M, out]
    """oneDNN's GEMM over x's rows padded to padded_rows(M).

    oneDNN builds and keeps state for every input shape it sees (primitives, JIT code,
    buffers), so a server whose steps keep bringing new row counts keeps growing: over
    M = 1..1024 through SmolLM2's four projections the live heap grew by ~113 KB per (shape,
    projection), 83 -> 546 MB, and glibc held 1.86 GB more freed around it (RSS 254 -> 2591
    MB). Padded to these sizes RSS stopped at 440 MB and stayed there on a second pass.
    """
    num_rows = x.shape[0]
    padded = padded_rows(num_rows)
    if padded != num_rows:
        x = F.pad(x, (0, 0, 0, padded - num_rows))
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:num_rows]


class Linear(nn.Module):
    """y = x W^T + b, with W stored [out, in] as in HF checkpoints.

    On CPU, `pack()` swaps the dense weight for oneDNN's blocked copy (the same bytes; the dense
    one is dropped). MKL's sgemm is slow at the small row counts of decode, where oneDNN's
    packed GEMM is well ahead (bench.choices; bench/RESULTS.md "Measurements behind the core's
    choices"); at one row and at a few hundred they are about even.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.packed: torch.Tensor | None = None  # oneDNN opaque tensor once packed
        self.int8: torch.Tensor | None = None  # int8 packed parameters (draft models)
        self.quantized: QuantizedLinear | None = None  # weight-only (engine.models.quantized)

    def pack(self) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        self.weight = None

    def quantize(self) -> None:
        self.int8 = pack_int8(self.weight, self.bias)
        self.weight = self.bias = None

    def set_quantized(self, weight: QuantizedWeight, device, dtype: torch.dtype) -> None:
        bias = None if self.bias is None else self.bias.detach()
        self.quantized = QuantizedLinear(weight, bias, device, dtype)
        self.weight = self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized(x)
        if self.int8 is not None:
            return linear_int8(x, self.int8)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """In float32 whatever x's dtype (as HF), the weight applied in x's dtype."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, H, D]; cos/sin: [N, 1, D]. HF's rotate-half convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.index = index  # position in the stack (LoRA weights are per layer)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias)
        self.sliding_window = cfg.sliding_window or 0
        self.fused: tuple | None = None  # fuse()'s arguments for kernels/cpu/fused_layer.cpp
        # Tensor parallelism (engine.distributed.tensor_parallel): sums o_proj's and down_proj's
        # partial products over the ranks, in place; None on one rank.
        self.all_reduce = None

    def fuse(self) -> bool:
        """Run every row on the C++ kernels (kernels/cpu/fused_layer.cpp): possible when every
        projection is on the tandem kernel (CPU) and the MLP has no bias. A step without
        adapters on a whole layer is then one C++ call; with adapters or a tensor-parallel sum
        between the halves, the same C++ pieces are composed here around them."""
        linears = (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj)
        layers = [m.quantized for m in linears]
        tandem = all(q is not None and q.backend == "tandem" for q in layers)
        if not tandem or layers[2].bias is not None:
            self.fused = None
            return False
        weights = [t for q in layers for t in (q.codes, q.scales, q.offsets)]
        sizes = [q.out_features for q in layers]
        self.fused = (weights, [q.bits for q in layers], sizes, layers[0].bias)
        return True

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden]
        cos: torch.Tensor,  # [N, 1, D]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, Hkv, num_blocks, block_size, D]
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,  # per-row adapters, when any row has one
    ) -> torch.Tensor:
        if isinstance(meta, RowAttention):  # the C++ kernels (kernels/cpu/fused_layer.cpp)
            if lora is None and self.all_reduce is None:
                return self._fused(x, cos, sin, kv_cache, meta)
            return self._composed(x, cos, sin, kv_cache, meta, lora)
        n = x.shape[0]
        h = self.input_layernorm(x)
        qkv = self._project(self.qkv_proj, "qkv", h, lora)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        attn = meta.attend(q, k, v, kv_cache[0], kv_cache[1], self.scale)
        x = x + self._reduced(self._project(self.o_proj, "o", attn.reshape(n, self.q_size), lora))
        h = self.post_attention_layernorm(x)
        gate, up = self._project(self.gate_up_proj, "gate_up", h, lora).chunk(2, dim=-1)
        return x + self._reduced(self._project(self.down_proj, "down", F.silu(gate) * up, lora))

    def _reduced(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.all_reduce is None else self.all_reduce(partial)

    def _fused(self, x, cos, sin, kv_cache, meta: RowAttention) -> torch.Tensor:  # x updated
        weights, bits, sizes, qkv_bias = self.fused
        torch.ops.tandem_cpu.fused_layer(
            x, weights, bits, sizes, qkv_bias, self.input_layernorm.weight,
            self.post_attention_layernorm.weight, self.input_layernorm.eps, cos, sin,
            kv_cache[0], kv_cache[1], meta.slot_mapping, meta.block_tables, meta.row_tables,
            meta.seq_lens, self.num_heads, self.num_kv_heads, self.scale, self.sliding_window,
        )  # fmt: skip
        return x

    def _composed(self, x, cos, sin, kv_cache, meta: RowAttention, lora) -> torch.Tensor:
        """fused_layer's steps one op at a time, adapters added to the projections' rows that
        have one and tensor-parallel partial sums reduced: every other number is the fused
        call's, bit for bit."""
        ops = torch.ops.tandem_cpu
        h = ops.rms_norm(x, self.input_layernorm.weight, self.input_layernorm.eps)
        qkv = self._project(self.qkv_proj, "qkv", h, lora)  # [N, q + 2 kv]
        ops.rope_store(
            qkv, cos, sin, kv_cache[0], kv_cache[1], meta.slot_mapping, self.num_heads,
            self.num_kv_heads,
        )  # fmt: skip
        attn = ops.attend(
            qkv, kv_cache[0], kv_cache[1], meta.block_tables, meta.row_tables, meta.seq_lens,
            self.num_heads, self.num_kv_heads, self.head_dim, self.scale, self.sliding_window,
        )  # fmt: skip
        x = x + self._reduced(self._project(self.o_proj, "o", attn, lora))
        h = ops.rms_norm(x, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        act = ops.silu_mul(self._project(self.gate_up_proj, "gate_up", h, lora))
        return x + self._reduced(self._project(self.down_proj, "down", act, lora))

    def _project(self, linear: Linear, group: str, x: torch.Tensor, lora) -> torch.Tensor:
        y = linear(x)
        if lora is not None:
            lora.apply(self.index, group, x, y)
        return y


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, inv_freq: torch.Tensor, rope_scaling: float, max_len: int):
        super().__init__()
        self.config = cfg
        # _weight: no random init (the loader overwrites it or drops it for a quantized copy)
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.embed_quantized: QuantizedEmbedding | None = None
        self.lm_head_quantized: QuantizedLinear | None = None
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.fused_layers = False  # every layer runs on the C++ kernels (fuse)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # [vocab, hidden], shared with the embedding when tied; F.linear reads it as is.
        self.lm_head_packed: torch.Tensor | None = None  # oneDNN copy for more than one row
        self.lm_head_int8: torch.Tensor | None = None  # int8 copy (draft models)
        # The head's rows (a dense head is checked to this shape on load; a GGUF loader records
        # its file's). Tensor parallelism: this rank's head holds some of them, and
        # gather_logits puts the ranks' logits side by side (engine.distributed.tensor_parallel).
        self.lm_head_rows = cfg.vocab_size
        self.gather_logits = None
        self.lm_head_weight = (
            self.embed_tokens.weight
            if cfg.tie_word_embeddings
            else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        )
        # cos/sin for every position up to max_len: [max_len, D]
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos() * rope_scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * rope_scaling, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N]
        kv_caches: torch.Tensor,  # [num_layers, 2, Hkv, num_blocks, block_size, D]
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:  # [N, hidden]
        if self.embed_quantized is not None:
            x = self.embed_quantized(input_ids)
        else:
            x = self.embed_tokens(input_ids)
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_caches[i], meta, lora)
        if isinstance(meta, RowAttention):  # the layers' own norm: rows on one numerics
            return torch.ops.tandem_cpu.rms_norm(x, self.norm.weight, self.norm.eps)
        return self.norm(x)

    def pack_linear_weights(self) -> None:
        """CPU only: every projection to oneDNN's packed layout (see Linear). The LM head gets a
        packed copy next to its dense weight (the embedding when tied): oneDNN's packed GEMM is
        far ahead from two rows on; at one row MKL's gemv serves, and which of the two is faster
        there depends on the head's shape and the CPU (bench.choices measures both sides)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        self.lm_head_packed = torch.ops.mkldnn._reorder_linear_weight(
            self.lm_head_weight.detach(), None
        )

    def quantize_int8(self) -> None:
        """CPU only, draft models only: int8 projections and LM head (see engine.models.quant);
        down_proj stays fp32 (oneDNN packed), as does the embedding."""
        for layer in self.layers:
            for module in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj):
                module.quantize()
            if onednn_linear_available():
                layer.down_proj.pack()
        self.lm_head_int8 = pack_int8(self.lm_head_weight, None)

    def set_quantized_embeddings(
        self, embed: QuantizedWeight, lm_head: QuantizedWeight, device, dtype: torch.dtype
    ) -> None:
        """Quantized token embedding and LM head (the same weight when tied): the dense
        tensors are dropped."""
        self.embed_quantized = QuantizedEmbedding(embed, device, dtype)
        # The tandem kernel gives a row the same logits at any row count (quant_matmul.cpp).
        self.lm_head_quantized = QuantizedLinear(lm_head, None, device, dtype)
        self.embed_tokens.weight = None
        self.lm_head_weight = None

    def quantize(self, bits: int) -> None:
        """Weight-only quantization of a dense checkpoint: every projection to `bits` (4 or 8)
        per 32 input values; the embedding and LM head to 8 bits (their precision moves the
        logits most, as llama.cpp keeps its output tensor wider)."""
        device, dtype = self.norm.weight.device, self.norm.weight.dtype
        for module in self.modules():
            if isinstance(module, Linear):
                module.set_quantized(QuantizedWeight.quantize(module.weight, bits), device, dtype)
        embed = QuantizedWeight.quantize(self.embed_tokens.weight, 8)
        head = embed
        if self.lm_head_weight is not self.embed_tokens.weight:  # untied, or split by vocab
            head = QuantizedWeight.quantize(self.lm_head_weight, 8)
        self.set_quantized_embeddings(embed, head, device, dtype)

    def fuse(self) -> bool:
        """Every row through the C++ kernels where every layer can (float32, quantized
        projections on the tandem kernel): see DecoderLayer.fuse."""
        fp32 = self.norm.weight.dtype == torch.float32
        self.fused_layers = fp32 and all([layer.fuse() for layer in self.layers])
        return self.fused_layers

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [M, vocab]
        logits = self._head(hidden)  # [M, this rank's vocabulary rows]
        return logits if self.gather_logits is None else self.gather_logits(logits)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_quantized is not None:
            return self.lm_head_quantized(hidden)
        if self.lm_head_int8 is not None:
            return linear_int8(hidden, self.lm_head_int8)
        if self.lm_head_packed is not None and hidden.shape[0] > 1:
            return packed_linear(hidden, self.lm_head_packed, None)
        return F.linear(hidden, self.lm_head_weight)

"""What every architecture's model shares: the token embedding, a stack of the architecture's
decoder layers, the final norm and the LM head over a paged KV cache, and the load-time
choices of weight format that apply to all of them (pack, int8 drafts, weight-only
quantization, the C++ layers)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention import AttentionMetadata, RowAttention
from engine.models.config import ModelConfig
from engine.models.layer_stack import LayerStack
from engine.models.layers import (
    Embedding,
    Linear,
    LMHead,
    RMSNorm,
    RotaryTables,
    onednn_linear_available,
)
from engine.models.parallel import ONE_RANK, Parallel
from engine.models.quantized import QuantizedEmbedding, QuantizedLinear, QuantizedWeight

if TYPE_CHECKING:
    from lora.batch import LoRABatch


class CausalLM(nn.Module):
    """layers: the architecture's decoder layers, each called as
    layer(x, cos, sin, kv_cache, meta, lora) -> x, and answering fuse() (whether its rows can
    run on the C++ kernels); rotary: RoPE tables by name, a layer's `rope` naming its own
    (default "global"). Its submodules load by name (`load_weight`)."""

    def __init__(
        self,
        cfg: ModelConfig,
        layers: list[nn.Module],
        rotary: RotaryTables | dict[str, RotaryTables],
        parallel: Parallel = ONE_RANK,
    ):
        super().__init__()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = LMHead(parallel)
        self.rotary = nn.ModuleDict(rotary if isinstance(rotary, dict) else {"global": rotary})
        # (a float32 tensor, as HF multiplies Gemma's embedding rows)
        self.register_buffer(
            "embed_scale",
            None if cfg.embed_scale is None else torch.tensor(cfg.embed_scale),
            persistent=False,
        )
        self.fused_layers = False  # every layer runs on the C++ kernels (fuse)
        self.stack: LayerStack | None = None  # ... as one call, where they are quantized

    def forward(
        self,
        input_ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N]
        kv_caches,  # [num_layers, 2, Hkv, num_blocks, block_size, D] (int8: kv_cache.Int8Caches)
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:  # [N, hidden]
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale.to(x.dtype)
        tables = {name: rotary(positions) for name, rotary in self.rotary.items()}  # cos, sin
        if self.stack is not None and self.stack.runs(meta, lora):
            x = self.stack(x, tables, kv_caches, meta)
        else:
            for i, layer in enumerate(self.layers):
                x = layer(x, *tables[getattr(layer, "rope", "global")], kv_caches[i], meta, lora)
        return self.norm(x, rows=isinstance(meta, RowAttention))

    def load_weight(self, name: str, *tensors, device, dtype: torch.dtype) -> None:
        """The submodule `name` (a Linear, a norm, the embedding or the head) loads tensors
        (a tied head: the embedding's own weight, None)."""
        if name == "lm_head" and tensors[0] is None:  # tied to a dense embedding
            tensors = (self.embed_tokens.format.weight,)
        self.get_submodule(name).load(*tensors, device=device, dtype=dtype)
        if name == "embed_tokens":
            self._embedding = tensors[0]  # (until the head loads: tied if it is the same)
        elif name == "lm_head" and tensors[0] is getattr(self, "_embedding", None):
            self._tie_quantized(dtype)
        if name == "lm_head":
            self._embedding = None

    def _tie_quantized(self, dtype: torch.dtype) -> None:
        """A quantized embedding tied to a whole LM head on the C++ kernel reads the head's
        tiles (one copy of the table, as in the file)."""
        head, whole = self.lm_head.format, self.lm_head.parallel.world == 1
        if whole and isinstance(head, QuantizedLinear) and head.backend == "tandem":
            self.embed_tokens.format = QuantizedEmbedding.from_head(head, dtype)

    def linears(self) -> list[tuple[str, Linear]]:
        return [(n, m) for n, m in self.named_modules() if isinstance(m, Linear)]

    def check_loaded(self) -> None:
        missing = [n for n, m in self.named_modules() if hasattr(m, "format") and m.format is None]
        if missing:
            raise ValueError(f"weights do not match the model: missing {missing[:5]}")

    def pack_linear_weights(self) -> None:
        """CPU float32: every projection and the LM head to oneDNN's packed layout
        (engine.models.layers)."""
        for _, linear in self.linears():
            linear.pack()
        self.lm_head.pack()

    def quantize_int8(self) -> None:
        """CPU float32, draft models only: int8 projections and LM head (engine.models.quant);
        down_proj, whose input has the largest outliers, stays float32 (oneDNN packed)."""
        for name, linear in self.linears():
            if not name.endswith("down_proj"):
                linear.dynamic_int8()
            elif onednn_linear_available():
                linear.pack()
        self.lm_head.dynamic_int8()

    def quantize(self, bits: int) -> None:
        """Weight-only quantization of a dense checkpoint: every projection to `bits` (4 or 8)
        per 32 inputs; the embedding and LM head to 8 bits (their precision moves the logits
        most, as llama.cpp keeps its output tensor wider)."""
        for _, linear in self.linears():
            linear.quantize(bits)
        dense = self.embed_tokens.format.weight
        embed = QuantizedWeight.quantize(dense, 8)
        tied = self.lm_head.format.weight is dense  # (a split head is a copy of its rows)
        self.embed_tokens.load(embed, dense.device, dense.dtype)
        self.lm_head.quantize(8, embed if tied else None)
        if tied:
            self._tie_quantized(dense.dtype)

    def fuse(self, dense: bool = True) -> bool:
        """Every row through the C++ kernels where every layer can (float32, projections on
        the tandem kernel or dense on CPU; dense=False: not dense ones): see the layers'
        fuse."""
        fp32 = self.norm.weight.dtype == torch.float32
        self.fused_layers = fp32 and all([layer.fuse(dense) for layer in self.layers])
        layers, ropes = list(self.layers), list(self.rotary)
        self.stack = LayerStack.of(layers, ropes) if self.fused_layers else None
        if self.stack is not None:
            self.stack.set_ends(self)
        return self.fused_layers

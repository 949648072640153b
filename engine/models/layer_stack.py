"""A model's decoder layers as one C++ call (kernels/cpu/fused_layer.cpp, LayerStack).

At batch 1 a small model's decode step is a few dozen layers of a few hundred microseconds
each; called one by one from Python, each layer's module attributes and ~27 arguments cost
~50 us, serial with the other threads (SmolLM2 at 1 thread: 2 of 15 ms a token). The stack
takes every layer's operands once and runs the same fused_layer over them in order, so a row
gets the bits of the layer-by-layer calls; it runs a step only where every layer would be its
one C++ call (rows, no adapters, no tensor-parallel sums).
"""

from __future__ import annotations

import torch

from engine.attention import RowAttention
from engine.models.kv_cache import Int8Caches

_NONE = torch.empty(0)  # the C++ stack's "no tensor" (an optional it cannot be handed)


class LayerStack:
    """layers' operands in the C++ LayerStack; ropes: the model's RoPE table names, in the
    order a step's (cos, sin) tables are handed over."""

    def __init__(self, layers, ropes: list[str]):
        weights, bits, sizes, tensors, windows, rope_of = [], [], [], [], [], []
        shared = None
        for layer in layers:
            _, (w, b, s, qkv_bias) = layer.fused
            attn = layer.self_attn
            n1, n2, p1, p2 = (None if n is None else n.weight for n in layer.norms())
            q_norm, k_norm, head_eps = attn.head_norms()
            weights += w
            bits += b
            sizes += s
            tensors += [t if t is not None else _NONE
                        for t in (n1, n2, qkv_bias, q_norm, k_norm, p1, p2)]  # fmt: skip
            windows.append(attn.window)
            rope_of.append(ropes.index(getattr(layer, "rope", "global")))
            mine = (layer.input_layernorm.eps, attn.num_heads, attn.num_kv_heads, attn.scale,
                    head_eps, attn.rotary_dim, layer.mlp.gelu)  # fmt: skip
            if shared not in (None, mine):
                raise ValueError("the layers of a stack share their heads, eps and activation")
            shared = mine
        self.ropes = ropes
        self.op = torch.classes.tandem_cpu.LayerStack(
            weights, bits, sizes, tensors, windows, rope_of, *shared
        )
        self.num_layers = len(layers)

    @classmethod
    def of(cls, layers, ropes: list[str]) -> LayerStack | None:
        """A stack of these layers where each is one fused_layer call (quantized projections
        on the C++ kernel, the whole layer on this rank); None otherwise."""
        if not layers or not all(
            layer.whole
            and layer.fused is not None
            and layer.fused[0] is torch.ops.tandem_cpu.fused_layer
            for layer in layers
        ):
            return None
        return cls(layers, ropes)

    def runs(self, meta, lora) -> bool:
        """Whether this step's rows take the stack (the layers' one_call, for all of them)."""
        return isinstance(meta, RowAttention) and lora is None

    def __call__(
        self,
        x: torch.Tensor,  # [N, hidden], updated in place
        tables: dict[str, tuple[torch.Tensor, torch.Tensor]],  # RoPE name: cos, sin [N, 1, D]
        kv_caches,  # [num_layers, 2, Hkv, num_blocks, block_size, D] or Int8Caches
        meta: RowAttention,
    ) -> torch.Tensor:
        if isinstance(kv_caches, Int8Caches):
            k, v = kv_caches.k, kv_caches.v
        else:
            k, v = kv_caches[:, 0], kv_caches[:, 1]
        cos, sin = zip(*(tables[name] for name in self.ropes), strict=True)
        self.op.forward(
            x, list(cos), list(sin), k, v, meta.slot_mapping, meta.block_tables,
            meta.row_tables, meta.seq_lens,
        )  # fmt: skip
        return x

"""A model's decoder layers as one C++ call (kernels/cpu/fused_layer.cpp, LayerStack).

At batch 1 a small model's decode step is a few dozen layers of a few hundred microseconds
each; called one by one from Python, each layer's module attributes and ~27 arguments cost
~50 us, serial with the other threads (SmolLM2 at 1 thread: 2 of 15 ms a token). The stack
takes every layer's operands once and runs the same fused_layer over them in order, so a row
gets the bits of the layer-by-layer calls; it runs a step only where every layer would be its
one C++ call (rows, no adapters, no tensor-parallel sums).

Where the model's ends are the C++ kernel's too (a quantized embedding and LM head, RoPE
computed per row), the stack holds them (`set_ends`) and `decode` runs greedy single rows from
their last token to their next one, embedding to argmax, for one step or several in a row
(lookahead, EngineConfig.num_scheduler_steps), with the bits of those steps run one by one:
the Python around a step of single rows (the embedding, RoPE tables, final norm, head and
argmax calls) cost ~0.8 ms a token on SmolLM2 at 1 thread.
"""

from __future__ import annotations

import torch

from engine.attention import RowAttention
from engine.models.kv_cache import Int8Caches
from engine.models.quantized import QuantizedLinear

_NONE = torch.empty(0)  # the C++ stack's "no tensor" (an optional it cannot be handed)


class LayerStack:
    """layers' operands in the C++ LayerStack; ropes: the model's RoPE table names, in the
    order a step's (cos, sin) tables are handed over."""

    def __init__(self, layers, ropes: list[str]):
        weights, bits, sizes, parts, tensors, windows, rope_of = [], [], [], [], [], [], []
        shared = None
        for layer in layers:
            _, (w, b, s, p, qkv_bias) = layer.fused
            o = layer.operands()
            weights += w
            bits += b
            sizes += s
            parts += p
            tensors += [
                t if t is not None else _NONE
                for t in (o.pre_attn, o.pre_mlp, qkv_bias, o.q_norm, o.k_norm, o.post_attn,
                          o.post_mlp)
            ]  # fmt: skip
            windows.append(o.window)
            rope_of.append(ropes.index(getattr(layer, "rope", "global")))
            mine = (o.eps, o.num_heads, o.num_kv_heads, o.scale, o.head_eps, o.rotary_dim,
                    o.gelu)  # fmt: skip
            if shared not in (None, mine):
                raise ValueError("the layers of a stack share their heads, eps and activation")
            shared = mine
        self.ropes = ropes
        self.op = torch.classes.tandem_cpu.LayerStack(
            weights, bits, sizes, parts, tensors, windows, rope_of, *shared
        )
        self.num_layers = len(layers)
        self.decodes = False  # the model's ends are in the stack too (set_ends)
        self._views = None  # (kv_caches, its K and V views)

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

    def set_ends(self, model) -> None:
        """The model's embedding, RoPE tables, final norm and LM head into the stack, where
        they are the C++ kernel's (a quantized embedding and whole head in its tiles, RoPE
        computed per row): then `decodes` (`decode` needs them)."""
        embed, head = model.embed_tokens.format, model.lm_head.format
        tables = [model.rotary[name] for name in self.ropes]
        if not (
            getattr(embed, "tiles", None) is not None
            and isinstance(head, QuantizedLinear)
            and head.backend == "tandem"
            and head.bias is None
            and model.lm_head.parallel.world == 1
            and all(t.cos is None for t in tables)
        ):
            return
        scale = model.embed_scale
        self.op.set_ends(
            list(embed.tiles[:3]), embed.tiles[3], embed.rows,
            _NONE if scale is None else scale.float(),
            [t.inv_freq for t in tables], [float(t.scaling) for t in tables],
            [t.head_dim for t in tables],
            model.norm.weight, model.norm.eps,
            [head.codes, head.scales, head.offsets], head.bits, head.out_features,
            model.config.vocab_size,
        )  # fmt: skip
        self.decodes = True

    def decode(
        self,
        ids: list[int],  # [B] each row's last token
        positions: list[int],  # [B] its position
        kv_caches,
        slots: list[int],  # [B * S] row b's step s at b S + s
        tables: list[int],  # [B * W] row b's blocks, padded with the null block
    ) -> tuple[torch.Tensor, torch.Tensor]:  # tokens, is_nan [B, S]
        """S greedy steps of B single rows in one C++ call, embedding to argmax (each step
        feeds its picks to the next): the bits of S steps through forward, the final norm, the
        LM head and argmax_rows. Plain lists in: the C++ side views them (a tensor built here
        costs ~50 us a step with the caches cold after the weights' pass)."""
        k, v = self._caches(kv_caches)
        return self.op.decode(ids, positions, k, v, slots, tables)

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
        k, v = self._caches(kv_caches)
        cos, sin = zip(*(tables[name] for name in self.ropes), strict=True)
        self.op.forward(
            x, list(cos), list(sin), k, v, meta.slot_mapping, meta.block_tables,
            meta.row_tables, meta.seq_lens,
        )  # fmt: skip
        return x

    def _caches(self, kv_caches) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V caches of every layer: [num_layers, Hkv, num_blocks, block_size, D]
        (views made once per cache tensor: two slices cost ~20 us a step)."""
        if isinstance(kv_caches, Int8Caches):
            return kv_caches.k, kv_caches.v
        if self._views is None or self._views[0] is not kv_caches:
            self._views = (kv_caches, kv_caches[:, 0], kv_caches[:, 1])
        return self._views[1:]

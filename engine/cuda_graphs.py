"""CUDA graphs for decode and verification steps (the GPU path).

A step in which every request runs between 1 and q_max query tokens (a decode token, or its last
token plus drafts) and no row has an adapter replays a graph captured at start for (padded batch
size, q), instead of launching every layer's kernels one by one from Python: at small batches a
model on a GPU is bound by those launches, not by the GPU.

Every graph reads the same static input buffers; a step copies its inputs into them, padded:
- the batch to the next captured size, with padding requests whose tokens store no KV (slot -1)
  and whose block table row is the null block 0;
- each request's tokens to the step's longest, q: a request with fewer drafts gets padding
  tokens after its own that store no KV, and its seq_len counts them, so its real queries keep
  their positions (the kernels place query j at seq_len - q + j) and causal masking keeps the
  padding keys out of their sight.
A graph writes the hidden states of every padded row into its own output; the real rows are
gathered from there.

Without capture (CPU) the same padded static-buffer forward runs eagerly: the tests check the
padding there, under Triton's interpreter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.attention import VarlenAttention
from engine.device import host_tensor, padded_rows, staged, to_device
from engine.inputs import fill_pending, flat_inputs, pending_inputs, real_rows

if TYPE_CHECKING:
    from engine.inputs import ForwardItem, SampledTokens
    from engine.models.causal_lm import CausalLM
    from engine.request import Request


def batch_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes graphs are captured at: 1, 2, 4, then every multiple of 8, and the max."""
    sizes = [b for b in (1, 2, 4, *range(8, max_num_seqs, 8)) if b < max_num_seqs]
    return [*sizes, max_num_seqs]


class GraphRunner:
    """Static input buffers and one graph per (batch size, query tokens per request)."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: torch.Tensor,  # [num_layers, 2, Hkv, num_blocks, block_size, D]
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        max_query_len: int,  # 1 + the most drafts a request verifies in one step
        windows: tuple[int | None, ...],  # the layers' attention windows (ModelConfig.windows)
        capture: bool,
    ):
        device = kv_caches.device
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.windows = windows
        self.sizes = batch_sizes(max_num_seqs)
        self.max_query_len = max_query_len
        self.max_seq_len = max_model_len + max_query_len  # padding tokens may run past the end
        max_tokens = max_num_seqs * max_query_len
        max_blocks = -(-self.max_seq_len // block_size)
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(max_tokens, **long)  # [max_tokens]
        self.positions = torch.zeros(max_tokens, **long)  # [max_tokens]
        self.slot_mapping = torch.full((max_tokens,), -1, **long)  # [max_tokens]
        int32 = dict(dtype=torch.int32, device=device)
        self.seq_lens = torch.full((max_num_seqs,), max_query_len, **int32)  # [max_num_seqs]
        self.block_tables = torch.zeros(max_num_seqs, max_blocks, **int32)
        # Request b's queries are rows [b * q, (b + 1) * q): one [max_num_seqs + 1] per q.
        self.query_start_loc = {
            q: torch.arange(max_num_seqs + 1, **int32) * q for q in range(1, max_query_len + 1)
        }
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0  # steps served from the static buffers (graphs or, on CPU, eager)
        if capture:
            self.capture()

    def fits(self, items: list[ForwardItem]) -> bool:
        return 0 < len(items) <= self.sizes[-1] and all(
            0 < len(it.token_ids) <= self.max_query_len
            and it.start + self.max_query_len <= self.max_seq_len
            for it in items
        )

    def forward(
        self,
        items: list[ForwardItem],
        tables: dict[Request, list[int]],
        sampled: SampledTokens | None = None,  # the previous step's tokens (async scheduling)
    ) -> torch.Tensor:  # [sum(len(item.token_ids)), hidden]
        q = max(len(it.token_ids) for it in items)
        num_reqs = next(b for b in self.sizes if b >= len(items))
        rows = self._fill(items, tables, q, num_reqs)
        fill_pending(self.input_ids, pending_inputs(items, q), sampled)
        graph = self.graphs.get((num_reqs, q))
        if graph is not None:
            graph[0].replay()
            out = graph[1]
        else:
            out = self._run(num_reqs, q)
        self.num_replays += 1
        if rows is None:  # the real rows are a prefix
            return out[: sum(len(it.token_ids) for it in items)].clone()
        return out.index_select(0, to_device(rows, out.device))

    def _fill(self, items, tables, q: int, num_reqs: int) -> torch.Tensor | None:
        """Copies the padded step into the static buffers; returns the real rows' indices
        (None when every request has q tokens: then they are the first rows)."""
        bs, num_tokens = self.block_size, num_reqs * q
        flat = flat_inputs(items, tables, bs, q, num_reqs)
        width = max(-(-n // bs) for n in flat.seq_lens)
        block_tables = padded_rows(flat.tables, width, num_reqs)
        device, copy = self.input_ids.device, dict(non_blocking=True)
        self.input_ids[:num_tokens].copy_(staged(host_tensor(flat.input_ids), device), **copy)
        self.positions[:num_tokens].copy_(staged(host_tensor(flat.positions), device), **copy)
        self.slot_mapping[:num_tokens].copy_(staged(host_tensor(flat.slots), device), **copy)
        seq_lens = host_tensor(flat.seq_lens, torch.int32)
        self.seq_lens[:num_reqs].copy_(staged(seq_lens, device), **copy)
        self.block_tables[:num_reqs, :width].copy_(staged(block_tables, device), **copy)
        if all(n == q for n in flat.query_lens):
            return None
        return host_tensor(real_rows(flat.query_lens, q))

    def _run(self, num_reqs: int, q: int) -> torch.Tensor:  # [num_reqs * q, hidden]
        num_tokens = num_reqs * q
        buffers = (
            self.slot_mapping[:num_tokens],
            self.query_start_loc[q][: num_reqs + 1],
            self.seq_lens[:num_reqs],
            self.block_tables[:num_reqs],
            q,
        )
        # As Backend.metadata: one layout, or one per window when the layers' windows differ.
        metas = {w: VarlenAttention(*buffers, sliding_window=w) for w in self.windows}
        meta = metas if len(metas) > 1 else metas[self.windows[0]]
        return self.model(
            self.input_ids[:num_tokens], self.positions[:num_tokens], self.kv_caches, meta
        )

    def capture(self) -> None:
        """One graph per (batch size, q), largest first so that the smaller ones reuse its
        memory from the shared pool. The static inputs hold harmless values meanwhile: every
        slot -1 (nothing stored), every request q keys in the null block."""
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(self.max_query_len)
        self.block_tables.zero_()
        keys = [(b, q) for q in range(1, self.max_query_len + 1) for b in self.sizes]
        pool = None
        with torch.inference_mode():
            for num_reqs, q in sorted(keys, key=lambda k: -k[0] * k[1]):
                self._run(num_reqs, q)  # warm-up: compiles the Triton kernels for these shapes
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph, pool=pool):
                        out = self._run(num_reqs, q)
                except RuntimeError as exc:
                    raise RuntimeError(
                        f"capturing the CUDA graph for {num_reqs} requests x {q} query tokens "
                        f"failed ({exc}); enforce_eager=True (--enforce-eager) runs without "
                        "graphs"
                    ) from exc
                pool = graph.pool()
                self.graphs[(num_reqs, q)] = (graph, out)
        torch.cuda.synchronize()

"""Per-step attention metadata: one layout per backend, each attending the step's rows itself.

The model runner builds one metadata object per step (the backend chose its layout once, see
engine/backends.py); every layer calls its `attend`. Three layouts:
- `BucketedAttention`, the torch reference (the CPU path): requests with a short query (a decode
  token, or a last token plus drafts under speculation) are attended in batched calls, grouped
  by query length, then split into buckets of similar context length so that padding every
  request to its bucket's longest context wastes little; longer queries (prefill chunks) are
  attended one request at a time.
- `VarlenAttention`, the Triton kernels: every request in one launch.
- `RowAttention`, for a model whose layers run on our C++ kernels (kernels/cpu/
  fused_layer.cpp): every row of the step, decode token or prefill chunk alike, attends its own
  context one row at a time, so a row's numbers do not depend on how its prompt was split or
  what shares its step.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.device import host_tensor, padded_rows
from kernels.reference import causal_mask, decode_attention, prefill_attention, write_kv

# Queries up to this length take the batched path.
MAX_BATCHED_QUERY_LEN = 16
# What one more bucket costs, in padded key slots: per layer it adds about ten small ops, each
# padded slot a share of a gather, two matmuls and a softmax (their ratio: python -m
# bench.choices, bench/RESULTS.md "Measurements behind the core's choices").
BUCKET_OVERHEAD_SLOTS = 256


@dataclass(slots=True)
class QueryBucket:
    rows: torch.Tensor  # [n * Q] int64, rows of the flat token batch, request-major
    num_queries: int  # Q
    block_tables: torch.Tensor  # [n, max_blocks] int64, padded with the null block
    key_bias: torch.Tensor  # [n, max_blocks * block_size, Q] float32, 0 visible, -inf hidden


@dataclass(slots=True)
class PrefillSpan:
    start: int  # first row in the flat token batch
    end: int
    block_ids: torch.Tensor  # [num_blocks_of_request] int64
    seq_len: int  # context + new tokens
    mask: torch.Tensor  # [end - start, seq_len] bool


@dataclass(slots=True)
class BucketedAttention:
    """The torch reference's layout: short queries in buckets, prefill chunks one by one."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    buckets: list[QueryBucket]
    prefills: list[PrefillSpan]

    def attend(
        self,
        q: torch.Tensor,  # [num_tokens, Hq, D]
        k: torch.Tensor,  # [num_tokens, Hkv, D]
        v: torch.Tensor,  # [num_tokens, Hkv, D]
        k_cache: torch.Tensor,  # [Hkv, num_blocks, block_size, D]
        v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, Hq, D]
        """Store the step's K/V, then attend every row over its request's cache."""
        write_kv(k_cache, v_cache, k, v, self.slot_mapping)
        num_tokens, num_heads, head_dim = q.shape
        out = torch.empty_like(q)
        for b in self.buckets:
            qb = q.index_select(0, b.rows).view(-1, b.num_queries, num_heads, head_dim)
            ob = decode_attention(qb, k_cache, v_cache, b.block_tables, b.key_bias, scale)
            out.index_copy_(0, b.rows, ob.reshape(-1, num_heads, head_dim))
        for span in self.prefills:
            out[span.start : span.end] = prefill_attention(
                q[span.start : span.end],
                k_cache,
                v_cache,
                span.block_ids,
                span.seq_len,
                span.mask,
                scale,
            )
        return out


@dataclass(slots=True)
class VarlenAttention:
    """The Triton kernels' layout: every request in one launch (kernels/triton_attention)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with the null block
    max_query_len: int
    sliding_window: int | None = None  # a query at p sees keys p - window < k <= p

    def attend(self, q, k, v, k_cache, v_cache, scale: float) -> torch.Tensor:
        """As BucketedAttention.attend, in Triton kernels."""
        from kernels import triton_attention, triton_decode

        triton_attention.store_kv(k_cache, v_cache, k, v, self.slot_mapping)
        if self.max_query_len == 1:  # decodes only: contexts split across programs
            return triton_decode.paged_decode_attention(
                q,
                k_cache,
                v_cache,
                self.block_tables,
                self.seq_lens,
                scale,
                sliding_window=self.sliding_window,
            )
        return triton_attention.paged_attention(
            q.contiguous(),
            k_cache,
            v_cache,
            self.block_tables,
            self.query_start_loc,
            self.seq_lens,
            scale,
            self.max_query_len,
            self.sliding_window,
        )


@dataclass(slots=True)
class RowAttention:
    """Every row of the step for a model whose layers run on the C++ kernels (kernels/cpu/
    fused_layer.cpp): each row attends its request's cache up to its own position."""

    block_tables: torch.Tensor  # [requests, max_blocks] int64, padded with the null block
    row_tables: torch.Tensor  # [R] int64: each row's request, a row of block_tables
    seq_lens: torch.Tensor  # [R] int64: each row's context, itself included
    slot_mapping: torch.Tensor  # [R] int64


AttentionMetadata = BucketedAttention | VarlenAttention | RowAttention

# A backend's layout builder: (seq_lens per request after this step, query_lens per request
# (rows of the flat batch in request order), block_tables, slot_mapping [num_tokens], block_size,
# sliding_window) -> its metadata.
Layout = Callable[..., BucketedAttention | VarlenAttention]


def slot_ids(block_table: list[int], start: int, num_tokens: int, block_size: int) -> list[int]:
    """The KV cache slots of a request's positions start .. start + num_tokens - 1."""
    return [
        block_table[p // block_size] * block_size + p % block_size
        for p in range(start, start + num_tokens)
    ]


def split_by_length(lens: list[int], overhead: int) -> list[tuple[int, int]]:
    """Cut lens (sorted descending) into runs minimising sum(len(run) * run[0]) + overhead each.

    Exact dynamic programme over the boundaries between distinct lengths only: a cut inside
    a group of equal lengths never helps (moving it to the group's start puts those requests
    in the run that pads less), so it is O(g^2) in g distinct lengths, not O(n^2) in requests
    (padded to blocks, 128 decodes have a few dozen lengths at most).
    """
    starts = [i for i in range(len(lens)) if i == 0 or lens[i] != lens[i - 1]] + [len(lens)]
    g = len(starts) - 1
    best = [0.0] + [float("inf")] * g
    cut = [0] * (g + 1)
    for end in range(1, g + 1):
        for start in range(end):
            cost = best[start] + (starts[end] - starts[start]) * lens[starts[start]] + overhead
            if cost < best[end]:
                best[end], cut[end] = cost, start
    runs, end = [], g
    while end:
        runs.append((starts[cut[end]], starts[end]))
        end = cut[end]
    return runs[::-1]


def _bucket(
    members: list[int],  # request indices, sorted by seq_len descending
    num_queries: int,
    seq_lens: list[int],
    row_starts: list[int],
    block_tables: list[list[int]],
    block_size: int,
    sliding_window: int | None,
) -> QueryBucket:
    tables = padded_tables(
        [block_tables[i] for i in members], [seq_lens[i] for i in members], block_size, torch.long
    )
    key_pos = torch.arange(tables.shape[1] * block_size)[None, :, None]  # [1, L, 1]
    lens = host_tensor([seq_lens[i] for i in members])[:, None, None]  # [n, 1, 1]
    q_pos = lens - num_queries + torch.arange(num_queries)[None, None, :]  # [n, 1, Q]
    visible = key_pos <= q_pos
    if sliding_window is not None:
        visible &= key_pos > q_pos - sliding_window
    key_bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    rows = host_tensor([row_starts[i] + j for i in members for j in range(num_queries)])
    return QueryBucket(rows, num_queries, tables, key_bias)


def bucketed_metadata(
    seq_lens: list[int],
    query_lens: list[int],
    block_tables: list[list[int]],
    slot_mapping: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
) -> BucketedAttention:
    """The torch reference's layout (a Layout)."""
    row_starts = [0, *itertools.accumulate(query_lens)]
    by_query_len: dict[int, list[int]] = {}
    prefills = []
    for i, (num_tokens, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if num_tokens <= MAX_BATCHED_QUERY_LEN:
            by_query_len.setdefault(num_tokens, []).append(i)
            continue
        num_blocks = -(-seq_len // block_size)
        prefills.append(
            PrefillSpan(
                start=row_starts[i],
                end=row_starts[i] + num_tokens,
                block_ids=torch.tensor(block_tables[i][:num_blocks], dtype=torch.long),
                seq_len=seq_len,
                mask=causal_mask(seq_len - num_tokens, num_tokens, sliding_window),
            )
        )

    buckets = []
    for num_queries, members in sorted(by_query_len.items()):
        members.sort(key=lambda i: -seq_lens[i])
        padded = [-(-seq_lens[i] // block_size) * block_size for i in members]
        for start, end in split_by_length(padded, BUCKET_OVERHEAD_SLOTS):
            buckets.append(
                _bucket(
                    members[start:end],
                    num_queries,
                    seq_lens,
                    row_starts,
                    block_tables,
                    block_size,
                    sliding_window,
                )
            )
    return BucketedAttention(slot_mapping, buckets, prefills)


def varlen_metadata(
    seq_lens: list[int],
    query_lens: list[int],
    block_tables: list[list[int]],
    slot_mapping: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
) -> VarlenAttention:
    """The Triton kernels' layout (a Layout)."""
    tables = padded_tables(block_tables, seq_lens, block_size)
    starts = host_tensor([0, *itertools.accumulate(query_lens)], torch.int32)
    seq_lens_t = host_tensor(seq_lens, torch.int32)
    return VarlenAttention(
        slot_mapping, starts, seq_lens_t, tables, max(query_lens), sliding_window
    )


def row_metadata(
    seq_lens: list[int],
    query_lens: list[int],
    block_tables: list[list[int]],
    slot_mapping: torch.Tensor,
    block_size: int,
) -> RowAttention:
    """A C++-layered model's metadata for a step: each row's request and context length."""
    row_tables, row_lens = [], []
    for i, (num_tokens, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        row_tables += [i] * num_tokens
        row_lens += range(seq_len - num_tokens + 1, seq_len + 1)
    tables = padded_tables(block_tables, seq_lens, block_size, torch.long)
    return RowAttention(tables, host_tensor(row_tables), host_tensor(row_lens), slot_mapping)


def padded_tables(
    block_tables: list[list[int]],
    seq_lens: list[int],
    block_size: int,
    dtype: torch.dtype = torch.int32,
) -> torch.Tensor:  # [len(block_tables), max blocks], padded with the null block
    """Each request's blocks that hold its seq_len tokens, as one table."""
    width = max(-(-n // block_size) for n in seq_lens)
    return padded_rows(
        [table[: -(-n // block_size)] for table, n in zip(block_tables, seq_lens, strict=True)],
        width,
        dtype=dtype,
    )

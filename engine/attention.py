"""Per-step attention metadata and the paged attention call the model layers make.

The model runner builds one `AttentionMetadata` per step; every layer reuses it. Decode rows
(one query token per request) come first in the flat batch so they form one slice that is
attended in a single batched call; prefill chunks follow, one call each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.reference import causal_mask, decode_attention, prefill_attention, write_kv


@dataclass(slots=True)
class PrefillSpan:
    start: int  # first row in the flat token batch
    end: int
    block_ids: torch.Tensor  # [num_blocks_of_request] int64
    seq_len: int  # context + new tokens
    mask: torch.Tensor  # [end - start, seq_len] bool


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64
    decode_key_bias: torch.Tensor  # [num_decodes, max_blocks * block_size] float32
    prefills: list[PrefillSpan]


def build_metadata(
    seq_lens: list[int],  # per request, after this step
    query_lens: list[int],  # per request; decodes (== 1) first
    block_tables: list[list[int]],
    slot_mapping: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
) -> AttentionMetadata:
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    max_blocks = max((len(block_tables[i]) for i in range(num_decodes)), default=0)
    tables = torch.zeros(num_decodes, max_blocks, dtype=torch.long)
    for i in range(num_decodes):
        tables[i, : len(block_tables[i])] = torch.tensor(block_tables[i])
    key_pos = torch.arange(max_blocks * block_size)[None, :]  # [1, max_len]
    lens = torch.tensor(seq_lens[:num_decodes])[:, None]  # [B, 1]
    visible = key_pos < lens
    if sliding_window is not None:
        visible &= key_pos >= lens - sliding_window
    key_bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))

    prefills, start = [], num_decodes
    for i in range(num_decodes, len(query_lens)):
        num_tokens, seq_len = query_lens[i], seq_lens[i]
        num_blocks = -(-seq_len // block_size)
        prefills.append(
            PrefillSpan(
                start=start,
                end=start + num_tokens,
                block_ids=torch.tensor(block_tables[i][:num_blocks], dtype=torch.long),
                seq_len=seq_len,
                mask=causal_mask(seq_len - num_tokens, num_tokens, sliding_window),
            )
        )
        start += num_tokens
    return AttentionMetadata(slot_mapping, num_decodes, tables, key_bias, prefills)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, Hq, D]
    k: torch.Tensor,  # [num_tokens, Hkv, D]
    v: torch.Tensor,  # [num_tokens, Hkv, D]
    k_cache: torch.Tensor,  # [Hkv, num_blocks, block_size, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, Hq, D]
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    n = meta.num_decodes
    if n:
        out[:n] = decode_attention(
            q[:n], k_cache, v_cache, meta.decode_block_tables, meta.decode_key_bias, scale
        )
    for span in meta.prefills:
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

"""Paged attention reference against dense attention, and the length bucketing of short queries.

The oracle here is per-request dense attention over the request's own keys in logical order,
written independently of the paged layout: it is also what the Triton kernels are held to.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from engine.attention import bucketed_metadata, split_by_length

BLOCK_SIZE = 4


def dense_attention(q, k, v, q_positions, scale, sliding_window=None):
    """q [T, Hq, D] at absolute q_positions; k, v [S, Hkv, D] for positions 0..S-1."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    key_pos = torch.arange(k.shape[0])[None, :]
    visible = key_pos <= q_positions[:, None]
    if sliding_window is not None:
        visible &= key_pos > q_positions[:, None] - sliding_window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


def run_paged(
    seq_lens,
    query_lens,
    num_heads,
    num_kv_heads,
    sliding_window,
    seed,
    layout=bucketed_metadata,
    block_size=BLOCK_SIZE,
):
    """Scatter random K/V for every request into shuffled blocks, attend, compare per request."""
    gen = torch.Generator().manual_seed(seed)
    head_dim = 8
    num_blocks = 1 + sum(-(-s // block_size) for s in seq_lens) + 3
    k_cache = torch.zeros(num_kv_heads, num_blocks, block_size, head_dim)
    v_cache = torch.zeros_like(k_cache)
    free = list(range(1, num_blocks))
    random.Random(seed).shuffle(free)

    tables, keys, values, slots, queries, news_k, news_v = [], [], [], [], [], [], []
    for seq_len, num_new in zip(seq_lens, query_lens, strict=True):
        table = [free.pop() for _ in range(-(-seq_len // block_size))]
        tables.append(table)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        keys.append(k)
        values.append(v)
        context = seq_len - num_new
        for p in range(context):  # context already in the cache
            slot = table[p // block_size] * block_size + p % block_size
            k_cache[:, slot // block_size, slot % block_size] = k[p]
            v_cache[:, slot // block_size, slot % block_size] = v[p]
        slots += [
            table[p // block_size] * block_size + p % block_size for p in range(context, seq_len)
        ]
        queries.append(torch.randn(num_new, num_heads, head_dim, generator=gen))
        news_k.append(k[context:])
        news_v.append(v[context:])

    meta = layout(seq_lens, query_lens, tables, torch.tensor(slots), block_size, sliding_window)
    scale = head_dim**-0.5
    out = meta.attend(
        torch.cat(queries), torch.cat(news_k), torch.cat(news_v), k_cache, v_cache, scale
    )
    row = 0
    for i, (seq_len, num_new) in enumerate(zip(seq_lens, query_lens, strict=True)):
        positions = torch.arange(seq_len - num_new, seq_len)
        want = dense_attention(queries[i], keys[i], values[i], positions, scale, sliding_window)
        torch.testing.assert_close(out[row : row + num_new], want, atol=1e-5, rtol=1e-5)
        row += num_new
    return meta


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_mixed_batch_matches_dense(num_heads, num_kv_heads, sliding_window):
    # Decodes at block boundaries (4, 5, 8, 9), 3- and 4-query "verify" rows, a 1-token prompt,
    # a short and a long prefill chunk (the latter past MAX_BATCHED_QUERY_LEN), one long context.
    seq_lens = [4, 5, 8, 9, 61, 7, 12, 1, 6, 40, 33]
    query_lens = [1, 1, 1, 1, 1, 3, 4, 1, 6, 20, 3]
    meta = run_paged(seq_lens, query_lens, num_heads, num_kv_heads, sliding_window, seed=0)
    assert len(meta.prefills) == 1  # the 20-token chunk
    assert {b.num_queries for b in meta.buckets} == {1, 3, 4, 6}


@pytest.mark.parametrize("sliding_window", [None, 5, 20])
@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1], [1, 3, 20, 1]], ids=["decode", "mixed"])
def test_varlen_layout_matches_dense(sliding_window, query_lens):
    """The Triton kernels' layout (Triton's interpreter on CPU) carries the layers' window to
    both kernels: split decode when every query is one token, else the varlen kernel."""
    from engine.attention import varlen_metadata

    seq_lens = [1, 17, 60, 90]
    meta = run_paged(seq_lens, query_lens, 4, 2, sliding_window, 0, varlen_metadata, 16)
    assert meta.sliding_window == sliding_window


def test_random_batches_match_dense():
    rng = random.Random(1)
    for seed in range(20):
        n = rng.randint(1, 12)
        query_lens = [rng.choice([1, 1, 1, 2, 5, 17]) for _ in range(n)]
        seq_lens = [q + rng.randint(0, 50) for q in query_lens]
        run_paged(seq_lens, query_lens, 4, 2, rng.choice([None, 9]), seed)


def test_buckets_split_long_from_short():
    # One long context must not make 30 short decodes pay for its length.
    seq_lens = [400] + [10] * 30
    meta = run_paged(seq_lens, [1] * 31, 2, 1, None, seed=3)
    widths = sorted(b.block_tables.shape for b in meta.buckets)
    assert widths == [(1, 100), (30, 3)]


def test_split_by_length_is_optimal():
    rng = random.Random(0)
    for _ in range(200):
        lens = sorted((rng.randint(1, 40) for _ in range(rng.randint(1, 7))), reverse=True)
        overhead = rng.choice([0, 5, 30])
        runs = split_by_length(lens, overhead)
        assert runs[0][0] == 0 and runs[-1][1] == len(lens)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(runs))

        def cost(runs, lens=lens, overhead=overhead):
            return sum((e - s) * lens[s] + overhead for s, e in runs)

        brute = min(
            cost(list(itertools.pairwise((0, *cuts, len(lens)))))
            for r in range(len(lens))
            for cuts in itertools.combinations(range(1, len(lens)), r)
        )
        assert cost(runs) == brute

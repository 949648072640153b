"""Triton kernels against their pure-torch references: under TRITON_INTERPRET=1 on CPU (tiny
fp32 shapes, the default run), and on CUDA with bf16 when a GPU is present (`gpu` marker)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernels import reference
from kernels.triton_attention import paged_attention, store_kv  # TRITON_INTERPRET: conftest
from kernels.triton_decode import _split_size

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_cache(num_kv_heads, num_blocks, block_size, head_dim, gen, dtype=torch.float32):
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    v = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    return k, v


@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv_equals_reference_and_skips_padding(block_size):
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = make_cache(2, 6, block_size, 8, gen)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor(
        [0, block_size - 1, block_size, 3 * block_size + 5, -1, 6 * block_size - 1]
    )
    k = torch.randn(len(slots), 2, 8, generator=gen).to(DEVICE)
    v = torch.randn(len(slots), 2, 8, generator=gen).to(DEVICE)
    store_kv(k_cache, v_cache, k, v, slots.to(DEVICE))
    keep = slots >= 0
    reference.write_kv(ref_k, ref_v, k[keep], v[keep], slots[keep].to(DEVICE))
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def ragged_batch(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, gen, dtype):
    """Requests with ctx_lens cached tokens and q_lens new ones, blocks scattered in the pool."""
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens, strict=True)]
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(need) + 3
    k_cache, v_cache = make_cache(num_kv_heads, num_blocks, block_size, head_dim, gen, dtype)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(q_lens), max(need) + 2, dtype=torch.int32)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(perm[:n])
        perm = perm[n:]
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    return (
        q,
        k_cache,
        v_cache,
        tables.to(DEVICE),
        starts.to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32).to(DEVICE),
    )


CASES = [
    # (q_lens, ctx_lens): decodes, a verification (1 + 3 drafts), prefill chunks, block edges
    ([1, 1, 1], [0, 15, 16]),
    ([4, 1, 7], [17, 31, 0]),
    ([20, 1, 4, 1], [12, 47, 32, 1]),
    ([33], [0]),
]


@pytest.mark.parametrize(("q_lens", "ctx_lens"), CASES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 2), (4, 1), (6, 2)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_equals_reference(q_lens, ctx_lens, num_heads, num_kv_heads, block_size):
    gen = torch.Generator().manual_seed(sum(q_lens) + 7 * sum(ctx_lens) + num_heads)
    head_dim = 16
    q, k_cache, v_cache, tables, starts, seq_lens = ragged_batch(
        q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, gen, torch.float32
    )
    scale = head_dim**-0.5
    got = paged_attention(q, k_cache, v_cache, tables, starts, seq_lens, scale, max(q_lens))
    want = reference.varlen_paged_attention(q, k_cache, v_cache, tables, starts, seq_lens, scale)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_paged_attention_reads_only_the_requests_blocks():
    """Poisoning every block no request owns (and the null block) changes nothing."""
    gen = torch.Generator().manual_seed(5)
    q, k_cache, v_cache, tables, starts, seq_lens = ragged_batch(
        [3, 1], [14, 20], 4, 2, 16, 16, gen, torch.float32
    )
    args = (tables, starts, seq_lens, 0.25, 3)
    clean = paged_attention(q, k_cache, v_cache, *args)
    owned = set(tables[tables > 0].tolist())
    for b in range(k_cache.shape[1]):
        if b not in owned:
            k_cache[:, b] = float("nan")
            v_cache[:, b] = float("nan")
    assert torch.equal(paged_attention(q, k_cache, v_cache, *args), clean)


def test_launchers_refuse_bad_shapes():
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = make_cache(2, 4, 16, 8, gen)
    with pytest.raises(ValueError, match="k/v must be"):
        store_kv(k_cache, v_cache, torch.zeros(3, 4, 8), torch.zeros(3, 4, 8), torch.zeros(3))
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention(
            torch.zeros(2, 4, 8),
            k_cache,
            v_cache,
            torch.zeros(2, 2, dtype=torch.int32),
            torch.zeros(2, dtype=torch.int32),
            torch.ones(2, dtype=torch.int32),
            1.0,
            1,
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_bf16_on_gpu(block_size):
    gen = torch.Generator().manual_seed(1)
    q_lens, ctx_lens = [1] * 24 + [5] * 4 + [300, 64], [900 + 37 * i for i in range(30)]
    q, k_cache, v_cache, tables, starts, seq_lens = ragged_batch(
        q_lens, ctx_lens, 32, 8, 128, block_size, gen, torch.bfloat16
    )
    got = paged_attention(q, k_cache, v_cache, tables, starts, seq_lens, 128**-0.5, max(q_lens))
    want = reference.varlen_paged_attention(
        q.float(), k_cache.float(), v_cache.float(), tables, starts, seq_lens, 128**-0.5
    )
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_engine_greedy_equal_with_triton_backend(tiny_llama, spec):
    """The whole engine on the Triton backend (interpreter on CPU) emits the torch backend's
    tokens: chunked prefill (16-token budget), decodes, and k+1-query verification."""
    from engine import LLM, SamplingParams

    prompts = [[5 + i for i in range(37)], [7, 8, 9, 7, 8, 9, 7, 8], [3], list(range(40, 60)) * 2]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            str(tiny_llama),
            num_kv_blocks=64,
            max_num_batched_tokens=16,
            attention_backend=backend,
            speculative_method=spec,
        )
        assert llm.engine.runner.backend.name == backend
        outs[backend] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
    assert outs["triton"] == outs["torch"]


def test_engine_sampled_equal_with_triton_backend(tiny_llama):
    """Seeded sampled requests with a self-draft on the Triton backend: verification runs the
    fused rejection kernel (interpreter on CPU) instead of its torch reference, on the same
    draws, so the tokens equal the torch backend's; accepted and rejected drafts both occur."""
    from engine import LLM, SamplingParams

    prompts = [[5 + i for i in range(37)], [7, 8, 9, 7, 8, 9, 7, 8], [3], list(range(40, 60)) * 2]
    params = [
        SamplingParams(
            temperature=0.9, top_k=[0, 20][i % 2], seed=i, max_tokens=10, ignore_eos=True
        )
        for i in range(len(prompts))
    ]
    outs, stats = {}, {}
    for backend in ("torch", "triton"):
        llm = LLM(
            str(tiny_llama),
            num_kv_blocks=64,
            attention_backend=backend,
            draft_model=str(tiny_llama),
            draft_quantization=None,
            num_speculative_tokens=3,
            adaptive_speculation=False,
        )
        outs[backend] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
        stats[backend] = llm.engine.speculation.stats
        kernel = llm.engine.runner.backend.verify_kernel.__module__
        assert (
            kernel == {"torch": "kernels.reference", "triton": "kernels.triton_rejection"}[backend]
        )
    assert outs["triton"] == outs["torch"]
    s = stats["triton"]
    assert 0 < s.num_accepted < s.num_drafts


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    """Two layers, a sliding one (window 8) then a full one. Its own LM head: with the tied one
    two layers mostly echo the input token, so the window would not show in the greedy ids."""
    from models import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("gemma3"),
        "gemma3",
        head_dim=32,
        sliding_window=8,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=False,
    )


@pytest.mark.parametrize("static_buffers", [False, True], ids=["eager", "static-buffers"])
def test_gemma3_greedy_equals_hf_with_triton_backend(tiny_gemma3, static_buffers):
    """Gemma 3's per-layer windows on the Triton backend (interpreter on CPU): HF's greedy ids
    through chunked prefill (16-token budget), a 40-token context past its 8-key window at
    16-token blocks, and decodes, eagerly or from the padded static buffers (as CUDA graphs)."""
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams
    from models import hf_greedy

    new_tokens = 6
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (40, 9, 1)]
    hf = AutoModelForCausalLM.from_pretrained(tiny_gemma3, dtype=torch.float32)
    want = [hf_greedy(hf, p, new_tokens) for p in prompts]
    llm = LLM(
        str(tiny_gemma3),
        num_kv_blocks=32,
        max_num_batched_tokens=16,
        attention_backend="triton",
    )
    runner = llm.engine.runner
    assert runner.backend.name == "triton" and runner.cfg.windows == (8, None)
    if static_buffers:
        runner.use_graphs(4, llm.engine.max_model_len, 1)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert not static_buffers or runner.graphs.num_replays > 0


def test_backend_choice():
    from engine.backends import resolve_backend

    assert resolve_backend("auto").name == "torch"  # the engine runs on CPU today
    assert resolve_backend("auto", "cuda").name == "triton"  # sliding windows or not
    assert resolve_backend("triton").name == "triton"  # TRITON_INTERPRET: conftest
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        resolve_backend("flash")


@pytest.mark.parametrize("num_splits", [1, 3, 16, None])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 2), (4, 1), (6, 2)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_split_decode_equals_reference(num_splits, num_heads, num_kv_heads, block_size):
    """Contexts split across programs and merged: equal to the reference for short contexts
    (fewer blocks than splits: most splits store nothing), block edges, uneven cuts, and
    contexts over many splits; None is the launcher's own choice."""
    from kernels.triton_decode import paged_decode_attention

    ctx_lens = [0, 15, 16, 47, 100, 300]
    gen = torch.Generator().manual_seed((num_splits or 0) + 10 * num_heads + block_size)
    q, k_cache, v_cache, tables, starts, seq_lens = ragged_batch(
        [1] * len(ctx_lens), ctx_lens, num_heads, num_kv_heads, 16, block_size, gen, torch.float32
    )
    got = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25, num_splits)
    want = reference.varlen_paged_attention(q, k_cache, v_cache, tables, starts, seq_lens, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@triton.jit
def _broken_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    seq_lens_ptr,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    WINDOW: tl.constexpr,
    MODE: tl.constexpr,  # 0: every live split weighs the same; 1: earlier passes not rescaled
):
    """kernels.triton_attention._decode_merge_kernel with one deliberate mistake."""
    row = tl.program_id(0)
    seq_len = tl.load(seq_lens_ptr + row // num_heads)
    first, end, per_split = _split_size(seq_len, num_splits, BLOCK_SIZE, WINDOW)
    live = (end - first + per_split - 1) // per_split
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    top = float("-inf")
    total = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for first in range(0, live, BLOCK_S):
        s = first + tl.arange(0, BLOCK_S)
        s_valid = s < live
        lse = tl.load(part_lse_ptr + row * num_splits + s, mask=s_valid, other=float("-inf"))
        if MODE == 0:
            lse = tl.where(s_valid, 0.0, float("-inf"))
        new_top = tl.maximum(top, tl.max(lse, axis=0))
        correction = tl.exp(top - new_top)
        if MODE == 1:
            correction = 1.0
        weights = tl.exp(lse - new_top)
        parts = tl.load(
            part_out_ptr + (row * num_splits + s)[:, None] * HEAD_DIM + d[None, :],
            mask=s_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        acc = acc * correction + tl.sum(parts * weights[:, None], axis=0)
        total = total * correction + tl.sum(weights, axis=0)
        top = new_top
    out = acc / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d_valid)


def broken_merge(mode: int):
    """Stands in for the merge kernel at its launch: `kernel[grid](...)`."""

    class Launcher:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: _broken_merge_kernel[grid](*args, MODE=mode, **kwargs)

    return Launcher()


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(got, want, rtol=1e-4, atol=1e-4)


def test_split_decode_merge_is_not_a_plain_average(monkeypatch):
    """The splits must be weighted by their log-sum-exp: the merge passes, and a broken merge
    (equal weights per split) fails the same comparison."""
    from kernels import triton_decode
    from kernels.triton_decode import paged_decode_attention

    gen = torch.Generator().manual_seed(3)
    q, k_cache, v_cache, tables, starts, seq_lens = ragged_batch(
        [1], [100], 2, 2, 16, 16, gen, torch.float32
    )
    k_cache[:, tables[0, 0]] *= 4  # the first split's keys dominate
    want = reference.varlen_paged_attention(q, k_cache, v_cache, tables, starts, seq_lens, 1.0)
    assert close(paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 1.0, 7), want)
    monkeypatch.setattr(triton_decode, "_decode_merge_kernel", broken_merge(0))
    assert not close(paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 1.0, 7), want)
    # One split has nothing to weigh: the broken merge is right there (so it does run).
    assert close(paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 1.0, 1), want)


def test_split_decode_ignores_the_table_width():
    """A CUDA graph's block table is as wide as the longest context allowed: the splits follow
    each request's own context, so a table padded 40x wider gives the very same result, and
    the launcher's split count depends on the batch's shape, not on that width."""
    from kernels.triton_decode import decode_splits, paged_decode_attention

    gen = torch.Generator().manual_seed(5)
    q, k_cache, v_cache, tables, _, seq_lens = ragged_batch(
        [1, 1, 1], [3, 40, 90], 4, 2, 16, 16, gen, torch.float32
    )
    wide = torch.zeros(3, 40 * tables.shape[1], dtype=tables.dtype, device=tables.device)
    wide[:, : tables.shape[1]] = tables
    narrow = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25, 5)
    assert torch.equal(paged_decode_attention(q, k_cache, v_cache, wide, seq_lens, 0.25, 5), narrow)
    assert decode_splits(8, 8, 513) == decode_splits(8, 8, 8193) == 32
    assert decode_splits(1, 8, 8193) == 64 and decode_splits(1, 8, 3) == 3  # at most the blocks
    assert decode_splits(256, 8, 8193) == 1


def test_split_decode_merges_more_splits_than_one_tile(monkeypatch):
    """Over MERGE_SPLITS splits the merge runs in several passes with a running maximum: the
    dominant split sits in a later pass than the first, so a merge that does not rescale what
    it summed before fails (run here)."""
    from kernels import triton_decode
    from kernels.triton_decode import MERGE_SPLITS, paged_decode_attention

    gen = torch.Generator().manual_seed(4)
    num_splits = 3 * MERGE_SPLITS
    ctx_lens = [0, 40 * 16, num_splits * 16 + 5]  # blocks: 41 (41 splits live), 97 (49 live)
    q, k_cache, v_cache, tables, starts, seq_lens = ragged_batch(
        [1] * len(ctx_lens), ctx_lens, 4, 2, 16, 16, gen, torch.float32
    )
    k_cache[:, tables[1, MERGE_SPLITS + 3]] *= 6  # a second pass's keys dominate
    k_cache[:, tables[2, 2 * (MERGE_SPLITS + 3)]] *= 6  # 2 blocks per split there
    got = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 1.0, num_splits)
    want = reference.varlen_paged_attention(q, k_cache, v_cache, tables, starts, seq_lens, 1.0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(triton_decode, "_decode_merge_kernel", broken_merge(1))
    broken = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 1.0, num_splits)
    assert close(broken[0], want[0])  # no context: nothing to rescale
    assert not close(broken[1], want[1]) and not close(broken[2], want[2])


# Sliding windows (kernels.reference.causal_mask: a query at p sees keys p - W < k <= p).
# (q_lens, ctx_lens): prefill chunks over several query tiles (16 tokens each at 6/2 heads of
# dim 64), decodes and a verification, contexts far past the smaller windows.
WINDOW_CASES = [([20, 1, 4, 1], [12, 47, 32, 1]), ([33, 3], [70, 90])]
WINDOWS = [1, 5, 16, 40, 1000]  # 1000: more than any context


def windowed_batch(q_lens, ctx_lens, block_size, seed):
    gen = torch.Generator().manual_seed(seed)
    return ragged_batch(q_lens, ctx_lens, 6, 2, 64, block_size, gen, torch.float32)


@pytest.mark.parametrize(("q_lens", "ctx_lens"), WINDOW_CASES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_windowed_paged_attention_equals_reference(q_lens, ctx_lens, window, block_size):
    q, k_cache, v_cache, tables, starts, seq_lens = windowed_batch(
        q_lens, ctx_lens, block_size, window + block_size
    )
    args = (tables, starts, seq_lens, 0.125)
    got = paged_attention(q, k_cache, v_cache, *args, max(q_lens), window)
    want = reference.varlen_paged_attention(q, k_cache, v_cache, *args, window)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


DECODE_CTX_LENS = [0, 15, 16, 47, 100, 300]


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_windowed_split_decode_equals_reference(num_splits, window, block_size):
    """The splits cover the window's blocks only; None: the launcher's count, at most the
    blocks a window can touch."""
    from kernels.triton_decode import paged_decode_attention

    q, k_cache, v_cache, tables, starts, seq_lens = windowed_batch(
        [1] * len(DECODE_CTX_LENS), DECODE_CTX_LENS, block_size, (num_splits or 0) + window
    )
    got = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125, num_splits, window)
    want = reference.varlen_paged_attention(
        q, k_cache, v_cache, tables, starts, seq_lens, 0.125, window
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def windowed_runs(window):
    """(kernel at a window, reference at `window`) for a prefill batch and a decode batch."""
    from kernels.triton_decode import paged_decode_attention

    prefill = windowed_batch([33, 3], [70, 90], 16, 1)
    decode = windowed_batch([1] * 3, [47, 100, 300], 16, 2)

    def run(batch, w):
        q, k_cache, v_cache, tables, starts, seq_lens = batch
        if batch is decode:
            return paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125, 3, w)
        return paged_attention(q, k_cache, v_cache, tables, starts, seq_lens, 0.125, 33, w)

    def want(batch):
        q, k_cache, v_cache, tables, starts, seq_lens = batch
        return reference.varlen_paged_attention(
            q, k_cache, v_cache, tables, starts, seq_lens, 0.125, window
        )

    return [(lambda w, b=b: run(b, w), want(b), b) for b in (prefill, decode)]


def test_windowed_kernels_reject_a_wrong_window():
    """The comparison above holds the window exactly: the kernels with the window off, or one
    key wider, fail it."""
    for run, want, _ in windowed_runs(5):
        assert close(run(5), want)
        assert not close(run(None), want)
        assert not close(run(6), want)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter on the NaN blocks
def test_windowed_kernels_skip_the_blocks_before_the_window():
    """Blocks wholly before every query's window are never read: poisoning them (NaN) changes
    nothing, while the kernels with no window read them (NaN out)."""
    window = 5
    for run, _, batch in windowed_runs(window):
        clean = run(window)
        _, k_cache, v_cache, tables, starts, seq_lens = batch
        q_lens = starts.diff()
        for b, (seq_len, q_len) in enumerate(zip(seq_lens.tolist(), q_lens.tolist(), strict=True)):
            first_key = seq_len - q_len - window + 1  # the request's first query's first key
            for block in tables[b, : max(first_key, 0) // 16].tolist():
                k_cache[:, block] = float("nan")
                v_cache[:, block] = float("nan")
        assert torch.equal(run(window), clean)
        assert run(None).isnan().any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_split_decode_bf16_on_gpu():
    from kernels.triton_decode import paged_decode_attention

    gen = torch.Generator().manual_seed(2)
    ctx_lens = [3000 + 211 * i for i in range(16)] + [1, 17, 4095]
    q, k_cache, v_cache, tables, starts, seq_lens = ragged_batch(
        [1] * len(ctx_lens), ctx_lens, 32, 8, 128, 16, gen, torch.bfloat16
    )
    got = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 128**-0.5)
    want = reference.varlen_paged_attention(
        q.float(), k_cache.float(), v_cache.float(), tables, starts, seq_lens, 128**-0.5
    )
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)

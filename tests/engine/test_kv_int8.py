"""The int8 KV cache (EngineConfig.kv_cache_dtype="int8", engine.models.kv_cache) on the default
path, an embedded GGUF's layers on the C++ kernels: the quality rule against the same model with
a float32 cache over real text, scored through one prefill and through decode steps, and the
same cache with its codes cut to 4 bits failing it; the memory accounting (scales counted: the
same bytes hold ~3x the tokens); a draft model's cache; the refusal where attention is not on
the C++ kernels. The same rule for a bfloat16 cache beside the float32 weights (its broken
variant: mantissas cut to 2 bits). The invariance of a request's tokens under prefix caching,
chunking and preemption with an int8 or bfloat16 cache: tests/e2e/test_gguf_invariance.py."""

from __future__ import annotations

import pytest
import torch

from bench.quality import compare, held_tokens, span, teacher_forced, teacher_forced_decode
from engine import LLM, SamplingParams
from engine.models.quantized import tandem_kernel_available
from engine.models.registry import EMBEDDED_MODELS, ModelNotFoundError, resolve_model
from kernels import kv_int8

needs_kernel = pytest.mark.skipif(not tandem_kernel_available(), reason="no C++ kernel")
SMOLLM2 = "smollm2-135m-instruct"
MAX_MEAN_LOGPROB_DIFF = 0.1  # the rule's third clause (engine.models.kv_cache)
NUM_TOKENS, PREFILL = 1024, 768  # the text; decode scores positions PREFILL.. one step each


def mean_logprob_diff(reference, scores) -> float:
    pairs = zip(reference.token_logprobs, scores.token_logprobs, strict=True)
    return sum(abs(a - b) for a, b in pairs) / len(reference.token_logprobs)


def verdict(reference, scores) -> tuple[bool, str]:
    """The quality rule: top-1 agreement, perplexity and mean |log-prob difference|."""
    report, diff = compare(reference, scores), mean_logprob_diff(reference, scores)
    return report.passes and diff <= MAX_MEAN_LOGPROB_DIFF, f"{report}, mean |diff| {diff:.4f}"


def cut_to_4_bits(cache: torch.Tensor, head_dim: int) -> None:
    """A layer's int8 K or V cache with every code rounded to a multiple of 16 (16 levels a
    group: a 4-bit cache), scales kept."""
    codes, _ = kv_int8.codes_and_scales(cache, head_dim)
    codes.copy_((codes.float() / 16).round().clamp(-8, 7).mul(16).to(torch.int8))


def scores(llm: LLM, ids: list[int]):
    """(teacher-forced scores of every position in one prefill, those of PREFILL.. by decode)."""
    return teacher_forced(llm, ids), teacher_forced_decode(llm, ids, PREFILL)


def cut_to_2_mantissa_bits(cache: torch.Tensor, head_dim: int) -> None:
    """A bfloat16 K or V cache with each value's mantissa cut from 7 bits to 2 (as float8
    e5m2's)."""
    cache.view(torch.int16).bitwise_and_(-32)  # 0xFFE0: sign, exponent, 2 mantissa bits


def assert_rule_holds_then_breaks(name: str, monkeypatch, dtype: str = "int8") -> None:
    kw = dict(num_kv_blocks=2 * NUM_TOKENS // 16 + 2, enable_prefix_caching=False)
    exact = LLM(name, **kw)
    ids = held_tokens(exact.engine.tokenizer, NUM_TOKENS)
    ref_prefill, ref_decode = scores(exact, ids)
    ref_decode_span = span(ref_prefill, PREFILL, NUM_TOKENS)
    # the float32 cache's two paths agree to the last bit: every row runs the same instructions
    assert ref_decode.token_logprobs == ref_decode_span.token_logprobs
    del exact
    llm = LLM(name, kv_cache_dtype=dtype, **kw)
    assert llm.engine.runner.kv_caches.dtype == getattr(torch, dtype)
    got_prefill, got_decode = scores(llm, ids)
    for what, ref, got in (
        ("prefill", ref_prefill, got_prefill),
        ("decode", ref_decode, got_decode),
    ):
        ok, text = verdict(ref, got)
        print(f"{name} {dtype} KV, {what}: {text}")
        assert ok, f"{what}: {text}"
    assert got_decode.token_logprobs == span(got_prefill, PREFILL, NUM_TOKENS).token_logprobs
    # The broken variant: the layers as their pieces (the same bits), the cache cut to 4 bits
    # (bfloat16: to 2 mantissa bits) after every store, before attention reads it.
    for layer in llm.engine.runner.model.layers:
        layer.fused = None
    llm.engine.runner.model.stack = None
    attend = torch.ops.tandem_cpu.attend

    head_dim = llm.engine.model_config.head_dim
    cut = cut_to_4_bits if dtype == "int8" else cut_to_2_mantissa_bits

    def attend_cut(qkv, k_cache, v_cache, *args):
        cut(k_cache, head_dim), cut(v_cache, head_dim)
        return attend(qkv, k_cache, v_cache, *args)

    monkeypatch.setattr(torch.ops.tandem_cpu, "attend", attend_cut)
    broken_prefill, broken_decode = scores(llm, ids)
    for what, ref, got in (
        ("prefill", ref_prefill, broken_prefill),
        ("decode", ref_decode, broken_decode),
    ):
        ok, text = verdict(ref, got)
        print(f"{name} {dtype} KV cut (broken), {what}: {text}")
        assert not ok, f"{what}: {text}"


@needs_kernel
def test_smollm2_int8_cache_meets_the_quality_rule_and_a_4_bit_cache_does_not(monkeypatch):
    assert_rule_holds_then_breaks(SMOLLM2, monkeypatch)


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct"])
def test_qwen_int8_cache_meets_the_quality_rule_and_a_4_bit_cache_does_not(name, monkeypatch):
    """Qwen2.5's rotated keys carry outlier dims: K in groups of 32 missed the rule here
    (prefill perplexity x1.0184, top-1 94.0%, mean |diff| 0.098 over 1023 positions); K in
    groups of 8 meets it (x1.0013, 96.8%, 0.053; decode x1.0030, 99.2%, 0.060)."""
    try:
        resolve_model(name)
    except ModelNotFoundError:
        pytest.skip(f"{name} not installed: {EMBEDDED_MODELS[name].pip_command}")
    assert_rule_holds_then_breaks(name, monkeypatch)


@needs_kernel
@pytest.mark.slow
def test_smollm2_bfloat16_cache_meets_the_quality_rule_and_2_mantissa_bits_do_not(monkeypatch):
    """A bfloat16 cache beside the float32 weights and activations (each value rounded as
    stored): the same rule as int8's."""
    assert_rule_holds_then_breaks(SMOLLM2, monkeypatch, "bfloat16")


@needs_kernel
def test_the_same_memory_holds_3_05x_the_tokens_scales_counted():
    """SmolLM2: 30 layers, 3 kv heads of 64. float32: 30 * 2 * 3 * 64 * 4 = 46080 bytes a
    token; int8: 30 * 3 * ((64 + 8 * 4) + (64 + 2 * 4)) = 15120 (codes, a float32 scale per 8
    of a key's values and per 32 of a value's)."""
    budget, engines = 48 << 20, {}
    for dtype in ("auto", "int8", "bfloat16"):
        engines[dtype] = LLM(SMOLLM2, kv_cache_memory_bytes=budget, kv_cache_dtype=dtype).engine
    snaps = {k: e.snapshot() for k, e in engines.items()}
    assert {k: s["kv_cache_dtype"] for k, s in snaps.items()} == {
        "auto": "float32", "int8": "int8", "bfloat16": "bfloat16"
    }  # fmt: skip
    per_token = {"auto": 46080, "int8": 15120, "bfloat16": 23040}  # bfloat16: 30 * 2 * 3 * 64 * 2
    assert {k: s["kv_bytes_per_token"] for k, s in snaps.items()} == per_token
    caches = {k: e.runner.kv_caches for k, e in engines.items()}
    assert caches["int8"].k.shape == (30, 3, caches["int8"].num_blocks, 16, 96)
    assert caches["int8"].v.shape == (30, 3, caches["int8"].num_blocks, 16, 72)
    blocks = {k: c.num_blocks if k == "int8" else c.shape[3] for k, c in caches.items()}
    assert blocks == {k: budget // (16 * n) for k, n in per_token.items()}  # 68, 208, 136
    for engine in engines.values():
        assert engine.runner.kv_caches.nbytes <= budget
    assert (
        3.0 <= blocks["int8"] / blocks["auto"] <= 3.1 and blocks["bfloat16"] == 2 * blocks["auto"]
    )


def test_a_cache_type_is_refused_where_attention_is_not_on_the_cpp_kernels(tiny_llama):
    """int8 needs quantized weights on the C++ layers; bfloat16 beside float32 weights needs the
    C++ layers (dense float32 runs there too); bfloat16 weights attend in torch, so their cache
    keeps their type."""
    dense = dict(quantization=None, num_kv_blocks=8)
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        LLM(str(tiny_llama), kv_cache_dtype="int8", **dense)
    with pytest.raises(ValueError, match="kv_cache_dtype='float32'"):
        LLM(str(tiny_llama), dtype="bfloat16", kv_cache_dtype="float32", **dense)
    llm = LLM(str(tiny_llama), kv_cache_dtype="bfloat16", **dense)
    assert llm.engine.runner.model.fused_layers
    assert llm.engine.runner.kv_caches.dtype == torch.bfloat16
    llm = LLM(str(tiny_llama), kv_cache_dtype="float32", **dense)
    assert llm.engine.runner.kv_caches.dtype == torch.float32


@needs_kernel
@pytest.mark.parametrize(
    ("draft_quantization", "draft_kv"), [("int4", torch.int8), ("auto", torch.float32)]
)
def test_a_draft_on_the_cpp_kernels_keeps_int8_too_and_speculation_stays_exact(
    tiny_llama, draft_model, draft_quantization, draft_kv
):
    """The draft's cache is int8 where its layers run on the C++ kernels (else its dtype's),
    counted in the bytes per token; greedy speculation over int8 caches gives the tokens plain
    decoding over the int8 cache gives."""
    kw = dict(quantization="int4", num_kv_blocks=64, kv_cache_dtype="int8")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[1, 5, 9, 14, 2], [7, 7, 3], list(range(20, 60))]
    plain = LLM(str(tiny_llama), **kw)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(
        str(tiny_llama), draft_model=str(draft_model), draft_quantization=draft_quantization, **kw
    )
    engine = llm.engine
    assert engine.draft_runner.kv_caches.dtype == draft_kv
    cfg = engine.model_config  # the draft has the target's shapes
    int8 = kv_int8.row_bytes(cfg.head_dim, True) + kv_int8.row_bytes(cfg.head_dim, False)
    rows = {torch.int8: int8, torch.float32: 2 * 4 * cfg.head_dim}  # K and V
    per_token = cfg.num_layers * cfg.num_kv_heads * (rows[torch.int8] + rows[draft_kv])
    assert engine.snapshot()["kv_bytes_per_token"] == per_token
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert engine.speculation.stats.num_drafts > 0
    snap = engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"]

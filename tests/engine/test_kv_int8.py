"""The int8 KV cache (EngineConfig.kv_cache_dtype="int8", engine.models.kv_cache) on the default
path, an embedded GGUF's layers on the C++ kernels: the quality rule against the same model with
a float32 cache over real text, scored through one prefill and through decode steps, and the
same cache with its codes cut to 4 bits failing it; the memory accounting (scales counted: the
same bytes hold ~3.5x the tokens); a draft model's cache; the refusal where attention is not on
the C++ kernels. The invariance of a request's tokens under prefix caching, chunking and
preemption with an int8 cache: tests/e2e/test_gguf_invariance.py."""

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


def assert_rule_holds_then_breaks(name: str, monkeypatch) -> None:
    kw = dict(num_kv_blocks=2 * NUM_TOKENS // 16 + 2, enable_prefix_caching=False)
    exact = LLM(name, **kw)
    ids = held_tokens(exact.engine.tokenizer, NUM_TOKENS)
    ref_prefill, ref_decode = scores(exact, ids)
    ref_decode_span = span(ref_prefill, PREFILL, NUM_TOKENS)
    # the float32 cache's two paths agree to the last bit: every row runs the same instructions
    assert ref_decode.token_logprobs == ref_decode_span.token_logprobs
    del exact
    llm = LLM(name, kv_cache_dtype="int8", **kw)
    assert llm.engine.runner.kv_caches.dtype == torch.int8
    got_prefill, got_decode = scores(llm, ids)
    for what, ref, got in (
        ("prefill", ref_prefill, got_prefill),
        ("decode", ref_decode, got_decode),
    ):
        ok, text = verdict(ref, got)
        print(f"{name} int8 KV, {what}: {text}")
        assert ok, f"{what}: {text}"
    assert got_decode.token_logprobs == span(got_prefill, PREFILL, NUM_TOKENS).token_logprobs
    # The broken variant: the layers as their pieces (the same bits), the cache cut to 4 bits
    # after every store, before attention reads it.
    for layer in llm.engine.runner.model.layers:
        layer.fused = None
    attend = torch.ops.tandem_cpu.attend

    head_dim = llm.engine.model_config.head_dim

    def attend_4_bits(qkv, k_cache, v_cache, *args):
        cut_to_4_bits(k_cache, head_dim), cut_to_4_bits(v_cache, head_dim)
        return attend(qkv, k_cache, v_cache, *args)

    monkeypatch.setattr(torch.ops.tandem_cpu, "attend", attend_4_bits)
    broken_prefill, broken_decode = scores(llm, ids)
    for what, ref, got in (
        ("prefill", ref_prefill, broken_prefill),
        ("decode", ref_decode, broken_decode),
    ):
        ok, text = verdict(ref, got)
        print(f"{name} 4-bit KV (broken), {what}: {text}")
        assert not ok, f"{what}: {text}"


@needs_kernel
def test_smollm2_int8_cache_meets_the_quality_rule_and_a_4_bit_cache_does_not(monkeypatch):
    assert_rule_holds_then_breaks(SMOLLM2, monkeypatch)


@needs_kernel
@pytest.mark.slow
@pytest.mark.xfail(
    strict=False,  # (a known gap; the figures may move a little with the CPU's instruction set)
    reason="int8 K in groups of 32 misses the rule on Qwen2.5-Coder-0.5B: prefill perplexity "
    "x1.0184, top-1 94.0%, mean |diff| 0.098 over 1023 positions (K's outlier dims; V alone in "
    "int8 passes: x0.9966, 98.6%; K in groups of 8 passes: x0.9998, 97.1%)",
)
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct"])
def test_qwen_int8_cache_meets_the_quality_rule_and_a_4_bit_cache_does_not(name, monkeypatch):
    try:
        resolve_model(name)
    except ModelNotFoundError:
        pytest.skip(f"{name} not installed: {EMBEDDED_MODELS[name].pip_command}")
    assert_rule_holds_then_breaks(name, monkeypatch)


@needs_kernel
def test_the_same_memory_holds_3_56x_the_tokens_scales_counted():
    """SmolLM2: 30 layers, 3 kv heads of 64. float32: 30 * 2 * 3 * 64 * 4 = 46080 bytes a
    token; int8: 30 * 2 * 3 * (64 + 2 * 4) = 12960 (codes and a float32 scale per 32)."""
    budget, engines = 48 << 20, {}
    for dtype in ("auto", "int8"):
        engines[dtype] = LLM(SMOLLM2, kv_cache_memory_bytes=budget, kv_cache_dtype=dtype).engine
    snaps = {k: e.snapshot() for k, e in engines.items()}
    assert (
        snaps["auto"]["kv_cache_dtype"] == "float32" and snaps["int8"]["kv_cache_dtype"] == "int8"
    )
    assert snaps["auto"]["kv_bytes_per_token"] == 46080
    assert snaps["int8"]["kv_bytes_per_token"] == 12960
    blocks = {k: e.runner.kv_caches.shape[3] for k, e in engines.items()}
    assert blocks == {"auto": budget // (16 * 46080), "int8": budget // (16 * 12960)}  # 68, 242
    for engine in engines.values():
        assert engine.runner.kv_caches.nbytes <= budget
    assert 3.5 <= blocks["int8"] / blocks["auto"] <= 4.0


def test_int8_is_refused_where_attention_is_not_on_the_cpp_kernels(tiny_llama):
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        LLM(str(tiny_llama), quantization=None, num_kv_blocks=8, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype='bfloat16'"):
        LLM(str(tiny_llama), quantization=None, num_kv_blocks=8, kv_cache_dtype="bfloat16")
    llm = LLM(str(tiny_llama), quantization=None, num_kv_blocks=8, kv_cache_dtype="float32")
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
    row = {torch.int8: kv_int8.row_bytes(cfg.head_dim), torch.float32: 4 * cfg.head_dim}
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * (row[torch.int8] + row[draft_kv])
    assert engine.snapshot()["kv_bytes_per_token"] == per_token
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert engine.speculation.stats.num_drafts > 0
    snap = engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"]

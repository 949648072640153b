"""Quantized weights: GGUF blocks decoded exactly, the int4 kernel against its torch reference,
the GGUF loader against transformers' dequantized checkpoint, and the quality rule on real text
(with a broken variant the same rule rejects)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from quant_blocks import random_blocks

from engine import LLM, EngineConfig
from engine.models.gguf_blocks import decode
from engine.models.quantized import (
    GROUP,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedWeight,
    int4_kernel_available,
    reference_matmul,
    tandem_kernel_available,
)

needs_int4pack = pytest.mark.skipif(not int4_kernel_available(), reason="no int4 CPU kernel")
SMOLLM2 = "smollm2-135m-instruct"


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_quantize_is_within_half_a_step(bits):
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(bits))
    weight = QuantizedWeight.quantize(w, bits)
    groups = w.reshape(48, -1, GROUP)
    step = (groups.amax(-1) - groups.amin(-1)) / (2**bits - 1)
    err = (weight.dequantize() - w).abs()
    assert (err <= step.repeat_interleave(GROUP, 1) / 2 * 1.001 + 1e-6).all()
    assert weight.bits == bits
    assert err.max() > 0


def test_quantize_rejects_widths_off_the_group():
    with pytest.raises(ValueError, match="multiple of 32 to quantize, got 40"):
        QuantizedWeight.quantize(torch.randn(16, 40), 4)


@pytest.mark.parametrize("widths", [(4, 8), (4, 5), (5, 8)])
def test_mixed_widths_stack_as_segments_of_their_own_widths(widths):
    """Rows of two widths stay two segments (no widened codes); the one-matrix form torch's
    int4 kernel takes widens the narrower, exactly. Rows of one width stack into one."""
    g = torch.Generator().manual_seed(0)
    a = QuantizedWeight.quantize(torch.randn(16, 64, generator=g), widths[0])
    b = QuantizedWeight.quantize(torch.randn(32, 64, generator=g), widths[1])
    c = QuantizedWeight.quantize(torch.randn(16, 64, generator=g), widths[0])
    fused = QuantizedWeight.cat_rows([a, c, b])
    assert [(p.bits, p.out_features) for p in fused.parts] == [(widths[0], 32), (widths[1], 32)]
    want = torch.cat([a.dequantize(), c.dequantize(), b.dequantize()])
    assert torch.equal(fused.dequantize(), want)
    assert fused.merged().bits == widths[1] and torch.equal(fused.merged().dequantize(), want)
    assert QuantizedWeight.cat_rows([a, c]).bits == widths[0]


CPU_BACKENDS = [
    pytest.param(
        "tandem", marks=pytest.mark.skipif(not tandem_kernel_available(), reason="no C++ kernel")
    ),
    pytest.param("int4pack", marks=needs_int4pack),
    "dense",
]
TOLERANCE = {  # the reference's sums are float64 and in another order
    "int4pack": dict(rtol=1 / 128, atol=1e-3),  # a bf16 rounding step at most (bf16 output)
    "dense": dict(rtol=1e-5, atol=1e-5),
}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("num_rows", [1, 5, 64])
@pytest.mark.parametrize("shape", [(96, 128), (40, 96)])  # 40: a partial tile of 16 rows
def test_quantized_linear_equals_its_reference(backend, bits, num_rows, shape):
    """The tandem kernel bit for bit (its reference follows its order of float steps); the
    others within their rounding."""
    out_features, in_features = shape
    if backend == "int4pack" and out_features % 16:
        pytest.skip("torch's int4 kernel wants out_features a multiple of 16")
    g = torch.Generator().manual_seed(num_rows)
    weight = QuantizedWeight.quantize(torch.randn(*shape, generator=g) * 0.1, bits)
    bias = torch.randn(out_features, generator=g)
    x = torch.randn(num_rows, in_features, generator=g)
    layer = QuantizedLinear(weight, bias, backend=backend)
    got = layer(x)
    assert got.dtype == torch.float32
    want = reference_matmul(x, weight, backend) + bias
    if backend == "tandem":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, **TOLERANCE[backend])
    # the reference is not trivially close: against the float weights the kernels differ
    if backend != "dense":
        exact = x @ weight.dequantize().t() + bias
        assert (got - exact).abs().max() > 1e-4


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("num_rows", [1, 5, 40])
def test_a_projection_of_segments_equals_each_segments_reference(backend, num_rows):
    """A fused q/k/v as a Q4_K_M file has it (q, k in Q4_K; v in Q6_K) with a bias: the
    tandem kernel holds each segment at its own width (4-bit codes and K-quant scales, 6-bit
    codes) and gives each segment's reference bits in its columns, the bias split among them;
    torch's int4 kernel runs the merged matrix."""
    q, k = (decode(random_blocks(T.Q4_K, n, 512, seed=n), T.Q4_K, 512) for n in (64, 16))
    v = decode(random_blocks(T.Q6_K, 16, 512, seed=7), T.Q6_K, 512)
    weight = QuantizedWeight.cat_rows([q, k, v])
    g = torch.Generator().manual_seed(num_rows)
    bias = torch.randn(96, generator=g)
    x = torch.randn(num_rows, 512, generator=g)
    layer = QuantizedLinear(weight, bias, backend=backend)
    got = layer(x)
    if backend != "tandem":  # int4pack: one matrix; dense: the exact values
        one = weight.merged() if backend == "int4pack" else weight
        want = reference_matmul(x, one, backend) + bias
        torch.testing.assert_close(got, want, **TOLERANCE[backend])
        return
    assert [(s.bits, s.rows, s.codes.shape[-1]) for s in layer.segments] == [
        (4, 80, 256),
        (6, 16, 384),
    ]
    qk = QuantizedWeight.cat_rows([q, k])
    want = torch.cat([reference_matmul(x, qk, "tandem"), reference_matmul(x, v, "tandem")], 1)
    assert torch.equal(got, want + bias)
    # not what the merged matrix gives (v requantized to 8 bits there)
    assert not torch.equal(got, reference_matmul(x, weight.merged(), "tandem") + bias)


@pytest.mark.parametrize("backend", CPU_BACKENDS[:2])
@pytest.mark.parametrize(
    "qtype", [None, T.Q5_0, T.Q4_K, T.Q6_K], ids=["int4", "Q5_0", "Q4_K", "Q6_K"]
)
def test_a_rows_result_does_not_depend_on_its_batch(backend, qtype):
    """A row's result is bitwise the same whatever rows share its call: the tandem kernel at
    any row count (decode, verification, prefill chunks of any length), torch's int4 kernel
    at the few rows of decode and verification; 4-, 5- and 6-bit codes, K-quant scales alike."""
    g = torch.Generator().manual_seed(3)
    if qtype is None:
        weight = QuantizedWeight.quantize(torch.randn(64, 768, generator=g) * 0.1, 4)
    else:
        weight = decode(random_blocks(qtype, 64, 768, seed=3), qtype, 768)
    layer = QuantizedLinear(weight, None, backend=backend)
    x = torch.randn(300, 768, generator=g)
    counts = (1, 3, 8, 9, 16, 17, 100, 300) if backend == "tandem" else (1, 3, 8)
    full = layer(x[: max(counts) if backend == "tandem" else 16])
    for n in counts:
        for start in {0, 7, len(full) - n}:
            part = layer(x[start : start + n])
            assert torch.equal(part, full[start : start + n]), (n, start)


@pytest.mark.skipif(not tandem_kernel_available(), reason="no C++ kernel")
def test_float16_parameters_where_exact_and_the_same_bits_as_float32():
    """Scales and offsets all exact in float16 (a GGUF's Q4_0/Q4_1/Q8_0 blocks) are held so;
    any that is not (random float32 ones here, Q4_K's products) keeps the whole matrix in
    float32. The kernel's results are the same bits either way."""
    g = torch.Generator().manual_seed(4)
    wide = QuantizedWeight.quantize(torch.randn(48, 96, generator=g) * 0.1, 4)
    narrow = QuantizedWeight(wide.codes, wide.scales.half().float(), wide.offsets.half().float(), 4)
    assert QuantizedLinear(wide, None, backend="tandem").scales.dtype == torch.float32
    layer = QuantizedLinear(narrow, None, backend="tandem")
    assert layer.scales.dtype == layer.offsets.dtype == torch.float16
    x = torch.randn(5, 96, generator=g)
    y = torch.empty(5, 48)
    weights = [layer.codes, layer.scales.float(), layer.offsets.float()]
    torch.ops.tandem_cpu.linear_out(x, weights, [4], [48], None, y)
    assert torch.equal(layer(x), y) and torch.equal(y, reference_matmul(x, narrow, "tandem"))


ISA_CHECK = """
import itertools, sys, torch
from engine.models.quantized import (
    QuantizedEmbedding, QuantizedLinear, QuantizedWeight, SuperBlocks, reference_matmul
)
from kernels import cpu
assert cpu.load() == sys.argv[1], cpu.load()
g = torch.Generator().manual_seed(0)
weights = [QuantizedWeight.quantize(torch.randn(40, 512, generator=g) / 9, b) for b in (4, 5, 6, 8)]
for bits in (4, 5):  # K-quant scales: float16 d and dmin per 256, 6-bit sub-scales and mins
    d, neg_dmin = (torch.rand(40, 2, generator=g).half() / 50 for _ in range(2))
    sub = [torch.randint(0, 64, (40, 16), generator=g, dtype=torch.uint8) for _ in range(2)]
    codes = torch.randint(0, 2**bits, (40, 512), generator=g, dtype=torch.uint8)
    blocks = SuperBlocks(d, sub[0], -neg_dmin, sub[1])
    weights.append(QuantizedWeight.from_super_blocks(codes, blocks, bits))
d6 = (torch.rand(40, 2, generator=g) / 50).half()
sc6 = torch.randint(-128, 128, (40, 32), generator=g).to(torch.int8)  # Q6_K: a scale per 16
codes = torch.randint(0, 64, (40, 512), generator=g, dtype=torch.uint8)
weights.append(QuantizedWeight.from_super_blocks(codes, SuperBlocks(d6, sc6, None, None), 6))
for bits in (4, 5, 8):  # centered (Q4_0, Q5_0, Q8_0): float16 d alone, m = -2^(bits - 1) d
    d = (torch.rand(40, 16, generator=g) / 50).half().float()
    codes = torch.randint(0, 2**bits, (40, 512), generator=g, dtype=torch.uint8)
    weights.append(QuantizedWeight.from_codes(codes, d, -(2 ** (bits - 1)) * d, bits))
    held = QuantizedLinear(weights[-1], None, backend="tandem")
    assert held.offsets is held.scales
for weight in weights:
    layer = QuantizedLinear(weight, None, backend="tandem")
    for rows in (1, 5, 16, 33):
        x = torch.randn(rows, 512, generator=g)
        assert torch.equal(layer(x), reference_matmul(x, weight, "tandem")), (weight.bits, rows)
    ids = torch.tensor([0, 9, 39])
    got = QuantizedEmbedding(weight, "cpu", torch.float32)(ids)
    assert torch.equal(got, weight.dequantize()[ids])
# The largest integer sums: every code at its top, every activation code +-127 (a constant x);
# AVX2 adds several chunks' int16 pairs before widening them, as far as these stay below 2^15.
d = torch.full((40, 16), 1 / 64)
top = [QuantizedWeight.from_codes(torch.full((40, 512), 2**b - 1), d, -d, b) for b in (4, 5, 6, 8)]
q6_scales = torch.full((40, 32), 127).to(torch.int8)
blocks = SuperBlocks(torch.full((40, 2), 1 / 64).half(), q6_scales, None, None)
top.append(QuantizedWeight.from_super_blocks(torch.full((40, 512), 63), blocks, 6))
for weight in top:  # 9 rows: the tile kernels; 37: AVX2's paired halves (quant_rows.h)
    layer = QuantizedLinear(weight, None, backend="tandem")
    for sign, rows in itertools.product((1, -1), (9, 37)):
        x = torch.full((rows, 512), float(sign))
        assert torch.equal(layer(x), reference_matmul(x, weight, "tandem")), (weight.bits, sign)
print("ok")
"""


def _cpu_flags() -> set[str]:
    from pathlib import Path

    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.is_file() else ""
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split()}


@pytest.mark.skipif(not tandem_kernel_available(), reason="no C++ kernel")
@pytest.mark.parametrize(
    "march, isa, flag",
    [("haswell", "avx2", "avx2"), ("alderlake", "avx-vnni", "avx_vnni")],
)
def test_every_instruction_set_gives_the_references_bits(march, isa, flag):
    """The 256-bit paths (AVX2's maddubs on CPUs without VNNI, AVX-VNNI), built for this x86 CPU
    with -march and run in a fresh process, give the reference's bits, as the native build
    does: one numerics on every machine."""
    import os
    import subprocess
    import sys

    if flag not in _cpu_flags():
        pytest.skip(f"this CPU has no {flag}")
    env = {**os.environ, "TANDEM_CPU_MARCH": march}
    done = subprocess.run([sys.executable, "-c", ISA_CHECK, isa], env=env, capture_output=True)
    assert done.returncode == 0 and done.stdout.strip() == b"ok", done.stderr.decode()[-2000:]


def test_dense_backend_is_forced_by_the_environment(monkeypatch):
    """CUDA, and CPUs where neither kernel runs: the weight dequantized in the model's dtype."""
    monkeypatch.setenv("TANDEM_QUANT_KERNEL", "dense")
    g = torch.Generator().manual_seed(0)
    weight = QuantizedWeight.quantize(torch.randn(96, 128, generator=g) * 0.1, 8)
    layer = QuantizedLinear(weight, None)
    assert layer.backend == "dense"
    x = torch.randn(3, 128, generator=g)
    torch.testing.assert_close(layer(x), x @ weight.dequantize().t())
    monkeypatch.setenv("TANDEM_QUANT_KERNEL", "fast")
    with pytest.raises(ValueError, match="TANDEM_QUANT_KERNEL must be one of .* got 'fast'"):
        QuantizedLinear(weight, None)


def test_quantization_config_is_validated():
    with pytest.raises(ValueError, match="quantization must be one of .* got 'int3'"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="draft_quantization must be one of .* got 'fp8'"):
        EngineConfig(draft_model="self", draft_quantization="fp8")
    with pytest.raises(ValueError, match="quantization must be 'auto' or None, got 'int4'"):
        EngineConfig(draft_model="self", quantization="int4")


# ---- SmolLM2's own GGUF (Q4_1 projections, a Q8_0 embedding tied to the LM head) ------------
def _smollm2_dir():
    from engine.models.registry import resolve_model

    return resolve_model(SMOLLM2)


def test_gguf_weights_equal_transformers_dequantized_checkpoint():
    """The architecture's two weight maps agree module by module: every tensor its GGUF map
    gives equals what its HF map gives from the checkpoint transformers dequantized from the
    same GGUF (names, fusion, the Q/K row permutation and the block decoding alike)."""
    from engine.models.architectures import Checkpoint, architecture
    from engine.models.gguf_loader import GGUFWeights
    from engine.models.loader import _load_state, gguf_file, load_model

    path = _smollm2_dir()
    _, cfg, _ = load_model(path, quantization=None, pack_weights=False)
    arch = architecture(cfg.model_type)
    dense = {name: t for name, *t in arch.hf_weights(cfg, Checkpoint(_load_state(path)))}
    dense["lm_head"] = dense["embed_tokens"]  # tied (the HF map gives None)
    embedding = dense["embed_tokens"][0]
    compared = 0
    for name, *tensors in arch.gguf_weights(cfg, GGUFWeights(gguf_file(path))):
        for got, want in zip(tensors, dense.pop(name), strict=True):
            assert (got is None) == (want is None), name
            if got is not None:
                if isinstance(got, QuantizedWeight):
                    assert name != "embed_tokens" or got.bits == 8  # Q8_0
                    got = got.dequantize()
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
                compared += 1
    assert not dense and compared == 3 + 6 * cfg.num_layers  # every module of both maps
    model, _, _ = load_model(path, quantization="gguf")
    assert isinstance(model.embed_tokens.format, QuantizedEmbedding)
    rows = torch.arange(7, 4000, 37)
    torch.testing.assert_close(model.embed_tokens(rows), embedding[rows])
    # tied: the embedding reads the LM head's tiles (one copy of the table), bit for bit the
    # block's own values
    if tandem_kernel_available():
        assert model.embed_tokens.format.tiles[0] is model.lm_head.format.codes
    embed = GGUFWeights(gguf_file(path)).quantized("token_embd.weight")
    assert torch.equal(model.embed_tokens(rows), embed.dequantize()[rows])


def held_bytes(model) -> int:
    """Bytes of every tensor storage the model's modules hold (huge_pages.module_tensors: the
    tensors the loader moves), each storage counted once."""
    from engine.models.huge_pages import module_tensors

    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in module_tensors(model)}
    return sum(s.nbytes() for s in storages.values())


@pytest.mark.skipif(not tandem_kernel_available(), reason="no C++ kernel")
def test_smollm2_holds_its_files_bytes():
    """On the C++ kernel SmolLM2 holds exactly its GGUF's tensor bytes: the Q4_1 projections
    as 4-bit codes with their float16 d and m, the Q8_0 embedding and tied LM head once, as
    byte codes with their float16 d (m = -128 d formed by the kernel), the norms in float32;
    beside them only RoPE's inverse frequencies (head_dim / 2 floats)."""
    from engine.models.gguf_loader import read_tensors
    from engine.models.loader import gguf_file, load_model

    path = _smollm2_dir()
    model, cfg, _ = load_model(path, quantization="gguf")
    file_bytes = sum(t.data.nbytes for t in read_tensors(gguf_file(path)).values())
    assert held_bytes(model) == file_bytes + cfg.head_dim // 2 * 4


@pytest.fixture(scope="module")
def reference_scores():
    from bench.quality import held_tokens, teacher_forced

    llm = LLM(SMOLLM2, quantization=None, num_kv_blocks=400, enable_prefix_caching=False)
    ids = held_tokens(llm.engine.tokenizer, 2304)
    return ids, teacher_forced(llm, ids)


def break_zero_points(model) -> None:
    """Move every projection's group offsets by one step of its scale (a wrong GGUF offset)."""
    for layer in model.modules():
        if not isinstance(layer, QuantizedLinear):
            continue
        if layer.backend == "tandem":
            for segment in layer.segments:
                segment.offsets.add_(segment.scales)
        else:
            layer.params[..., 1] += layer.params[..., 0]  # [G, N, 2]: scale, zero


def assert_rule_holds_then_breaks(llm, ids: list[int], reference, num_positions: int) -> None:
    """llm's scores over ids meet the quality rule against reference's; with every zero point
    of its (rank 0's) model moved by one step they fail it."""
    from bench.quality import compare, teacher_forced

    report = compare(reference, teacher_forced(llm, ids))
    assert report.num_positions == num_positions
    assert report.passes, str(report)
    break_zero_points(llm.engine.runner.model)
    broken = compare(reference, teacher_forced(llm, ids))
    assert not broken.passes, str(broken)


@pytest.mark.parametrize("backend", CPU_BACKENDS[:2])
def test_native_gguf_meets_the_quality_rule_and_a_broken_zero_point_does_not(
    backend, reference_scores, monkeypatch
):
    """Perplexity within 1% and top-1 agreement >= 95% over 2303 positions of real text, against
    the fp32 dequantized reference; the same weights with every zero point moved by one step
    (the error a wrong GGUF offset makes) fail the same rule."""
    monkeypatch.setenv("TANDEM_QUANT_KERNEL", backend)
    ids, ref = reference_scores
    llm = LLM(SMOLLM2, num_kv_blocks=400, enable_prefix_caching=False)  # quantization "auto"
    model = llm.engine.runner.model
    assert model.layers[0].self_attn.qkv_proj.format.backend == backend
    assert model.lm_head.format.backend == backend
    assert_rule_holds_then_breaks(llm, ids, ref, 2303)


@pytest.mark.skipif(not tandem_kernel_available(), reason="no C++ kernel")
def test_fused_decode_meets_the_quality_rule_and_a_broken_attention_does_not(reference_scores):
    """Decode steps run each layer as one C++ call (kernels/cpu/fused_layer.cpp). Scored token
    by token through it over 400 positions of real text, the quantized model meets the quality
    rule against the fp32 reference, as the same steps through the Python layers do; the fused
    layers attending to their own token only (window 1) fail the rule."""
    from bench.quality import compare, span, teacher_forced_decode

    ids, ref = reference_scores
    ids, prefill = ids[:464], 64
    llm = LLM(SMOLLM2, num_kv_blocks=400, enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert model.fused_layers
    fused = teacher_forced_decode(llm, ids, prefill)
    report = compare(span(ref, prefill, len(ids)), fused)
    assert report.num_positions == 400
    assert report.passes, str(report)
    # The same steps through the Python layers: the same math, with sums in another order; a
    # last-bit difference can move an activation's int8 code across a rounding boundary (ties
    # are common where the embedding is Q8_0), so the two agree like two quantizations do.
    model.fused_layers = False
    unfused = teacher_forced_decode(llm, ids, prefill)
    assert compare(span(ref, prefill, len(ids)), unfused).passes
    assert compare(unfused, fused).top1_agreement >= 0.95
    model.fused_layers = True
    for layer in model.layers:
        layer.self_attn.window = 1
    model.fuse()  # the one-call stack reads the layers again
    broken = compare(span(ref, prefill, len(ids)), teacher_forced_decode(llm, ids, prefill))
    assert not broken.passes, str(broken)


def _run_staggered(llm, prompts, params) -> list[list[int]]:
    """The first request alone for two steps, then the others join: later steps carry the
    first one's decode rows beside the newcomers' prefills (fused and unfused rows split)."""
    engine = llm.engine
    engine.add_request("r0", prompts[0], params[0])
    engine.step(), engine.step()
    for i in range(1, len(prompts)):
        engine.add_request(f"r{i}", prompts[i], params[i])
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.skipif(not tandem_kernel_available(), reason="no C++ kernel")
def test_quantized_speculation_and_batching_keep_each_requests_tokens():
    """Over the GGUF's blocks (quantization "auto"), a row's numbers do not depend on what runs
    beside it: n-gram speculation (verification rows), batching with other requests and steps
    that also carry another request's prefill give each request the tokens it gets decoded
    alone without speculation, greedy and seeded sampled."""
    from engine import SamplingParams

    plain = LLM(SMOLLM2, num_kv_blocks=256, enable_prefix_caching=False)
    spec = LLM(
        SMOLLM2,
        num_kv_blocks=256,
        enable_prefix_caching=False,
        speculative_method="ngram",
        num_speculative_tokens=4,
        adaptive_speculation=False,
    )
    assert plain.engine.runner.model.fused_layers
    texts = [
        "Repeat exactly: the quick brown fox jumps over the lazy dog, twice over.",
        "Copy this list: apples, pears, plums, cherries, grapes, figs, dates.",
        "Write a haiku about the sea.",
    ]
    prompts = [plain.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    for sampled in (False, True):
        params = [
            SamplingParams(temperature=0.8, top_p=0.95, seed=3 + i, max_tokens=32)
            if sampled
            else SamplingParams(temperature=0, max_tokens=32)
            for i in range(3)
        ]
        alone = [
            plain.generate([p], q, use_tqdm=False)[0].outputs[0].token_ids
            for p, q in zip(prompts, params, strict=True)
        ]
        assert _run_staggered(plain, prompts, params) == alone
        assert _run_staggered(spec, prompts, params) == alone
    assert spec.engine.speculation.stats.num_accepted > 0


def test_self_draft_is_exact_for_greedy_and_seeded_sampling():
    """draft_model="self": SmolLM2's own Q4_1 blocks draft for its fp32 weights; greedy and
    seeded sampled outputs are plain fp32 decoding's, token for token, and most drafts hold."""
    from engine import SamplingParams

    llm = LLM(
        SMOLLM2,
        draft_model="self",
        num_kv_blocks=128,
        num_speculative_tokens=4,
        adaptive_speculation=False,  # a fixed k: the counts below do not depend on timings
    )
    plain = LLM(SMOLLM2, quantization=None, num_kv_blocks=128)
    target, draft = llm.engine.runner.model, llm.engine.draft_runner.model
    assert not isinstance(target.layers[0].self_attn.qkv_proj.format, QuantizedLinear)
    assert isinstance(draft.layers[0].self_attn.qkv_proj.format, QuantizedLinear)
    chats = [
        [{"role": "user", "content": "Explain what a hash table is in two sentences."}],
        [{"role": "user", "content": "Write a haiku about the sea."}],
    ]
    prompts = [llm.apply_chat_template(c) for c in chats]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, ignore_eos=True, seed=7)
    for params in (greedy, sampled):
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
        assert got == want
        if params is greedy:  # the quantized copy mostly agrees with the fp32 argmax
            stats = llm.engine.speculation.stats
            assert stats.num_drafts > 40 and stats.acceptance_rate > 0.75, stats.as_dict()

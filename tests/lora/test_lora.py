"""Multi-LoRA: PEFT adapters loaded from disk, served per request in mixed batches, against HF
`PeftModel` with only that adapter active on a fresh base model (greedy token ids, exactly).

Adapters are real PEFT saves (`get_peft_model(...).save_pretrained`) of tiny random models, with
A and B randomised (PEFT initialises B to zero, which would change nothing), ranks 4 / 8 / 16 and
different target modules; one uses rsLoRA scaling and an alpha_pattern.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.models.loader import load_model
from engine.models.quantized import QuantizedLinear
from lora import LoRARequest
from lora.adapter import load_adapter
from lora.batch import LoRASlots, PackedLoRABatch
from models import hf_greedy, make_adapter

ADAPTERS = {  # name: (rank, target modules, extra LoraConfig fields)
    "qv4": (4, ["q_proj", "v_proj"], {}),
    "mlp8": (8, ["gate_proj", "up_proj", "down_proj"], {"use_rslora": True}),
    "all16": (
        16,
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        {"alpha_pattern": {"o_proj": 4}},
    ),
    "ko8": (8, ["k_proj", "o_proj"], {"lora_alpha": 32}),
}
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_adapter(tiny_llama, root / name, seed, rank, targets, dict(extra))
        for seed, (name, (rank, targets, extra)) in enumerate(ADAPTERS.items())
    }


def prompts(n: int) -> list[list[int]]:
    """Random byte prompts; every other one a repeated phrase (n-gram lookup finds drafts)."""
    rng = random.Random(3)
    out = []
    for i in range(n):
        if i % 2:
            phrase = [rng.randrange(256) for _ in range(rng.randint(2, 6))]
            out.append((phrase * 10)[: rng.randint(10, 40)])
        else:
            out.append([rng.randrange(256) for _ in range(rng.randint(1, 40))])
    return out


@pytest.fixture(scope="module")
def hf_reference(tiny_llama, adapters) -> dict[str | None, list[list[int]]]:
    """Each adapter (and the base) alone in HF, on a fresh base model, over the same prompts."""
    out = {}
    for name in [None, *ADAPTERS]:
        model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
        if name is not None:
            model = PeftModel.from_pretrained(model, str(adapters[name]))
        model.eval()
        with torch.no_grad():
            out[name] = [hf_greedy(model, p, NEW_TOKENS) for p in prompts(12)]
    return out


def mixed_batch(adapters) -> list[str | None]:
    """12 requests interleaving the 4 adapters and the base model."""
    names = [None, *ADAPTERS]
    return [names[i % len(names)] for i in range(12)]


def test_mixed_batch_equals_peft(tiny_llama, adapters, hf_reference):
    llm = LLM(str(tiny_llama), num_kv_blocks=256, enable_lora=True, max_loras=4)
    names = mixed_batch(adapters)
    loras = [LoRARequest(n, str(adapters[n])) if n else None for n in names]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = llm.generate(prompts(12), params, use_tqdm=False, lora_request=loras)
    for i, (name, out) in enumerate(zip(names, outs, strict=True)):
        assert out.outputs[0].token_ids == hf_reference[name][i], (i, name)
    # Non-vacuous: each adapter's outputs differ from the base's and from every other's.
    everyone = [None, *ADAPTERS]
    for a in everyone:
        for b in everyone:
            assert a == b or hf_reference[a] != hf_reference[b], (a, b)
    snap = llm.engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"]


def test_slot_pressure_two_slots_four_adapters(tiny_llama, adapters, hf_reference):
    """max_loras=2 with 4 adapters in flight: at most 2 distinct adapters per step, every
    request completes, same outputs."""
    llm = LLM(str(tiny_llama), num_kv_blocks=256, enable_lora=True, max_loras=2)
    engine = llm.engine
    names = mixed_batch(adapters)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    for i, (prompt, name) in enumerate(zip(prompts(12), names, strict=True)):
        lora = LoRARequest(name, str(adapters[name])) if name else None
        engine.add_request(f"r{i}", prompt, params, lora_request=lora)
    seen_max, outs = 0, {}
    original = engine.runner._token_slots

    def spy(items):
        nonlocal seen_max
        seen_max = max(seen_max, len({id(it.request.lora) for it in items if it.request.lora}))
        return original(items)

    engine.runner._token_slots = spy
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
    assert seen_max == 2
    for i, name in enumerate(names):
        assert outs[f"r{i}"] == hf_reference[name][i], (i, name)
    assert engine.runner.lora_slots.num_loads > 4  # adapters took turns in the slots


@pytest.mark.parametrize("num_rows", [11, 60], ids=["packed", "segments"])
def test_lora_layer_equals_base_plus_scaled_xab(tiny_llama, adapters, num_rows):
    """The batched update over a random per-token adapter mapping equals
    base + scale * x A B row by row (scale as PEFT computes it): with few rows per adapter
    (packed slot-major) and with many (one segment per adapter)."""
    _, cfg, _ = load_model(tiny_llama)
    loaded = [load_adapter(LoRARequest(n, str(p)), cfg, 16) for n, p in adapters.items()]
    slots = LoRASlots(cfg, max_loras=4, max_rank=16)
    slot_of = slots.activate(loaded)
    g = torch.Generator().manual_seed(0)
    choice = torch.randint(0, 5, (num_rows,), generator=g).tolist()  # 0 = base
    token_slots = [slot_of[id(loaded[c - 1])] if c else 0 for c in choice]
    batch = PackedLoRABatch.build(slots, token_slots)
    if num_rows == 11:
        assert not batch.segments and batch.rows is not None
    else:
        assert len(batch.segments) >= 3
    x = torch.randn(num_rows, cfg.hidden_size, generator=g)
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    y = torch.randn(num_rows, q + 2 * kv, generator=g)
    want = y.clone()
    for t, c in enumerate(choice):
        if not c:
            continue
        adapter, config = (
            loaded[c - 1],
            json.loads((adapters[loaded[c - 1].name] / "adapter_config.json").read_text()),
        )
        for proj, offset, size in (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)):
            if (1, proj) not in adapter.weights:
                continue
            a, b = _peft_ab(adapters[adapter.name], 1, proj)  # [r, in], [out, r]
            r = a.shape[0]
            alpha = config["alpha_pattern"].get(proj, config["lora_alpha"])
            scale = alpha / r**0.5 if config.get("use_rslora") else alpha / r
            want[t, offset : offset + size] += scale * (x[t] @ a.T @ b.T)
    batch.apply(1, "qkv", x, y)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


def _peft_ab(path: Path, layer: int, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors import safe_open

    group = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    prefix = f"base_model.model.model.layers.{layer}.{group}.{proj}"
    with safe_open(str(path / "adapter_model.safetensors"), framework="pt") as f:
        return f.get_tensor(f"{prefix}.lora_A.weight"), f.get_tensor(f"{prefix}.lora_B.weight")


def test_prefix_cache_never_shared_across_adapters(tiny_llama, adapters):
    llm = LLM(str(tiny_llama), num_kv_blocks=256, enable_lora=True)
    prompt = list(range(64))  # four full blocks
    params = SamplingParams(temperature=0, max_tokens=2)
    (first,) = llm.generate(
        [prompt], params, use_tqdm=False, lora_request=LoRARequest("qv4", str(adapters["qv4"]))
    )
    (other,) = llm.generate(
        [prompt], params, use_tqdm=False, lora_request=LoRARequest("mlp8", str(adapters["mlp8"]))
    )
    (base,) = llm.generate([prompt], params, use_tqdm=False)
    (again,) = llm.generate(
        [prompt], params, use_tqdm=False, lora_request=LoRARequest("qv4", str(adapters["qv4"]))
    )
    assert [o.num_cached_tokens for o in (first, other, base, again)] == [0, 0, 0, 48]
    # A new version under the same name (new weights) shares nothing with the old one.
    llm.unload_lora("qv4")
    (reloaded,) = llm.generate(
        [prompt], params, use_tqdm=False, lora_request=LoRARequest("qv4", str(adapters["ko8"]))
    )
    assert reloaded.num_cached_tokens == 0


BAD_ADAPTERS = [
    ("dora", lambda d: _edit_config(d, use_dora=True), "DoRA adapters are not supported"),
    ("bias", lambda d: _edit_config(d, bias="all"), "bias='all' is not supported"),
    ("save", lambda d: _edit_config(d, modules_to_save=["lm_head"]), "modules_to_save"),
    (
        "pickle",
        lambda d: (d / "adapter_model.safetensors").rename(d / "adapter_model.bin"),
        "adapter_model.bin is a pickle",
    ),
    ("noconfig", lambda d: (d / "adapter_config.json").unlink(), "adapter_config.json not found"),
    ("badjson", lambda d: (d / "adapter_config.json").write_text("{"), "not valid JSON"),
    (
        "embed",
        lambda d: _add_tensor(
            d, "base_model.model.model.embed_tokens.lora_embedding_A", torch.zeros(4, 320)
        ),
        "embedding and lm_head",
    ),
    (
        "corrupt",
        lambda d: (d / "adapter_model.safetensors").write_bytes(b"garbage"),
        "cannot be read",
    ),
]


def _edit_config(d: Path, **fields) -> None:
    config = json.loads((d / "adapter_config.json").read_text())
    config.update(fields)
    (d / "adapter_config.json").write_text(json.dumps(config))


def _add_tensor(d: Path, key: str, value: torch.Tensor) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(d / "adapter_model.safetensors"))
    tensors[key] = value
    save_file(tensors, str(d / "adapter_model.safetensors"))


@pytest.mark.parametrize("case, damage, message", BAD_ADAPTERS, ids=[b[0] for b in BAD_ADAPTERS])
def test_bad_adapters_are_refused_and_the_engine_keeps_serving(
    tiny_llama, adapters, tmp_path, case, damage, message
):
    import shutil

    bad = tmp_path / case
    shutil.copytree(adapters["qv4"], bad)
    damage(bad)
    llm = LLM(str(tiny_llama), num_kv_blocks=64, enable_lora=True)
    params = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2, 3]], params, use_tqdm=False, lora_request=LoRARequest("bad", str(bad)))
    (out,) = llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    snap = llm.engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"]


def test_rank_above_max_and_lora_disabled_are_refused(tiny_llama, adapters):
    llm = LLM(str(tiny_llama), num_kv_blocks=64, enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match="rank 16 .* exceeds max_lora_rank=8"):
        llm.load_lora(LoRARequest("all16", str(adapters["all16"])))
    plain = LLM(str(tiny_llama), num_kv_blocks=64)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate(
            [[1]],
            SamplingParams(max_tokens=2),
            use_tqdm=False,
            lora_request=LoRARequest("qv4", str(adapters["qv4"])),
        )


# ---- speculation, runtime load/unload, a real model ------------------------------------------
def lora_requests(adapters, names) -> list[LoRARequest | None]:
    return [LoRARequest(n, str(adapters[n])) if n else None for n in names]


def spec_llm(tiny_llama, method: str) -> LLM:
    """Fixed k = 3; 'self': the target as its own fp32 draft model; 'quantized-self': its own
    weights in int8 draft for it (draft_model="self"), with each request's adapter."""
    spec = {
        "ngram": {"speculative_method": "ngram"},
        "self": {"draft_model": str(tiny_llama), "draft_quantization": None},
        "quantized-self": {"draft_model": "self", "draft_quantization": "int8"},
    }[method]
    return LLM(
        str(tiny_llama),
        num_kv_blocks=256,
        enable_lora=True,
        adaptive_speculation=False,
        num_speculative_tokens=3,
        **spec,
    )


@pytest.mark.parametrize("method", ["ngram", "self", "quantized-self"])
def test_speculation_with_adapters_equals_peft(tiny_llama, adapters, hf_reference, method):
    """Greedy output with speculation equals PEFT's, per adapter. With the target as its own
    draft model and the request's adapter as the draft adapter every draft is accepted; the
    statistics are kept per adapter. A quantized self-draft applies the request's adapter on
    its int8 weights by itself and is accepted most of the time."""
    llm = spec_llm(tiny_llama, method)
    names = mixed_batch(adapters)
    loras = lora_requests(adapters, names)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    drafts = loras if method == "self" else None
    outs = llm.generate(
        prompts(12), params, use_tqdm=False, lora_request=loras, draft_lora_request=drafts
    )
    for i, (name, out) in enumerate(zip(names, outs, strict=True)):
        assert out.outputs[0].token_ids == hf_reference[name][i], (i, name)
    by_adapter = llm.engine.snapshot()["speculation"]["by_adapter"]
    assert set(by_adapter) <= set(ADAPTERS) and sum(s["num_drafts"] for s in by_adapter.values())
    if method == "quantized-self":
        qkv = llm.engine.draft_runner.model.layers[0].self_attn.qkv_proj.format
        assert isinstance(qkv, QuantizedLinear) and qkv.bits == 8
        target = llm.engine.runner.model.layers[0].self_attn.qkv_proj.format
        assert not isinstance(target, QuantizedLinear)
        assert set(by_adapter) == set(ADAPTERS)
        # 0.74-1.0 per adapter here; a draft without the request's adapter accepts ~0
        assert all(s["num_accepted"] > 0.6 * s["num_drafts"] > 0 for s in by_adapter.values())
    if method == "self":
        assert set(by_adapter) == set(ADAPTERS)
        assert all(
            s["num_drafts"] > 0 and s["num_accepted"] == s["num_drafts"]
            for s in by_adapter.values()
        )


def test_triton_kernels_with_adapters_equal_peft(tiny_llama, adapters, hf_reference):
    """The Triton backend (attention and the SGMV LoRA kernels; the interpreter on CPU) with
    n-gram verification: prefill segments, 1 + k rows per request, rows without an adapter."""
    llm = LLM(
        str(tiny_llama),
        num_kv_blocks=256,
        enable_lora=True,
        max_loras=4,
        speculative_method="ngram",
        adaptive_speculation=False,
        num_speculative_tokens=3,
        attention_backend="triton",
    )
    names = mixed_batch(adapters)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = llm.generate(
        prompts(12), params, use_tqdm=False, lora_request=lora_requests(adapters, names)
    )
    for i, (name, out) in enumerate(zip(names, outs, strict=True)):
        assert out.outputs[0].token_ids == hf_reference[name][i], (i, name)
    assert llm.engine.snapshot()["speculation"]["num_drafts"] > 0


def test_prefix_cache_keys_include_the_draft_adapter(tiny_llama, adapters):
    """Blocks also hold the draft model's KV: a request whose draft adapter differs shares
    no block, one with the same target and draft adapters does."""
    llm = spec_llm(tiny_llama, "self")
    prompt, params = list(range(64)), SamplingParams(temperature=0, max_tokens=2)
    target = LoRARequest("qv4", str(adapters["qv4"]))
    cached = []
    for draft in ("qv4", "mlp8", "qv4"):
        (out,) = llm.generate(
            [prompt],
            params,
            use_tqdm=False,
            lora_request=target,
            draft_lora_request=LoRARequest(draft, str(adapters[draft])),
        )
        cached.append(out.num_cached_tokens)
    assert cached == [0, 0, 48]


def test_self_draft_without_its_adapter_misses(tiny_llama, adapters, hf_reference):
    """The broken variant of the check above: a draft model without the request's adapter
    proposes the base model's tokens, so some drafts are rejected (output stays right)."""
    llm = spec_llm(tiny_llama, "self")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    lora = LoRARequest("all16", str(adapters["all16"]))
    outs = llm.generate(prompts(12), params, use_tqdm=False, lora_request=lora)
    assert [o.outputs[0].token_ids for o in outs] == hf_reference["all16"]
    stats = llm.engine.speculation.stats
    assert stats.num_accepted < stats.num_drafts


def test_outputs_unchanged_when_other_adapters_load_and_unload_mid_run(
    tiny_llama, adapters, hf_reference
):
    llm = LLM(str(tiny_llama), num_kv_blocks=256, enable_lora=True, max_loras=2)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    for i, prompt in enumerate(prompts(12)):
        engine.add_request(
            f"r{i}", prompt, params, lora_request=LoRARequest("qv4", str(adapters["qv4"]))
        )
    outs, step = {}, 0
    while engine.has_unfinished_requests():
        step += 1
        if step == 3:  # unload the running requests' adapter: they keep it until they finish
            engine.unload_lora("qv4")
            engine.load_lora(LoRARequest("mlp8", str(adapters["mlp8"])))
        if step == 5:
            engine.add_request(
                "late",
                prompts(12)[0],
                params,
                lora_request=LoRARequest("ko8", str(adapters["ko8"])),
            )
            engine.unload_lora("mlp8")
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
    assert [outs[f"r{i}"] for i in range(12)] == hf_reference["qv4"]
    assert outs["late"] == hf_reference["ko8"][0]
    assert set(engine.adapters) == {"ko8"}
    with pytest.raises(ValueError, match="no LoRA adapter named 'qv4'"):
        engine.unload_lora("qv4")


def test_cpu_adapter_cache_is_lru_bounded(tiny_llama, adapters):
    llm = LLM(str(tiny_llama), num_kv_blocks=64, enable_lora=True, max_loras=1, max_cpu_loras=2)
    for name in ("qv4", "mlp8", "qv4", "ko8"):
        llm.load_lora(LoRARequest(name, str(adapters[name])))
    assert list(llm.engine.adapters) == ["qv4", "ko8"]


def test_cpu_adapter_cache_never_drops_a_held_or_the_new_adapter(tiny_llama, adapters):
    """Past max_cpu_loras only adapters nobody holds are forgotten: neither one a request in
    flight holds nor the one being loaded (which its request is about to hold)."""
    kwargs = dict(num_kv_blocks=64, enable_lora=True, max_loras=1, max_cpu_loras=1)
    engine = LLM(str(tiny_llama), **kwargs).engine
    lora = {name: LoRARequest(name, str(adapters[name])) for name in ("qv4", "mlp8", "ko8")}
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("held", [1, 2, 3], params, lora_request=lora["qv4"])
    new = engine.load_lora(lora["mlp8"])
    assert list(engine.adapters) == ["qv4", "mlp8"] and new.name == "mlp8"
    while engine.has_unfinished_requests():
        engine.step()
    engine.load_lora(lora["ko8"])  # nothing held now: back within capacity, LRU first
    assert list(engine.adapters) == ["ko8"]


def test_smollm2_mixed_adapters_equal_peft(tmp_path):
    """Real weights: four adapters on SmolLM2-135M (ranks 4 / 8 / 16 / 8, different targets)
    and the base model interleaved in one batch of 12, each request equal to HF PeftModel with
    only its adapter on a fresh base model."""
    from engine.models.registry import resolve_model

    base = resolve_model("smollm2-135m-instruct")
    paths = {
        name: make_adapter(base, tmp_path / name, 10 + i, rank, targets, dict(extra))
        for i, (name, (rank, targets, extra)) in enumerate(ADAPTERS.items())
    }
    llm = LLM("smollm2-135m-instruct", quantization=None, num_kv_blocks=128, enable_lora=True)
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time",
        "The three primary colours are",
    ]
    ids = [llm.tokenizer.encode(t) for t in texts]
    names = mixed_batch(paths)
    chosen = [ids[i % 4] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    outs = llm.generate(chosen, params, use_tqdm=False, lora_request=lora_requests(paths, names))
    got = {n: {} for n in names}
    for i, name in enumerate(names):
        got[name][i] = outs[i].outputs[0].token_ids
    for name in got:
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        if name:
            model = PeftModel.from_pretrained(model, str(paths[name]))
        model.eval()
        for i, tokens in got[name].items():
            with torch.no_grad():
                assert tokens == hf_greedy(model, chosen[i], 8), (i, name)
    # Adapters matter: the same prompt gives different tokens under different adapters.
    same_prompt = [outs[i].outputs[0].token_ids for i in range(12) if i % 4 == 0]  # 0, 4, 8
    assert len({tuple(t) for t in same_prompt}) == 3


def test_adapter_files_are_hashed_once_per_state(tiny_llama, tmp_path, monkeypatch):
    """An adapter's version (sha256 of its config and weights, as before) is hashed once per
    state of its files: loading it again, as a client's load / unload loop over HTTP does,
    reads no bytes to hash while the files are unchanged (issue 41, point 7: each load hashed
    the whole file); a rewrite is hashed again, and new weights are a new version."""
    import hashlib

    import lora.adapter as adapter_module

    path = make_adapter(tiny_llama, tmp_path / "a", 0, 4, ["q_proj"], {})
    config, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
    hashed = []
    real = adapter_module.hash_files
    monkeypatch.setattr(adapter_module, "hash_files", lambda f: hashed.append(f) or real(f))
    llm = LLM(str(tiny_llama), num_kv_blocks=32, enable_lora=True, num_threads=1)
    request = LoRARequest("a", str(path))
    first = llm.engine.load_lora(request).version
    whole = hashlib.sha256(config.read_bytes() + weights.read_bytes()).hexdigest()[:16]
    assert first == whole and len(hashed) == 1
    for _ in range(5):
        llm.engine.unload_lora("a")
        assert llm.engine.load_lora(request).version == first
    assert len(hashed) == 1
    llm.engine.unload_lora("a")
    weights.write_bytes(weights.read_bytes())  # the same bytes, written again
    assert llm.engine.load_lora(request).version == first and len(hashed) == 2
    llm.engine.unload_lora("a")
    make_adapter(tiny_llama, path, 1, 4, ["q_proj"], {})  # other weights, same place
    assert llm.engine.load_lora(request).version != first and len(hashed) == 3


def _run_one(engine, request_id, prompt, params, **kwargs):
    """One request through the engine's own loop: its finished output."""
    engine.add_request(request_id, prompt, params, **kwargs)
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out


def test_a_salt_naming_an_adapter_never_meets_its_blocks(tiny_llama, adapters):
    """Issue 41, finding 3: a base-model request whose cache_salt was an adapter's cache key
    (its name and version: computable offline for a seeded adapter) hashed like that adapter's
    requests, so it read the KV they left (and could plant its own for them). Now such a salt is
    refused (control characters), and one without them hashes apart all the same."""
    from engine.errors import ParamError

    llm = LLM(str(tiny_llama), num_kv_blocks=64, enable_lora=True, num_threads=1)
    lora = LoRARequest("qv4", str(adapters["qv4"]))
    key = llm.engine.load_lora(lora).cache_key.decode()
    prompt, params = list(range(10, 50)), SamplingParams(temperature=0, max_tokens=1)
    _run_one(llm.engine, "adapter", prompt, params, lora_request=lora)
    again = _run_one(llm.engine, "adapter-again", prompt, params, lora_request=lora)
    assert again.num_cached_tokens == 32  # its blocks are cached: a colliding salt would hit
    for i, salt in enumerate([key, key.lstrip("\x00"), key + "x"]):
        try:
            out = _run_one(llm.engine, f"base-{i}", prompt, params, cache_salt=salt)
        except ParamError as exc:
            assert exc.param == "cache_salt"
            continue
        assert out.num_cached_tokens == 0, salt
    snap = llm.engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"]

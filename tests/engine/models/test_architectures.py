"""The architecture registry (engine/models/architectures.py)."""

from __future__ import annotations

import pytest

from engine import LLM
from engine.models.architectures import MODULES, Architecture, architecture


@pytest.mark.parametrize("model_type", sorted(MODULES))
def test_every_registered_type_resolves_to_its_architecture(model_type):
    arch = architecture(model_type)
    assert isinstance(arch, Architecture)
    assert all(callable(f) for f in (arch.config, arch.build, arch.hf_weights, arch.gguf_weights))


def test_an_unknown_architecture_is_refused_by_name(tmp_path):
    """A checkpoint of an architecture nobody registered (GPT-2's config): a ValueError naming
    its model_type and listing what is supported, before any weight is read."""
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported; supported: \["):
        LLM(str(tmp_path), num_kv_blocks=8)

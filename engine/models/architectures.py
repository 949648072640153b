"""The architecture registry: an HF `model_type` -> the module that implements it, imported
when first asked for. An architecture is one small module (engine/models/llama.py is the model)
that gives its config mapping, its weight maps (HF checkpoint names and GGUF tensor names to
the model's modules) and its decoder layer, built from the shared layers of
engine/models/layers.py; adding one is a module and a line here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

MODULES = {
    "llama": "engine.models.llama",
    "mistral": "engine.models.llama",
    "qwen2": "engine.models.llama",
    "qwen3": "engine.models.qwen3",
    "gemma3_text": "engine.models.gemma3",
    "phi3": "engine.models.phi3",
}
# A GGUF's general.architecture -> the model_type transformers reads it as.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}

# A weight map yields (module name, tensors...) for CausalLM.load_weight: a Linear's (weight,
# bias or None), a norm's or the embedding's (weight,), the LM head's (weight or None: tied).
WeightMap = Iterator[tuple]


@dataclass(frozen=True)
class Architecture:
    config: Callable  # (HF PretrainedConfig) -> engine.models.config.ModelConfig
    build: Callable  # (ModelConfig, HF config, context, Parallel) -> models.causal_lm.CausalLM
    hf_weights: Callable[..., WeightMap]  # (ModelConfig, Checkpoint)
    gguf_weights: Callable[..., WeightMap]  # (ModelConfig, engine.models.gguf_loader.GGUFWeights)


def architecture(model_type: str) -> Architecture:
    if model_type not in MODULES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported: {sorted(MODULES)}"
        )
    return importlib.import_module(MODULES[model_type]).ARCHITECTURES[model_type]


def model_config(hf):  # -> ModelConfig
    """An HF config's shape, as its architecture maps it."""
    return architecture(hf.model_type).config(hf)


class Checkpoint:
    """An HF checkpoint's tensors by name (without the "model." prefix), each taken once."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def take(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"weights do not match the model: the checkpoint has no {name!r}")
        return self.tensors.pop(name)

    def cat(self, names: list[str]) -> torch.Tensor:
        """Tensors stacked by rows (fused projections)."""
        return torch.cat([self.take(n) for n in names])

    def drop(self, name: str) -> None:
        self.tensors.pop(name, None)

    def check_all_taken(self) -> None:
        left = [k for k in self.tensors if not k.endswith("rotary_emb.inv_freq")]
        if left:
            raise ValueError(f"unexpected weights in checkpoint: {left[:5]}")

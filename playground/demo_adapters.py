"""Two small PEFT LoRA adapters for the playground when none are given: seeded random weights on
q_proj/v_proj, written in PEFT's file format (adapter_config.json + adapter_model.safetensors)
and loaded through the same path as any user adapter. They change what the model says, not
what it knows: they are there so a visitor can watch adapters share a batch."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.models.registry import cache_dir, resolve_model
from lora.adapter import LoRARequest

DEMO_ADAPTERS = {"demo-lora-a": (1, 8), "demo-lora-b": (2, 4)}  # name -> (seed, rank)
_SCALE = 0.06  # B's spread: enough to change greedy continuations, not to break the text


def write_demo_adapters(model: str) -> dict[str, LoRARequest]:
    raw = (resolve_model(model, dense=False) / "config.json").read_bytes()
    config = json.loads(raw)
    # Keyed by the model's config too: another model with the same directory name gets its own.
    folder = f"{Path(model).name}-{hashlib.sha256(raw).hexdigest()[:8]}"
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    out = {"q_proj": heads * head_dim, "v_proj": config["num_key_value_heads"] * head_dim}
    adapters = {}
    for name, (seed, rank) in DEMO_ADAPTERS.items():
        path = cache_dir() / "demo-adapters" / folder / name
        if not (path / "adapter_model.safetensors").exists():
            path.mkdir(parents=True, exist_ok=True)
            g = torch.Generator().manual_seed(seed)
            tensors = {}
            for layer in range(config["num_hidden_layers"]):
                for proj, out_dim in out.items():
                    key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
                    a = torch.randn(rank, hidden, generator=g) / hidden**0.5
                    b = torch.randn(out_dim, rank, generator=g) * _SCALE
                    tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
            save_file(tensors, str(path / "adapter_model.safetensors"))
            peft_config = {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": model,
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": list(out),
                "lora_dropout": 0.0,
                "bias": "none",
            }
            (path / "adapter_config.json").write_text(json.dumps(peft_config, indent=1))
        adapters[name] = LoRARequest(name, str(path))
    return adapters

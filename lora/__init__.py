"""Multi-LoRA serving: PEFT adapters per request, batched in one forward pass."""

from lora.adapter import LoRARequest

__all__ = ["LoRARequest"]

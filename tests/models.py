"""Tiny random HF checkpoints (Llama / Qwen2 / Qwen3 / Gemma 3 / Mistral / Phi-3) with a byte-level
tokenizer, and PEFT adapters for them, for tests.

Weights are drawn with a large std so logits are peaked: argmax ties cannot flip between our
kernels and HF's, which makes exact token-id parity a fair test.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

VOCAB = 320  # 256 bytes + specials, padded


def byte_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return fast


def make_tiny_model(path: Path, arch: str = "llama", seed: int = 0, std: float = 0.5, **kw) -> Path:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        eos_token_id=256,
        bos_token_id=None,
        pad_token_id=None,
    )
    common.update(kw)
    cls = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "gemma3": Gemma3TextConfig,
        "mistral": MistralConfig,
        "phi3": Phi3Config,
    }[arch]
    if arch == "qwen2":
        common.setdefault("tie_word_embeddings", False)
    config = cls(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1:
                p.normal_(0.0, 0.2)
            else:
                p.normal_(0.0, std / p.shape[-1] ** 0.5 * 4)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """HF `generate()` greedy ids for exactly n new tokens (EOS masked like min_tokens=n)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),  # never infer padding from token ids
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=model.config.eos_token_id,
    )
    return out[0, len(prompt) :].tolist()


def make_adapter(base: Path, out: Path, seed: int, rank: int, targets, extra: dict) -> Path:
    """A PEFT LoRA adapter on `base` with random (seeded) A and B, saved to `out`."""
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=extra.pop("lora_alpha", 16),
        target_modules=targets,
        lora_dropout=0.0,
        **extra,
    )
    peft_model = get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    peft_model.save_pretrained(str(out))
    return out


def prompt_scores(llm, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence's log-probability of its own next token at every position (the engine's
    prompt logprobs): [len - 1] per sequence."""
    from engine import SamplingParams

    outs = llm.generate(seqs, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [
        torch.tensor([lp[t].logprob for t, lp in zip(s[1:], o.prompt_logprobs[1:], strict=True)])
        for s, o in zip(seqs, outs, strict=True)
    ]

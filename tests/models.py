"""Tiny random HF checkpoints (Llama / Qwen2 / Qwen3 / Gemma 3 / Mistral / Phi-3) with a byte-level
tokenizer, and PEFT adapters for them, for tests.

Weights are drawn with a large std so logits are peaked: argmax ties cannot flip between our
kernels and HF's, which makes exact token-id parity a fair test.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
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


# Qwen3's own chat template (Qwen/Qwen3-0.6B's tokenizer_config.json), and the tokens it and the
# model's answers use, added to the byte tokenizer (Qwen3's vocabulary holds them as single
# tokens too; `<think>` and `</think>` are not special there, so decoding keeps them).
QWEN3_TEMPLATE = Path(__file__).with_name("qwen3_chat_template.jinja")
QWEN3_SPECIAL = ["<|im_start|>", "<|im_end|>"]
QWEN3_TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


def make_thinking_qwen3(path: Path, seed: int = 0) -> Path:
    """A tiny random Qwen3 whose tokenizer speaks Qwen3's chat format: its real chat template,
    `<|im_start|>` / `<|im_end|>` (the end of a turn, its EOS) and the think and tool-call tags
    as single tokens (ids 257...262)."""
    make_tiny_model(
        path, "qwen3", seed=seed, head_dim=32, eos_token_id=258, max_position_embeddings=2048
    )
    tok = byte_tokenizer()
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN3_SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_TAGS])
    tok.eos_token = "<|im_end|>"
    tok.chat_template = QWEN3_TEMPLATE.read_text().rstrip("\n")
    tok.save_pretrained(path)
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


# The engine settings each architecture's HF-parity tests run through.
PARITY_ENGINES = [
    dict(num_kv_blocks=128),
    dict(num_kv_blocks=128, enable_prefix_caching=True, max_num_batched_tokens=7),
    dict(num_kv_blocks=48, block_size=4),  # preempted and recomputed
    dict(num_kv_blocks=128, speculative_method="ngram", num_speculative_tokens=3),
]
PARITY_IDS = ["batched", "prefix-cache-chunks", "preemption", "ngram"]


def parity_prompts(seed: int, lens=(1, 9, 17, 40, 130)) -> list[list[int]]:
    """Random byte prompts of the given lengths, then two sharing a 24-token prefix (one with
    a repeated tail, for n-gram drafts)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 256, (24,), generator=g).tolist()
    out = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]
    return out + [shared + [7, 8, 9], shared + [7, 8, 9] * 4]


def engine_greedy(model_dir, prompts, new_tokens: int, **engine_args) -> list[list[int]]:
    """The engine's greedy ids, exactly new_tokens per prompt; every block back in the pool
    after, and at block_size 4 (PARITY_ENGINES' preemption row) at least one preemption."""
    from engine import LLM, SamplingParams

    llm = LLM(str(model_dir), **engine_args)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens)
    outs = llm.generate(prompts, params, use_tqdm=False)
    snap = llm.engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"]
    if engine_args.get("block_size") == 4:
        assert snap["num_preemptions"] > 0
    return [o.outputs[0].token_ids for o in outs]


def adapter_greedy_and_peft(model_dir, targets, prompts, new_tokens: int, tmp_path):
    """(the engine's greedy ids with a seeded rank-8 PEFT adapter on `targets`, PEFT's own)."""
    from peft import PeftModel

    from engine import LLM, SamplingParams
    from lora import LoRARequest

    path = make_adapter(model_dir, tmp_path / "adapter", 3, 8, targets, {})
    llm = LLM(str(model_dir), num_kv_blocks=128, enable_lora=True)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=LoRARequest("a", str(path)))
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(path)).eval()
    with torch.no_grad():
        want = [hf_greedy(peft, p, new_tokens) for p in prompts]
    return [o.outputs[0].token_ids for o in outs], want

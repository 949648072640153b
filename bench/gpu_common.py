"""What bench.gpu's parts share: where they run (device and dtype), timing, the model shapes and
workload sizes, and the random-weight model directories they load.

`use_cpu()` (--smoke) rebinds DEV and DTYPE, so the parts read them through this module
(`common.DEV`) when they run: a name imported from here would keep CUDA's values.
"""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path

import torch

MODELS = {
    "smollm2": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
    "micro": dict(  # --smoke only
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=512,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    ),
}
# Workload sizes; --smoke swaps in SMOKE.
SIZES = dict(
    attention=(32, 32, 8, [1024, 4096, 16384, 32768]),  # requests, q heads, kv heads, contexts
    lora=(64, 16),  # rows, rank
    verify=(64, 4),  # requests, drafts each
    decode=(512, 128),  # prompt, new tokens
    sweep=(128, 128, [1, 8, 32, 128], 4),  # prompt, new tokens, batch sizes, hf_seq requests
)
SMOKE = dict(
    attention=(2, 4, 2, [64, 128]),
    lora=(16, 8),
    verify=(4, 2),
    decode=(32, 8),
    sweep=(16, 8, [1, 2], 2),
)


# Where it runs: CUDA in bf16; --smoke: CPU in fp32 at toy sizes, to check the code itself
# before a GPU session spends its time on it.
DEV, DTYPE = "cuda", torch.bfloat16


def use_cpu() -> None:
    """--smoke: CPU in fp32 at toy sizes, Triton's interpreter for the kernels."""
    global DEV, DTYPE
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    DEV, DTYPE = "cpu", torch.float32
    SIZES.update(SMOKE)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def free_cached() -> None:
    """Gives the last engine's KV pool and graphs back before the next one sizes its own from
    free memory (collected first, in case a reference cycle still holds them)."""
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()


def do_bench(fn) -> float:
    """Median milliseconds: CUDA events with the L2 flushed between calls (CPU: 3 calls)."""
    if DEV != "cuda":
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return sorted(times)[1]
    from triton.testing import do_bench as triton_bench

    return triton_bench(fn, warmup=25, rep=200, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(1 << (30 if DEV == "cuda" else 24), dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def make_model_dir(root: Path, name: str) -> Path:
    """A random-weight Llama in bf16 with a word-level tokenizer ("<i>" for every id)."""
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    path = root / name
    shapes = MODELS[name]
    config = LlamaConfig(
        **shapes,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    with torch.device(DEV):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPE)
    model.save_pretrained(path)
    vocab = {f"<{i}>": i for i in range(shapes["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<2>", bos_token="<1>").save_pretrained(
        path
    )
    del model
    free_cached()
    return path


def param_bytes(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open is no dict)
                t = st.get_slice(key)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += DTYPE.itemsize * n
    return total

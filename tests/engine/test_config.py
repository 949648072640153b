"""EngineConfig refuses every bad value with an error naming the field."""

from __future__ import annotations

import math

import pytest

from engine.config import EngineConfig

INVALID = [
    ("block_size", 0),
    ("block_size", True),
    ("max_num_seqs", "8"),
    ("max_num_batched_tokens", -1),
    ("max_model_len", 0),
    ("kv_cache_memory_bytes", 1.5),
    ("num_kv_blocks", 1),
    ("num_threads", 0),
    ("num_scheduler_steps", 0),
    ("num_scheduler_steps", 65),
    ("speculative_method", "medusa"),
    ("quantization", "int3"),
    ("draft_quantization", "fp8"),
    ("num_speculative_tokens", 16),
    ("num_speculative_tokens", -1),
    ("ngram_min", 0),
    ("suffix_max_tree_depth", 0),
    ("suffix_max_spec_factor", 0),
    ("suffix_min_token_prob", 1.5),
    ("suffix_max_cached_tokens", 2.5),
    ("ngram_max", 2.0),
    ("max_loras", 0),
    ("max_lora_rank", None),
    ("max_cpu_loras", 0),
    ("grammar_cache_size", 0),
    ("grammar_compile_timeout", 0),
    ("grammar_compile_timeout", math.nan),
    ("kv_cache_memory_fraction", 0.95),
    ("gpu_memory_utilization", 0),
    ("dtype", "float64"),
    ("kv_cache_dtype", "int4"),
    ("kv_cache_dtype", None),
    ("device", "tpu"),
    ("device", 0),
]


@pytest.mark.parametrize(("name", "value"), INVALID, ids=[f"{n}={v!r}" for n, v in INVALID])
def test_invalid_value_names_the_field(name, value):
    with pytest.raises(ValueError, match=f"^{name} ") as err:
        EngineConfig(**{name: value})
    assert f"got {value!r}" in str(err.value)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"speculative_method": "draft"}, "needs draft_model"),
        ({"draft_model": "self", "quantization": "int4"}, "must be 'auto' or None"),
        ({"draft_model": "x", "speculative_method": "ngram"}, "speculative_method is 'ngram'"),
        ({"ngram_min": 3, "ngram_max": 2}, "1 <= ngram_min <= ngram_max"),
        ({"max_loras": 4, "max_cpu_loras": 3}, r"max_cpu_loras must be an integer >= max_loras"),
    ],
)
def test_fields_that_contradict_each_other(fields, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(**fields)


def test_defaults_and_edges_accepted():
    EngineConfig()
    EngineConfig(num_kv_blocks=2, num_speculative_tokens=15, grammar_compile_timeout=3600)
    EngineConfig(device="cpu", kv_cache_memory_fraction=0.9, max_loras=2, max_cpu_loras=2)

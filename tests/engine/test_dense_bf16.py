"""Dense bfloat16 weights on CPU (`quantization=None, dtype="bfloat16"`, `tandem serve --dtype
bfloat16`): an approximate mode, so it gets the quality rule (bench.quality: perplexity within
1% of the float32 reference, top-1 agreement at least 95%) over a held real text, through one
prefill; the same model with its weights cut to 3 mantissa bits fails the same rule."""

from __future__ import annotations

import torch

from bench.quality import compare, held_tokens, teacher_forced
from engine import LLM

SMOLLM2 = "smollm2-135m-instruct"
NUM_TOKENS = 512


def cut_mantissa(llm: LLM, bits: int) -> None:
    """Every bf16 weight of the model rounded down to `bits` of its 7 mantissa bits."""
    mask = torch.tensor(~((1 << (7 - bits)) - 1), dtype=torch.int16)
    with torch.no_grad():
        for p in llm.engine.runner.model.parameters():
            if p.dtype == torch.bfloat16:
                p.copy_((p.view(torch.int16) & mask).view(torch.bfloat16))


def test_bf16_dense_passes_the_quality_rule_and_a_cut_copy_fails():
    kw = dict(quantization=None, enable_prefix_caching=False)
    exact = LLM(SMOLLM2, dtype="float32", **kw)
    ids = held_tokens(exact.engine.tokenizer, NUM_TOKENS)
    reference = teacher_forced(exact, ids)
    del exact
    llm = LLM(SMOLLM2, dtype="bfloat16", **kw)
    assert next(llm.engine.runner.model.parameters()).dtype == torch.bfloat16
    report = compare(reference, teacher_forced(llm, ids))
    assert report.passes, report
    assert report.top1_agreement < 1.0  # not the float32 model under another name
    cut_mantissa(llm, 3)
    broken = compare(reference, teacher_forced(llm, ids))
    assert not broken.passes, broken


def test_serve_takes_dtype():
    import argparse

    import pytest

    from playground.launch import add_server_args, engine_config

    parser = argparse.ArgumentParser()
    add_server_args(parser, 8000)
    assert engine_config(parser.parse_args([]), {}).dtype == "auto"
    flags = ["--dtype", "bfloat16", "--quantization", "none"]
    config = engine_config(parser.parse_args(flags), {})
    assert (config.dtype, config.quantization, config.torch_dtype) == (
        "bfloat16", None, torch.bfloat16,
    )  # fmt: skip
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "bf16"])

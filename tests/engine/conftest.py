"""Fixtures of the engine's tests."""

from __future__ import annotations

import pytest
from grammar_cases import params, prompts

from engine import LLM


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Constrained greedy without any speculation: no proposer, no forced tokens."""
    llm = LLM(str(tiny_llama), num_kv_blocks=512, grammar_forced_tokens=False)
    outs = llm.generate(prompts(36), params(36), use_tqdm=False)
    assert llm.engine.speculation.stats.num_drafts == 0
    return [o.outputs[0].token_ids for o in outs]

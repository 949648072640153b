"""Decode and verification steps from static buffers (engine/cuda_graphs.py).

On CPU the padded static-buffer forward runs eagerly under Triton's interpreter: the engine's
greedy tokens must not change when steps go through it (batch padding, query padding under
speculation, a draft model's steps). On CUDA (`gpu` marker) the captured graphs must replay to
the same tokens as eager execution.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cuda_graphs import batch_sizes

PROMPTS = [
    [5 + i for i in range(37)],
    [7, 8, 9, 7, 8, 9, 7, 8],  # repeats: n-gram drafts for this one, few for the others
    [3],
    list(range(40, 60)) * 2,
    [11, 12, 13, 14, 11, 12, 13],
]


def test_batch_sizes():
    assert batch_sizes(1) == [1]
    assert batch_sizes(8) == [1, 2, 4, 8]
    assert batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = batch_sizes(128)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-2:] == [120, 128] and len(sizes) == 19


def generate(model, graphs: bool, **engine_args) -> tuple[list[list[int]], LLM]:
    llm = LLM(
        str(model),
        num_kv_blocks=64,
        max_num_seqs=8,
        attention_backend="triton",
        **engine_args,
    )
    if graphs:
        for runner in filter(None, (llm.engine.runner, llm.engine.draft_runner)):
            runner.use_graphs(8, llm.engine.max_model_len, 4)
    # Per-request k: the verification steps mix query lengths 1 to 4.
    params = [
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, num_speculative_tokens=k)
        for k in (None, 1, 0, 3, 2)
    ]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("spec", [None, "draft"])
def test_static_buffers_keep_greedy_tokens(tiny_llama, draft_model, spec):
    """5 requests padded to a batch of 8 (and fewer as they finish); under speculation each
    request verifies its own k drafts, so its tokens are padded to the step's longest, and the
    draft model's catch-up passes differ in length too. Tokens equal the plain Triton path's."""
    args = {}
    if spec == "draft":
        args = dict(
            draft_model=str(draft_model),
            draft_quantization=None,
            num_speculative_tokens=3,
            adaptive_speculation=False,
        )
    want, _ = generate(tiny_llama, False, **args)
    got, llm = generate(tiny_llama, True, **args)
    assert got == want
    assert llm.engine.runner.graphs.num_replays > 0
    if spec == "draft":
        assert llm.engine.draft_runner.graphs.num_replays > 0
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_usable


def test_prediction_steps_longer_than_the_graphs_run_outside_them(tiny_llama):
    """Graphs are sized for a proposer's k (none here: 1 query token); a prediction's step of
    up to 31 drafts does not fit them and takes the ordinary path, the steps after it the static
    buffers again. The first three requests predict their own answer (all 9 tokens after the
    prompt's in one step of 8 drafts), the last two none: tokens equal the plain Triton path's,
    and the 8 steps left to those two come from the static buffers."""
    want, _ = generate(tiny_llama, False)
    llm = LLM(str(tiny_llama), num_kv_blocks=64, max_num_seqs=8, attention_backend="triton")
    llm.engine.runner.use_graphs(8, llm.engine.max_model_len, 1)
    params = [
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prediction=p)
        for p in [*want[:3], None, None]
    ]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert [o.outputs[0].token_kinds for o in outs[:3]] == ["p" + "a" * 8 + "b"] * 3
    assert llm.engine.runner.graphs.num_replays == 8


def test_graphs_need_the_triton_backend(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=16, attention_backend="torch")
    with pytest.raises(ValueError, match="Triton attention backend"):
        llm.engine.runner.use_graphs(4, 64, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", [None, "ngram"])
def test_captured_graphs_replay_eager_tokens(tiny_llama, spec):
    """On CUDA the engine captures graphs at start; replaying them gives the tokens of the same
    padded forward run eagerly, and of an engine that never uses graphs."""
    # float32: eager steps run their matmuls at the real row count, graphs at the padded
    # batch; in bf16 a different cuBLAS algorithm could flip a near-tie.
    common = dict(
        num_kv_blocks=64,
        max_num_seqs=8,
        speculative_method=spec,
        num_speculative_tokens=3,
        dtype="float32",
    )
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def run(llm):
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    llm = LLM(str(tiny_llama), **common)
    graphs = llm.engine.runner.graphs
    # One graph per batch size and query length: 1, or 1 + k under speculation.
    assert len(graphs.graphs) == len(batch_sizes(8)) * (4 if spec else 1)
    with_graphs = run(llm)
    assert graphs.num_replays > 0
    graphs.graphs.clear()  # the same static buffers and padding, eagerly
    assert run(llm) == with_graphs
    eager = LLM(str(tiny_llama), enforce_eager=True, **common)
    assert eager.engine.runner.graphs is None
    assert run(eager) == with_graphs

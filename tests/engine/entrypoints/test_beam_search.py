"""Beam search: HF `generate(num_beams=...)`'s sequences and scores, beams sharing KV blocks
copy-on-write, and every block back in the pool afterwards."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, BeamSearchParams
from engine.errors import ParamError

PROMPTS = [[65, 66, 67, 68], [10, 20, 30], [100] * 20, list(range(40, 77))]


def hf_beams(path, prompt: list[int], width: int, max_tokens: int, length_penalty=1.0):
    """HF's returned sequences (generated part, cut after an EOS) and their scores."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    out = model.generate(
        torch.tensor([prompt]),
        num_beams=width,
        num_return_sequences=width,
        max_new_tokens=max_tokens,
        do_sample=False,
        early_stopping=False,
        length_penalty=length_penalty,
        output_scores=True,
        return_dict_in_generate=True,
    )
    sequences = []
    for seq in out.sequences.tolist():
        seq = seq[len(prompt) :]
        end = next((i + 1 for i, t in enumerate(seq) if t in eos), len(seq))
        sequences.append(seq[:end])
    if width > 1:
        return sequences, out.sequences_scores.tolist()
    # One beam: HF decodes greedily and scores nothing; the score is the same rule's.
    logprobs = [torch.log_softmax(step[0].float(), -1) for step in out.scores]
    total = sum(lp[t].item() for lp, t in zip(logprobs, sequences[0], strict=False))
    return sequences, [total / len(sequences[0]) ** length_penalty]


def assert_equal_hf(llm: LLM, path, prompts, width, max_tokens, length_penalty=1.0):
    outs = llm.beam_search(prompts, BeamSearchParams(width, max_tokens, length_penalty))
    for prompt, out in zip(prompts, outs, strict=True):
        want, scores = hf_beams(path, prompt, width, max_tokens, length_penalty)
        assert [s.token_ids for s in out.sequences] == want
        assert [s.score for s in out.sequences] == pytest.approx(scores, abs=1e-4)
    snap = llm.engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"] and not llm.engine.scheduler.held
    return outs


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("width", [1, 3, 4])
def test_equals_hf_on_tiny_models(request, arch, width):
    path = request.getfixturevalue(arch)
    llm = LLM(str(path), num_kv_blocks=512)
    outs = assert_equal_hf(llm, path, PROMPTS, width, 12)
    if width == 1:  # one beam is greedy decoding
        greedy = llm.generate(PROMPTS, [_greedy(12)] * len(PROMPTS), use_tqdm=False)
        assert [o.sequences[0].token_ids for o in outs] == [g.outputs[0].token_ids for g in greedy]


def _greedy(max_tokens: int):
    from engine import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def eos_model(tiny_llama, tmp_path_factory):
    """The tiny Llama with a frequent token as its EOS: beams end early, finished hypotheses
    compete with live beams, and the early-stopping rule decides when the search ends."""
    path = tmp_path_factory.mktemp("beam-eos") / "model"
    shutil.copytree(tiny_llama, path)
    config = json.loads((path / "generation_config.json").read_text())
    config["eos_token_id"] = [203, 296, 256]  # 203 and 296 are frequent in these beams
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


def test_eos_and_length_penalty_equal_hf(eos_model):
    llm = LLM(str(eos_model), num_kv_blocks=512)
    found = {}
    for length_penalty in (0.5, 1.0, 2.0):
        outs = assert_equal_hf(llm, eos_model, PROMPTS, 3, 16, length_penalty)
        found[length_penalty] = [[s.token_ids for s in o.sequences] for o in outs]
        ended = [s for o in outs for s in o.sequences if s.token_ids[-1] in (203, 296)]
        if length_penalty <= 1:  # short finished hypotheses win: EOS endings were exercised
            assert any(len(s.token_ids) < 16 for s in ended), length_penalty
    assert found[2.0] != found[0.5]  # the penalty changes which hypotheses win


def test_beams_share_blocks_copy_on_write_and_survive_preemption(tiny_llama):
    """While the search runs, beams' tables start with the same prompt blocks and the pool
    holds fewer blocks than the tables list; a pool too small for every beam preempts some,
    and the result is still HF's."""
    llm = LLM(str(tiny_llama), num_kv_blocks=512, block_size=4)
    engine, seen = llm.engine, []
    step = engine.step

    def observed():
        outs = step()
        tables = [t for r, t in engine.kv.block_tables.items() if r.request_id.startswith("beam")]
        if len(tables) > 1:
            used = engine.kv.pool.num_blocks - engine.kv.pool.num_free
            seen.append((len({t[0] for t in tables}), sum(map(len, tables)), used))
        return outs

    engine.step = observed
    assert_equal_hf(llm, tiny_llama, PROMPTS[3:], 4, 10)
    assert seen and all(first == 1 for first, _, _ in seen)  # one physical first block
    assert all(used < listed for _, listed, used in seen)
    small = LLM(str(tiny_llama), num_kv_blocks=20, block_size=4)  # 4 beams x 3 prompts: tight
    assert_equal_hf(small, tiny_llama, PROMPTS[:3], 4, 14)
    assert small.engine.scheduler.num_preemptions > 0
    # Fewer seats than beams: held beams give their seats up too, or a preempted beam would
    # wait for a seat forever (and its round with it).
    seats = LLM(str(tiny_llama), num_kv_blocks=24, block_size=4, max_num_seqs=3)
    assert_equal_hf(seats, tiny_llama, PROMPTS[:3], 4, 14)


def test_bad_params_name_the_field(tiny_llama):
    with pytest.raises(ParamError, match="beam_width must be") as err:
        BeamSearchParams(0, 8)
    assert err.value.param == "beam_width"
    for bad in (1e6, float("nan"), True, "long"):
        with pytest.raises(ParamError, match="length_penalty must be") as err:
            BeamSearchParams(2, 8, bad)
        assert err.value.param == "length_penalty"
    with pytest.raises(ParamError, match="max_tokens must be") as err:
        BeamSearchParams(2, 0)
    assert err.value.param == "max_tokens"
    llm = LLM(str(tiny_llama), num_kv_blocks=128)
    with pytest.raises(ParamError, match="at most 20") as err:
        llm.beam_search([[1, 2]], BeamSearchParams(11, 4))  # 22 candidates per beam
    assert err.value.param == "beam_width"
    with pytest.raises(ParamError, match="prompt"):
        llm.beam_search([[]], BeamSearchParams(2, 4))
    # The engine keeps serving, every block free.
    (out,) = llm.beam_search([[1, 2, 3]], BeamSearchParams(2, 4))
    assert len(out.sequences) == 2
    snap = llm.engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"]


def test_smollm2_equals_hf():
    from engine.models.registry import resolve_model

    llm = LLM("smollm2-135m-instruct", quantization=None, num_kv_blocks=256)
    prompt = llm.tokenizer.encode("The three primary colours are")
    assert_equal_hf(llm, resolve_model("smollm2-135m-instruct"), [prompt], 3, 16)

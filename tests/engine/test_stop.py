"""Stopping (max_tokens, stop ids, stop strings, EOS, min_tokens), streaming, incremental
detokenization, logprobs and n > 1, through the real engine on a tiny byte-level model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.detokenizer import ExactDecoder, IncrementalDetokenizer
from models import byte_tokenizer

EOS = 256
PROMPT = "Hello, world!"
NUM_CONTINUATION = 40


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), num_kv_blocks=64, max_model_len=128)


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "ignore_eos": True, "max_tokens": 24, **kw})


def complete(llm: LLM, params: SamplingParams, prompt=PROMPT):
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert_pool_free(llm)
    return out.outputs[0]


def assert_pool_free(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_usable


@pytest.fixture(scope="module")
def continuation(llm):
    """The observed greedy continuation of PROMPT: stop tokens and strings are chosen from it."""
    out = complete(llm, greedy(max_tokens=NUM_CONTINUATION))
    assert out.finish_reason == "length" and len(out.token_ids) == NUM_CONTINUATION
    assert EOS not in out.token_ids
    assert out.text == llm.tokenizer.decode(out.token_ids)
    return out


def ascii_run(llm: LLM, ids: list[int], length: int) -> tuple[int, str]:
    """First (i, s): s is the text of ids[i : i + length], one printable ASCII char per token,
    and occurs in the continuation's text first at token i (so the cut point is known)."""
    tok = llm.tokenizer
    full = tok.decode(ids)
    pieces = [tok.decode([t]) for t in ids]
    for i in range(2, len(ids) - length):
        window = pieces[i : i + length]
        if all(len(c) == 1 and " " <= c <= "~" for c in window):
            s = "".join(window)
            if full.find(s) == len(tok.decode(ids[:i])):
                return i, s
    raise AssertionError(f"no {length}-char ASCII run in {full!r}: pick another PROMPT")


# ---- length, stop ids, EOS, min_tokens -----------------------------------------------------
@pytest.mark.parametrize("max_tokens", [1, 2, 7, 17])
def test_max_tokens_exact(llm, continuation, max_tokens):
    out = complete(llm, greedy(max_tokens=max_tokens))
    assert out.token_ids == continuation.token_ids[:max_tokens]
    assert out.finish_reason == "length" and out.stop_reason is None


def test_max_tokens_none_runs_to_context_limit(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=16, max_model_len=24)
    prompt = [1, 2, 3, 4, 5]
    out = complete(llm, greedy(max_tokens=None), prompt)
    assert len(out.token_ids) == 24 - len(prompt) and out.finish_reason == "length"


def test_stop_token_id_stops_exactly_there(llm, continuation):
    ids = continuation.token_ids
    k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    out = complete(llm, greedy(max_tokens=NUM_CONTINUATION, stop_token_ids=[ids[k]]))
    assert out.token_ids == ids[: k + 1]
    assert out.finish_reason == "stop" and out.stop_reason == ids[k]
    assert out.text == complete(llm, greedy(max_tokens=k)).text  # the stop token is not text


def test_first_token_as_stop_token(llm, continuation):
    first = continuation.token_ids[0]
    out = complete(llm, greedy(stop_token_ids=[first]))
    assert out.token_ids == [first] and out.stop_reason == first and out.text == ""


def test_eos_stops_unless_ignore_eos(llm):
    force_eos = {EOS: 100.0}
    out = complete(llm, SamplingParams(temperature=0, logit_bias=force_eos))
    assert out.token_ids == [EOS] and out.finish_reason == "stop"
    assert out.stop_reason is None and out.text == ""
    out = complete(llm, greedy(max_tokens=5, logit_bias=force_eos))
    assert out.token_ids == [EOS] * 5 and out.finish_reason == "length" and out.text == ""
    out = complete(llm, greedy(max_tokens=2, logit_bias=force_eos, skip_special_tokens=False))
    assert out.text == "<eos><eos>"


@pytest.mark.parametrize("min_tokens", [1, 5])
def test_min_tokens_prevents_early_eos(llm, min_tokens):
    params = SamplingParams(temperature=0, min_tokens=min_tokens, logit_bias={EOS: 100.0})
    out = complete(llm, params)
    assert len(out.token_ids) == min_tokens + 1
    assert EOS not in out.token_ids[:-1] and out.token_ids[-1] == EOS
    assert out.finish_reason == "stop"


def test_min_tokens_delays_stop_token(llm, continuation):
    stop = continuation.token_ids[0]
    params = greedy(min_tokens=3, stop_token_ids=[stop], logit_bias={stop: 100.0})
    out = complete(llm, params)
    assert len(out.token_ids) == 4 and stop not in out.token_ids[:3]
    assert out.token_ids[3] == stop and out.stop_reason == stop


# ---- stop strings --------------------------------------------------------------------------
@pytest.mark.parametrize("length", [1, 2, 3], ids=["one-token", "two-tokens", "three-tokens"])
@pytest.mark.parametrize("include", [False, True], ids=["cut", "include"])
def test_stop_string(llm, continuation, length, include):
    ids = continuation.token_ids
    i, s = ascii_run(llm, ids, length)
    before = llm.tokenizer.decode(ids[:i])
    params = greedy(max_tokens=NUM_CONTINUATION, stop=[s], include_stop_str_in_output=include)
    out = complete(llm, params)
    assert out.text == (before + s if include else before)
    assert out.token_ids == ids[: i + length]  # nothing generated past the stop string
    assert out.finish_reason == "stop" and out.stop_reason == s


def test_earliest_stop_string_wins(llm, continuation):
    ids = continuation.token_ids
    i, s = ascii_run(llm, ids, 2)
    pos = len(llm.tokenizer.decode(ids[:i]))
    later = continuation.text[pos + 1 : pos + 3]  # overlaps s, completes one token after it
    assert continuation.text.find(later) == pos + 1
    out = complete(llm, greedy(max_tokens=NUM_CONTINUATION, stop=[later, "\x00never", s]))
    assert out.stop_reason == s and out.token_ids == ids[: i + 2]


def test_stop_string_in_prompt_only_is_ignored(llm, continuation):
    absent = next(c for c in PROMPT[-5:] if c not in continuation.text)  # in the detok context
    out = complete(llm, greedy(max_tokens=10, stop=[absent]))
    assert out.token_ids == continuation.token_ids[:10] and out.finish_reason == "length"


def test_min_tokens_delays_stop_string(llm, continuation):
    """A stop string inside the first min_tokens outputs is passed over; the next one after
    them stops the request there (so ignoring stop strings altogether fails this too)."""
    i, s = ascii_run(llm, continuation.token_ids, 1)
    min_tokens = i + 3
    out = complete(llm, greedy(max_tokens=NUM_CONTINUATION, min_tokens=min_tokens, stop=[s]))
    full = llm.tokenizer.decode(continuation.token_ids)
    # checked from the first token past min_tokens on, a stop string's length back
    searched_from = len(llm.tokenizer.decode(continuation.token_ids[:min_tokens])) - len(s)
    at = full.find(s, searched_from)
    assert at != -1, f"{s!r} does not recur in {full!r}: pick another PROMPT"
    assert out.finish_reason == "stop" and out.stop_reason == s
    assert out.text == full[:at] and len(out.token_ids) > min_tokens
    assert out.token_ids == continuation.token_ids[: len(out.token_ids)]


# ---- streaming -----------------------------------------------------------------------------
@pytest.mark.parametrize("include", [False, True], ids=["cut", "include"])
@pytest.mark.parametrize("length", [0, 2, 3], ids=["no-stop", "two-tokens", "three-tokens"])
def test_stream_never_passes_stop_string(llm, continuation, include, length):
    stop = [ascii_run(llm, continuation.token_ids, length)[1]] if length else []
    params = greedy(max_tokens=NUM_CONTINUATION, stop=stop, include_stop_str_in_output=include)
    final = complete(llm, params)
    assert final.finish_reason == ("stop" if stop else "length")
    text, token_ids, num_chunks = "", [], 0
    for chunk in llm.stream(PROMPT, params):
        (delta,) = chunk.outputs
        text += delta.text
        token_ids += delta.token_ids
        num_chunks += 1
        assert final.text.startswith(text)  # never shows what the stop string later cuts
        if stop and not include:
            assert stop[0] not in text
    assert text == final.text and token_ids == final.token_ids
    assert num_chunks == len(final.token_ids)
    assert_pool_free(llm)


def test_stream_closed_early_frees_everything(llm):
    stream = llm.stream(PROMPT, greedy(max_tokens=20))
    next(stream)
    next(stream)
    stream.close()
    assert_pool_free(llm)


# ---- incremental detokenization ------------------------------------------------------------
@pytest.mark.parametrize(
    "text", ["aé€😀b", "😀😀", "ééé", "x€y€", "日本語テキスト", "a\u0301e\u200d👩‍💻z"]
)
def test_incremental_detokenizer_never_splits_a_character(text):
    tok = byte_tokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text.encode())  # one token per byte: multi-byte chars are split
    detok = IncrementalDetokenizer(ExactDecoder(tok), tok.encode("prompt "), True, [], False)
    deltas = []
    for t in ids:
        before = len(detok.text)
        assert detok.add_token(t) is None
        deltas.append(detok.text[before:])
        assert detok.visible_len(False) == len(detok.text)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == tok.decode(ids)
    assert sum(1 for d in deltas if d) == len(text)  # each char appears once, whole


def test_exact_decoder_remembers_single_tokens():
    """A token's text alone is what the tokenizer decodes for it, with special tokens skipped or
    kept, and is decoded once; windows of several tokens are always decoded."""
    tok = byte_tokenizer()
    decoder, calls = ExactDecoder(tok), []
    backend = decoder._decode
    decoder._decode = lambda ids, **kw: calls.append(ids) or backend(ids, **kw)
    eos = tok.eos_token_id
    for _ in range(2):
        for skip in (True, False):
            for t in range(len(tok)):
                assert decoder([t], skip) == backend([t], skip_special_tokens=skip)
    assert decoder([eos], True) == "" and decoder([eos], False) == "<eos>"
    assert len(calls) == 2 * len(tok)
    assert decoder([72, 105], True) == decoder([72, 105], True) == backend([72, 105])
    assert len(calls) == 2 * len(tok) + 2


@pytest.mark.parametrize("clean_up", [False, True])
def test_detokenizer_text_is_the_exact_decoding(clean_up):
    """Streamed token by token, the text is the tokens' decoding without HF's space clean-up,
    also for a tokenizer that asks for it: cleaning short windows lost characters ("a , b"
    came out "a  b"). Fast tokenizers decode with the Rust tokenizer itself."""
    tok = byte_tokenizer()
    tok.clean_up_tokenization_spaces = clean_up
    tok.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = clean_up
    text = "Hello , world ! it 's  ok . I 'm here , don 't ?"
    ids = tok.encode(text)
    assert (tok.decode(ids) != text) == clean_up  # the wrapper's clean-up would change it
    detok = IncrementalDetokenizer(ExactDecoder(tok), [], False, [], False)
    assert detok.decode._decode == tok.backend_tokenizer.decode
    for t in ids:
        detok.add_token(t)
    detok.flush()
    assert detok.text == text == tok.decode(ids, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("include", [False, True])
def test_incremental_detokenizer_multibyte_stop(include):
    tok = byte_tokenizer()
    detok = IncrementalDetokenizer(ExactDecoder(tok), [1], True, ["€😀", "zz"], include)
    ids = tok.encode("aé€😀bzz")
    stops = []
    while not any(stops):
        stops.append(detok.add_token(ids[len(stops)]))
    assert stops[-1] == "€😀" and len(stops) == len("aé€😀".encode())  # the emoji's last byte
    assert detok.text == ("aé€😀" if include else "aé")


def test_visible_text_holds_back_a_possible_stop_prefix():
    tok = byte_tokenizer()
    detok = IncrementalDetokenizer(ExactDecoder(tok), [1], True, ["STOP"], False)
    shown = []
    for t in tok.encode("hello STOP world"):
        stop = detok.add_token(t)
        shown.append(detok.text[: detok.visible_len(stop is not None)])
        if stop:
            break
    assert shown[-1] == "hello "
    assert all(shown[-1].startswith(s) for s in shown)  # only grows, never past the cut
    assert all(a == b[: len(a)] for a, b in zip(shown, shown[1:], strict=False))


def test_flush_emits_dangling_bytes_at_finish():
    tok = byte_tokenizer()
    detok = IncrementalDetokenizer(ExactDecoder(tok), [1], True, [], False)
    for t in tok.encode("ok€")[:-1]:  # the euro sign cut after two of its three bytes
        detok.add_token(t)
    assert detok.text == "ok"
    detok.flush()
    assert detok.text.startswith("ok") and detok.text.endswith("\ufffd")


# ---- logprobs ------------------------------------------------------------------------------
def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), V] log-softmax of HF's raw logits; row j predicts token j + 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_position(entry, lsm: torch.Tensor, token: int, num_top: int) -> None:
    assert token in entry and len(entry) in (num_top, num_top + 1)
    rank = int((lsm > lsm[token]).sum()) + 1
    assert entry[token].rank == rank
    assert (len(entry) == num_top) == (rank <= num_top)
    top = lsm.topk(num_top).indices.tolist()
    assert set(top) | {token} == set(entry)
    for t, lp in entry.items():
        assert lp.logprob == pytest.approx(float(lsm[t]), abs=1e-4)
        assert lp.rank == int((lsm > lsm[t]).sum()) + 1


# Logprobs are of the raw logits, whatever the sampling processing does.
SAMPLED = SamplingParams(
    temperature=1.3,
    seed=3,
    max_tokens=12,
    ignore_eos=True,
    logprobs=2,
    repetition_penalty=1.5,
    top_k=20,
    logit_bias={65: 5.0},
)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0),
        SAMPLED,
    ],
    ids=["greedy-3", "greedy-0", "sampled-2"],
)
def test_logprobs_match_hf(llm, hf_model, params):
    prompt = llm.tokenizer.encode(PROMPT)
    out = complete(llm, params, prompt)
    ids = out.token_ids
    assert len(out.logprobs) == len(ids)
    lsm = hf_logprobs(hf_model, prompt + ids)
    for j, (token, entry) in enumerate(zip(ids, out.logprobs, strict=True)):
        check_position(entry, lsm[len(prompt) + j - 1], token, params.logprobs)
        assert entry[token].decoded_token == llm.tokenizer.decode([token])
    chosen = sum(e[t].logprob for t, e in zip(ids, out.logprobs, strict=True))
    assert out.cumulative_logprob == pytest.approx(chosen, abs=1e-4)
    if params.temperature > 0:  # the sampled variant is not vacuous: some tokens off the top
        assert any(e[t].rank > params.logprobs for t, e in zip(ids, out.logprobs, strict=True))


@pytest.mark.parametrize("chunk", [16, 1024])
def test_prompt_logprobs_match_hf(tiny_llama, hf_model, chunk):
    llm = LLM(str(tiny_llama), num_kv_blocks=64, max_num_batched_tokens=chunk)
    prompt = list(range(40, 80)) + [33] * 5  # chunked prefill splits it at 16 and 32
    params = greedy(max_tokens=2, prompt_logprobs=2)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    lsm = hf_logprobs(hf_model, prompt)
    for j in range(1, len(prompt)):
        check_position(lps[j], lsm[j - 1], prompt[j], 2)
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
    assert_pool_free(llm)


@pytest.fixture(scope="module")
def preempted_run(tiny_llama):
    """Two requests that cannot both fit: one is preempted and recomputed."""
    llm = LLM(str(tiny_llama), num_kv_blocks=7, block_size=16, max_model_len=128)
    prompts = [list(range(10, 30)), list(range(40, 60))]
    params = greedy(max_tokens=40, prompt_logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_pool_free(llm)
    return llm, prompts, outs


def test_preemption_happened_and_tokens_unchanged(llm, preempted_run):
    pre_llm, prompts, outs = preempted_run
    assert pre_llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == complete(llm, greedy(max_tokens=40), prompt).token_ids


def test_prompt_logprobs_survive_preemption(llm, preempted_run):
    """A preempted request's prompt logprobs are the ones it gets unpreempted: one entry per
    prompt token (none for the first), the same tokens, ranks and values (recomputing the
    prompt after preemption neither drops nor repeats them)."""
    _, prompts, outs = preempted_run
    for prompt, out in zip(prompts, outs, strict=True):
        want = llm.generate([prompt], greedy(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        want = want[0].prompt_logprobs
        assert len(out.prompt_logprobs) == len(prompt) == len(want)
        assert out.prompt_logprobs[0] is None and want[0] is None
        for got_pos, want_pos in zip(out.prompt_logprobs[1:], want[1:], strict=True):
            assert got_pos.keys() == want_pos.keys()
            for token, lp in want_pos.items():
                assert got_pos[token].rank == lp.rank
                assert got_pos[token].logprob == pytest.approx(lp.logprob, rel=1e-5, abs=1e-6)


# ---- n > 1 ---------------------------------------------------------------------------------
def test_n3_seeded_distinct_reproducible_and_freed(llm):
    prompt = list(range(70, 90))  # 20 tokens: the shared last block is partly filled (CoW)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert_pool_free(llm)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    runs = [tuple(c.token_ids) for c in out.outputs]
    assert all(len(r) == 10 for r in runs) and len(set(runs)) == 3
    assert all(c.finish_reason == "length" for c in out.outputs)
    (again,) = llm.generate([prompt], params, use_tqdm=False)
    assert [tuple(c.token_ids) for c in again.outputs] == runs
    assert_pool_free(llm)


def test_n3_greedy_all_equal_single(llm):
    prompt = list(range(70, 90))
    (out,) = llm.generate([prompt], greedy(n=3, max_tokens=10), use_tqdm=False)
    single = complete(llm, greedy(max_tokens=10), prompt)
    assert all(c.token_ids == single.token_ids for c in out.outputs)
    assert all(c.text == single.text for c in out.outputs)
    assert_pool_free(llm)

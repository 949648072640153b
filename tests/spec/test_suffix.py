"""Suffix decoding (spec.suffix): frequency-scored, variable-length drafts from the request's
own text and its tenant's finished requests; tenants kept apart; memory bounded; lossless."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.config import MAX_PREDICTED_DRAFTS, MAX_SPECULATIVE_TOKENS
from engine.request import Request, RequestStatus
from spec.suffix import HASH_BLOCK, Draft, SuffixCache, SuffixProposer

SMOL = "smollm2-135m-instruct"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def request(prompt: list[int], salt: bytes = b"", output: list[int] = ()) -> Request:
    r = Request("r", list(prompt), GREEDY, set(), 4096, cache_extra_keys=salt)
    for token in output:
        r.append_token(token)
    return r


def finish(proposer: SuffixProposer, r: Request) -> None:
    """r ran and finished: its text goes to its tenant's store."""
    proposer.draft(r, [], 1)  # (seen by the proposer while it ran)
    r.status = RequestStatus.FINISHED_STOPPED
    proposer.store_finished()


# ---- drafting ---------------------------------------------------------------------------------
def test_draft_takes_the_most_frequent_continuation_with_its_share():
    # "1 2 3" went on with 7 8 twice and with 9 once; the request ends with "1 2 3".
    text = [1, 2, 3, 7, 8, 50, 1, 2, 3, 9, 51, 1, 2, 3, 7, 8, 52, 1, 2, 3]
    draft = SuffixProposer(min_token_prob=0.0).draft(request(text), [], 2)
    assert draft.token_ids == [7, 8]
    assert draft.probs == pytest.approx([2 / 3, 2 / 3])
    assert draft.match_len == 3


def test_draft_length_is_bounded_by_the_match_length_times_max_spec_factor():
    run = list(range(100, 140))
    # A match of 2 tokens drafts at most 2 with factor 1, 4 with factor 2; a match of 20 (the
    # whole run repeated) drafts up to k.
    short = [5, 6] + run + [5, 6]
    assert len(SuffixProposer().draft(request(short), [], 15).token_ids) == 2
    factor2 = SuffixProposer(max_spec_factor=2.0)
    assert len(factor2.draft(request(short), [], 15).token_ids) == 4
    long = run + [1] + run[:20]
    draft = SuffixProposer().draft(request(long), [], 15)
    assert draft.token_ids == run[20:35] and draft.match_len == 20


def test_min_token_prob_ends_the_draft_where_continuations_split():
    # After "1 2 3 4" the text went on with 5 then 6 or 7 (one each): the token after 5 has
    # probability 1/2.
    text = [1, 2, 3, 4, 5, 6, 90, 1, 2, 3, 4, 5, 7, 91, 1, 2, 3, 4]
    assert SuffixProposer(min_token_prob=0.4).draft(request(text), [], 4).token_ids == [5, 7, 91, 1]
    assert SuffixProposer(min_token_prob=0.6).draft(request(text), [], 4).token_ids == [5]


def test_draft_prefers_the_longer_match_when_it_scores_higher():
    # "8 1 2" -> 3 once; "x 1 2" -> 4 three times. Ending with "8 1 2": the longer match (one
    # occurrence, probability 1) beats the frequent short one (3/4).
    text = [8, 1, 2, 3, 60, 9, 1, 2, 4, 61, 9, 1, 2, 4, 62, 9, 1, 2, 4, 63, 7, 8, 1, 2]
    draft = SuffixProposer(min_token_prob=0.0).draft(request(text), [], 1)
    assert draft.token_ids == [3] and draft.match_len == 3


# ---- tenants ----------------------------------------------------------------------------------
def test_finished_text_drafts_for_its_tenant_only():
    proposer = SuffixProposer()
    secret = list(range(200, 260))
    finish(proposer, request([1, 2, 3], b"tenant-a", secret))
    asking = [9, 9] + secret[:10]  # both tenants' requests end as the secret text began
    assert proposer.draft(request(asking, b"tenant-a"), [], 8).token_ids == secret[10:18]
    assert proposer.draft(request(asking, b"tenant-b"), [], 8).token_ids == []
    assert proposer.draft(request(asking, b""), [], 8).token_ids == []  # no salt: a tenant too


def test_two_tenants_on_the_engine_never_draft_from_each_other():
    """Tenant a's request, then tenant b's: b drafts exactly what it drafts on an engine that
    never saw a (a's text helped nothing), while a's own second request drafts from its first."""
    text = (
        "def area(radius):\n    return 3.14159 * radius * radius\n\n"
        "def perimeter(radius):\n    return 2 * 3.14159 * radius\n"
    )
    params = SamplingParams(temperature=0.0, max_tokens=48)

    def drafts_of(llm, salt, prompt):
        proposer, seen = llm.engine.speculation.proposer, []

        def spy(r, drafts, k):
            seen.append(draft(r, drafts, k).token_ids)
            return Draft(seen[-1])

        draft, proposer.draft = proposer.draft, spy
        llm.engine.add_request(f"{salt}-{len(prompt)}", prompt, params, cache_salt=salt)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        del proposer.draft
        return seen

    llm = LLM(SMOL, speculative_method="suffix", adaptive_speculation=False, num_threads=1)
    first = llm.apply_chat_template([{"role": "user", "content": f"Repeat this code:\n{text}"}])
    # (no code in it: only tenant a's stored text has any)
    ask = "Write a Python function area(radius) for a circle."
    second = llm.apply_chat_template([{"role": "user", "content": ask}])
    drafts_of(llm, "a", first)
    b_after_a = drafts_of(llm, "b", second)
    fresh = LLM(SMOL, speculative_method="suffix", adaptive_speculation=False, num_threads=1)
    assert b_after_a == drafts_of(fresh, "b", second)
    assert drafts_of(llm, "a", second) != b_after_a  # within a tenant, a's first turn counts
    assert len(llm.engine.speculation.proposer.cache.tenants) == 2


def test_a_long_match_drafts_up_to_a_predictions_step():
    """A conversation that resends code: once the answer is in step with it, suffix's drafts
    run past a proposer's 15 (its default k is MAX_PREDICTED_DRAFTS, 31), never past 31, and the
    output is plain greedy's."""
    code = "".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(12))
    params = SamplingParams(temperature=0.0, max_tokens=96)
    plain = LLM(SMOL, num_threads=1)
    llm = LLM(SMOL, speculative_method="suffix", adaptive_speculation=False, num_threads=1)
    prompt = llm.apply_chat_template([{"role": "user", "content": f"Repeat this code:\n{code}"}])
    proposer, lengths = llm.engine.speculation.proposer, []

    def spy(r, drafts, k):
        found = draft(r, drafts, k)
        lengths.append(len(found.token_ids))
        return found

    draft, proposer.draft = proposer.draft, spy
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.engine.speculation.k == MAX_PREDICTED_DRAFTS
    assert max(lengths) > MAX_SPECULATIVE_TOKENS and max(lengths) <= MAX_PREDICTED_DRAFTS


# ---- memory -----------------------------------------------------------------------------------
def test_stored_text_stays_under_the_cap_and_the_oldest_goes_first():
    cap = 1000
    proposer = SuffixProposer(max_cached_tokens=cap)
    docs = [[1000 * (i + 1) + j for j in range(300)] for i in range(12)]  # distinct texts
    for i, doc in enumerate(docs):
        finish(proposer, request(doc[:40], b"t%d" % (i % 2), doc[40:]))
        cache = proposer.cache
        assert cache.num_tokens <= cap
        assert sum(t.num_tokens for t in cache.tenants.values()) == cache.num_tokens
        for text in cache.tenants.values():  # the index shrinks with the text (compaction)
            assert len(text.arena) <= 4 * cap and sum(map(len, text.index.values())) <= 2 * cap
    oldest, newest = docs[0], docs[-1]
    salt_old, salt_new = b"t0", b"t%d" % ((len(docs) - 1) % 2)
    assert proposer.draft(request([7, 7] + oldest[100:110], salt_old), [], 5).token_ids == []
    got = proposer.draft(request([7, 7] + newest[100:110], salt_new), [], 5).token_ids
    assert got == newest[110:115]


def test_a_resent_conversation_is_stored_once():
    """Turn 2's prompt repeats turn 1's prompt and answer: only its new part is stored."""
    cache = SuffixCache(1 << 20)
    turn1 = list(range(1, 401))
    turn2 = turn1 + list(range(1000, 1200))
    cache.add(b"t", turn1)
    cache.add(b"t", turn2)
    assert cache.num_tokens < len(turn1) + 200 + 3 * HASH_BLOCK


def test_the_stored_copy_of_a_prompt_does_not_count_twice():
    """A session's earlier text (v1) is stored and repeated in the next prompt, which then shows
    v2: at the point where they part, v1 and v2 count once each and the later (v2) wins; were
    the stored copy counted too, v1 would win two to one."""
    proposer = SuffixProposer(min_token_prob=0.0)
    head = list(range(300, 364))  # 4 hashed blocks of shared text
    v1 = head + [11, 12, 13, 14, 15, 16]
    finish(proposer, request(v1, b"t"))
    prompt = v1 + [99] + head[-8:] + [21, 22, 23] + [98] + head[-8:]
    assert proposer.draft(request(prompt, b"t"), [], 1).token_ids == [21]


# ---- lossless ---------------------------------------------------------------------------------
@pytest.mark.parametrize("quantization", ["auto", None])  # the default GGUF path; fp32
def test_suffix_outputs_equal_plain_greedy_and_seeded(quantization):
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    chats = [
        [{"role": "user", "content": f"Repeat this code twice:\n{code}"}],
        [{"role": "user", "content": f"Rename add to plus and return all of it:\n{code}"}],
    ]
    plain = LLM(SMOL, quantization=quantization, num_threads=1)
    suffix = LLM(SMOL, quantization=quantization, num_threads=1, speculative_method="suffix")
    prompts = [plain.apply_chat_template(c) for c in chats]
    for params in (
        SamplingParams(temperature=0.0, max_tokens=64),
        SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=64),
    ):
        for _ in range(2):  # the second time, the first round's answers are stored text
            want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
            got = [o.outputs[0].token_ids for o in suffix.generate(prompts, params, use_tqdm=False)]
            assert got == want
    stats = suffix.engine.speculation.stats
    assert stats.num_accepted > 0 and stats.mean_accepted_length > 2.0

"""Async scheduling: the next step is scheduled and launched before the previous one's tokens
reach the host (its inputs read them on the device), and the host appends them while it runs.
Every request emits what it emits with synchronous steps: greedy and seeded tokens, stops,
finish reasons and logprobs; requests whose next step needs their tokens on the host (n > 1,
penalties, min_tokens, grammar) drain the pipeline first; preemption, aborts and a failed step
leave every block free."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch

from engine import LLM, RequestOutputKind, SamplingParams

STOPS = list(range(100, 150))


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(11)
    prompts, params = [], []
    for i in range(12):
        n = int(torch.randint(1, 30, (1,), generator=g))
        prompts.append(torch.randint(3, 250, (n,), generator=g).tolist())
        max_tokens = 3 + i % 7  # finishing at different steps
        if i % 3 == 0:
            p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
        elif i % 3 == 1:  # may stop on EOS or a stop token id mid-way
            p = SamplingParams(
                temperature=0.9, top_p=0.9, seed=i, max_tokens=max_tokens, stop_token_ids=STOPS
            )
        else:
            p = SamplingParams(temperature=0.7, top_k=20, seed=i, max_tokens=12, logit_bias={5: 2})
        params.append(p)
    return prompts, params


def run(model_dir, prompts, params, **engine_args):
    llm = LLM(str(model_dir), num_kv_blocks=64, **engine_args)
    outs = llm.generate(prompts, params, use_tqdm=False)
    snap = llm.engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"] and snap["num_running"] == 0
    assert all(r.num_pending == 0 for g in llm.engine.groups.values() for r in g.requests)
    return outs, snap


def summary(outs):
    return [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def assert_same_logprobs(got, want):
    for a, b in zip(got, want, strict=True):
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            if cb.logprobs is None:
                assert ca.logprobs is None
                continue
            for ea, eb in zip(ca.logprobs, cb.logprobs, strict=True):
                assert ea.keys() == eb.keys()
                for t in eb:
                    assert ea[t].rank == eb[t].rank
                    assert ea[t].logprob == pytest.approx(eb[t].logprob, abs=1e-4)


@pytest.mark.parametrize("chunk", [7, 64])
def test_async_steps_emit_what_sync_steps_emit(tiny_llama, chunk):
    prompts, params = workload()
    want, sync_snap = run(tiny_llama, prompts, params, max_num_batched_tokens=chunk)
    got, snap = run(
        tiny_llama, prompts, params, max_num_batched_tokens=chunk, async_scheduling=True
    )
    assert summary(got) == summary(want)
    assert_same_logprobs(got, want)
    assert sync_snap["num_overlapped_steps"] == 0
    assert snap["num_overlapped_steps"] > 0.5 * snap["num_steps"]
    assert any(c.finish_reason == "stop" for o in want for c in o.outputs)  # not only lengths


def test_without_the_device_tokens_async_steps_differ(tiny_llama, monkeypatch):
    """The equality above has teeth: if the step in flight's tokens do not reach the next
    step's inputs (the inputs keep the placeholder), the outputs change."""
    from engine import model_runner

    prompts, params = workload()
    want, _ = run(tiny_llama, prompts, params)
    monkeypatch.setattr(model_runner, "fill_pending", lambda *args: None)
    got, _ = run(tiny_llama, prompts, params, async_scheduling=True)
    assert summary(got) != summary(want)


def test_with_a_proposer_no_step_keeps_device_tokens(tiny_llama):
    """Speculating engines never overlap steps, so no step builds device-side sampled tokens
    for a next step's inputs (they would never be read); the outputs are the sync ones."""
    prompts, params = workload()
    kept = []
    llm = LLM(str(tiny_llama), num_kv_blocks=64, async_scheduling=True, speculative_method="ngram")
    runner = llm.engine.runner
    launch = runner.launch

    def recording(*args, **kwargs):
        out = launch(*args, **kwargs)
        kept.append(runner.sampled)
        return out

    runner.launch = recording
    got = llm.generate(prompts, params, use_tqdm=False)
    assert kept and all(s is None for s in kept)
    want, _ = run(tiny_llama, prompts, params, speculative_method="ngram", async_scheduling=False)
    assert summary(got) == summary(want)
    plain = LLM(str(tiny_llama), num_kv_blocks=64, async_scheduling=True)
    assert plain.engine.runner.keep_sampled


def test_requests_that_need_host_tokens_drain_the_pipeline(tiny_llama):
    """n > 1 forks, penalties and min_tokens read a step's tokens on the host before the next
    step: those steps are collected first, and the outputs equal synchronous steps'."""
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [20, 21]]
    params = [
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=6),
        SamplingParams(temperature=0.8, seed=4, max_tokens=8, frequency_penalty=0.5),
        SamplingParams(temperature=0.8, seed=5, max_tokens=8, min_tokens=5),
    ]
    want, _ = run(tiny_llama, prompts, params)
    got, snap = run(tiny_llama, prompts, params, async_scheduling=True)
    assert summary(got) == summary(want)
    # The penalised request runs to the end, so no step after its prefill overlaps.
    assert snap["num_overlapped_steps"] <= 1
    alone, snap = run(tiny_llama, prompts[:1], params[:1], async_scheduling=True)
    assert summary(alone) == summary(want[:1]) and snap["num_overlapped_steps"] >= 8


def test_forced_tokens_wait_for_the_token_in_flight(tiny_llama):
    """A forced-token source (here: replaying their own greedy continuation for the first four
    requests) is not asked about a request whose last token is still in flight, and the steps
    of the requests it applies to are collected before the next is scheduled: what it forces
    next depends on their tokens. Once those requests are done the others' steps overlap; the
    tokens are those of synchronous steps."""
    prompts, _ = workload()
    params = [
        SamplingParams(temperature=0, max_tokens=4 if i < 4 else 12, ignore_eos=True)
        for i in range(len(prompts))
    ]
    want, _ = run(tiny_llama, prompts, params)
    replay = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts[:4], want, strict=False)}

    class Replay:
        def applies_to(self, request) -> bool:
            return tuple(request.prompt_token_ids) in replay

        def forced_tokens(self, request, limit):
            assert request.num_pending == 0, "asked while its token was in flight"
            n = request.num_output_tokens
            return replay.get(tuple(request.prompt_token_ids), [])[n : n + min(limit, 2)]

    llm = LLM(str(tiny_llama), num_kv_blocks=64, async_scheduling=True)
    llm.engine.speculation.force_with(Replay())
    got = llm.generate(prompts, params, use_tqdm=False)
    assert summary(got) == summary(want)
    stats, snap = llm.engine.speculation.stats, llm.engine.snapshot()
    assert stats.num_forced > 0 and stats.num_forced_accepted == stats.num_forced
    assert snap["num_overlapped_steps"] > 0
    assert snap["num_free_blocks"] == snap["num_blocks"]


def test_preemption_under_async_scheduling(tiny_llama):
    prompts, params = workload()
    want, _ = run(tiny_llama, prompts, params)
    llm = LLM(str(tiny_llama), num_kv_blocks=10, block_size=8, async_scheduling=True)
    got = llm.generate(prompts, params, use_tqdm=False)
    snap = llm.engine.snapshot()
    assert snap["num_preemptions"] > 0 and snap["num_overlapped_steps"] > 0
    assert summary(got) == summary(want)
    assert snap["num_free_blocks"] == snap["num_blocks"]


def test_abort_while_a_step_is_in_flight(tiny_llama):
    prompts, params = workload()
    want, _ = run(tiny_llama, prompts, params)
    llm = LLM(str(tiny_llama), num_kv_blocks=64, async_scheduling=True)
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    finals, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        steps += 1
        if steps == 3:
            # The abort lands between launch and collect.
            assert engine.pipeline.in_flight is not None
            engine.abort_request(["r0", "r4"])
    for i, expected in enumerate(want):
        if i not in (0, 4):
            assert summary([finals[f"r{i}"]]) == summary([expected])
    snap = engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"] and snap["num_running"] == 0


@pytest.mark.parametrize("where", ["launch", "wait"])
def test_a_failed_step_requeues_its_requests(tiny_llama, monkeypatch, where):
    """A step that fails to launch (while the previous one is in flight) or whose results never
    land: the step raises, its requests (and those of a step launched after it, which read its
    tokens on the device) queue again holding nothing (one readmitted while its token is in
    flight computes its known tokens and samples only once that token is there), and the greedy
    outputs are as if nothing had happened."""
    from engine.model_runner import LaunchedStep, ModelRunner

    prompts, params = workload()
    want, _ = run(tiny_llama, prompts, params)
    llm = LLM(str(tiny_llama), num_kv_blocks=64, async_scheduling=True)
    engine = llm.engine
    owner = LaunchedStep if where == "wait" else ModelRunner
    real, calls = getattr(owner, where), iter(range(100))

    def failing_once(*args):
        if next(calls) == 4:
            assert where == "wait" or engine.pipeline.in_flight is not None
            raise RuntimeError("injected")
        return real(*args)

    monkeypatch.setattr(owner, where, failing_once)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    finals, failed = {}, 0
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except RuntimeError:
            failed += 1
            continue
        finals.update((o.request_id, o) for o in outs if o.finished)
    assert failed == 1
    # Seeded requests draw again from where their generators are: compare the greedy ones.
    for i in range(0, len(prompts), 3):
        assert summary([finals[f"r{i}"]]) == summary([want[i]])
    assert all(
        len(f.outputs[0].token_ids) <= p.max_tokens
        for f, p in zip((finals[f"r{i}"] for i in range(len(prompts))), params, strict=True)
    )
    snap = engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"]


def test_outputs_collected_before_a_failure_come_with_the_next_step(tiny_llama, monkeypatch):
    """step() collects the step in flight, then the one it launched (a penalised request's
    prefill: not overlappable), whose results never land. The first request finished in the
    collected step and asks only for its final output: it comes with the next step()."""
    from engine.model_runner import LaunchedStep

    final = RequestOutputKind.FINAL_ONLY
    first = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, output_kind=final)
    penalised = SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, presence_penalty=1.0, output_kind=final
    )
    want = run(tiny_llama, [[5, 6, 7], [8, 9]], [first, penalised])[0]
    engine = LLM(str(tiny_llama), num_kv_blocks=64, async_scheduling=True).engine
    real, failed = LaunchedStep.wait, []

    def wait(self):
        if any(r.request_id == "b" for r in self.members) and not failed:
            failed.append(True)
            raise RuntimeError("injected")
        return real(self)

    monkeypatch.setattr(LaunchedStep, "wait", wait)
    engine.add_request("a", [5, 6, 7], first)
    for _ in range(3):  # a's prefill and two decodes launched, its third token in flight
        assert engine.step() == []
    engine.add_request("b", [8, 9], penalised)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()  # collects a's last step (a finishes), then b's fails
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert summary([finals["a"], finals["b"]]) == summary(want)
    snap = engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"]


def test_prefix_cache_holds_the_same_blocks(tiny_llama):
    """A request's last full block becomes hashable only with its last token, which arrives
    after the request was last scheduled: it still enters the prefix cache, so a follow-up
    that extends the conversation hits as many tokens as with synchronous steps."""
    prompt, p = [5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    hits = []
    for overlap in (False, True):
        llm = LLM(str(tiny_llama), num_kv_blocks=64, block_size=4, async_scheduling=overlap)
        out = llm.generate([prompt], p, use_tqdm=False)[0]
        follow = prompt + out.outputs[0].token_ids + [11, 12]
        one = SamplingParams(temperature=0, max_tokens=1)
        hits.append(llm.generate([follow], one, use_tqdm=False)[0].num_cached_tokens)
    assert hits[0] == hits[1] == 16


def test_a_failed_launch_mid_prefill_keeps_prompt_logprobs_once(tiny_llama, monkeypatch):
    """Chunked prefill with prompt logprobs, the launch of a chunk failing while the previous
    chunk is in flight: the request is not admitted again before that chunk lands, so its
    prompt logprobs are recorded once each, as without the failure."""
    from engine.model_runner import ModelRunner

    prompt = list(range(10, 30))
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    kwargs = dict(num_kv_blocks=64, max_num_batched_tokens=7)
    want = LLM(str(tiny_llama), **kwargs).generate([prompt], p, use_tqdm=False)[0]
    llm = LLM(str(tiny_llama), async_scheduling=True, **kwargs)
    engine, real, calls = llm.engine, ModelRunner.launch, iter(range(100))

    def launch_failing_second(self, *args):
        if next(calls) == 1:
            assert engine.pipeline.in_flight is not None  # the first chunk is still in flight
            raise RuntimeError("injected")
        return real(self, *args)

    monkeypatch.setattr(ModelRunner, "launch", launch_failing_second)
    engine.add_request("r", prompt, p)
    final, failed = None, 0
    while engine.has_unfinished_requests():
        try:
            final = next((o for o in engine.step() if o.finished), final)
        except RuntimeError:
            failed += 1
    assert failed == 1 and len(final.prompt_logprobs) == len(want.prompt_logprobs) == 20
    assert final.outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.parametrize("fail_at", [3, 5, 7])
def test_blocks_a_lost_step_was_to_fill_leave_the_prefix_cache(tiny_llama, monkeypatch, fail_at):
    """A step whose results never land may never have written its K/V (poisoned here, with
    that of the step launched after it): every block either was to fill leaves the prefix
    cache, including a block whose last token was sampled by the step before and so was
    hashed only after the lost step had been launched. A follow-up extending the request's
    text then computes what a fresh engine computes."""
    from engine.attention import slot_ids
    from engine.model_runner import LaunchedStep, ModelRunner

    bs, prompt = 4, [5, 6, 7, 8, 9]
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(tiny_llama), num_kv_blocks=64, block_size=bs, async_scheduling=True)
    engine = llm.engine
    real_forward, real_launch = ModelRunner.forward, ModelRunner.launch
    real_wait, written, calls = LaunchedStep.wait, {}, iter(range(100))

    def forward(self, items, tables):
        written["slots"] = [
            s for it in items for s in slot_ids(tables[it.request], it.start, len(it.token_ids), bs)
        ]
        return real_forward(self, items, tables)

    def launch(self, sched, tables):
        launched = real_launch(self, sched, tables)
        launched.slots = written["slots"]
        return launched

    def wait(self):
        if next(calls) == fail_at:
            for lost in (self, engine.pipeline.in_flight and engine.pipeline.in_flight.launched):
                for s in lost.slots if lost else []:
                    engine.runner.kv_caches[:, :, :, s // bs, s % bs] = 1e4
            raise RuntimeError("injected")
        return real_wait(self)

    monkeypatch.setattr(ModelRunner, "forward", forward)
    monkeypatch.setattr(ModelRunner, "launch", launch)
    monkeypatch.setattr(LaunchedStep, "wait", wait)
    engine.add_request("r", prompt, p)
    final = None
    while engine.has_unfinished_requests():
        with contextlib.suppress(RuntimeError):
            final = next((o for o in engine.step() if o.finished), final)
    monkeypatch.undo()
    follow = prompt + final.outputs[0].token_ids + [11]
    one = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = llm.generate([follow], one, use_tqdm=False)[0]
    fresh = LLM(str(tiny_llama), num_kv_blocks=64, block_size=bs)
    assert got.num_cached_tokens > 0
    assert summary([got]) == summary(fresh.generate([follow], one, use_tqdm=False))


def test_static_buffers_read_the_device_tokens(tiny_llama):
    """The padded static-buffer forward (CUDA graphs on a GPU; eager here, Triton's
    interpreter) takes the step in flight's tokens like the eager path does."""
    prompts, params = workload()
    prompts, params = prompts[:4], [SamplingParams(temperature=0, max_tokens=5)] * 4
    kwargs = dict(attention_backend="triton", max_num_seqs=8)
    want, _ = run(tiny_llama, prompts, params, **kwargs)
    llm = LLM(str(tiny_llama), num_kv_blocks=64, async_scheduling=True, **kwargs)
    runner = llm.engine.runner
    runner.use_graphs(8, llm.engine.max_model_len, 1)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert runner.graphs.num_replays > 0 and llm.engine.pipeline.num_overlapped_steps > 0
    assert summary(got) == summary(want)


def test_launch_leaves_every_result_on_the_device(tiny_llama, monkeypatch):
    """Launching a step queues the copy of its results and never waits for it: sampled tokens,
    logprobs and prompt logprobs (a chunked prompt, some chunks with and some without) all
    come back in the one copy that collecting the step waits for."""
    from engine.device import HostCopy
    from engine.model_runner import ModelRunner

    prompts, params = workload()
    params = [replace(p, prompt_logprobs=2) if i % 4 == 1 else p for i, p in enumerate(params)]
    want, _ = run(tiny_llama, prompts, params, max_num_batched_tokens=7)
    real_launch, real_wait, launching, waits = ModelRunner.launch, HostCopy.wait, [], []

    def launch(self, *args):
        launching.append(True)
        try:
            return real_launch(self, *args)
        finally:
            launching.pop()

    def wait(self):
        waits.append(bool(launching))
        return real_wait(self)

    monkeypatch.setattr(ModelRunner, "launch", launch)
    monkeypatch.setattr(HostCopy, "wait", wait)
    got, _ = run(tiny_llama, prompts, params, max_num_batched_tokens=7, async_scheduling=True)
    assert summary(got) == summary(want)
    assert [o.prompt_logprobs for o in got] == [o.prompt_logprobs for o in want]
    assert any(o.prompt_logprobs for o in got) and waits and not any(waits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_async_scheduling_on_cuda(tiny_llama, monkeypatch):
    """On by default with CUDA (graphs, pinned inputs, the results' copy queued behind the
    step): greedy and seeded tokens equal synchronous steps' in float32, and launching a step
    never waits for the device (torch's sync debug mode turns any wait into an error)."""
    from engine.model_runner import ModelRunner

    prompts, params = workload()
    kwargs = dict(device="cuda", dtype="float32")
    want, _ = run(tiny_llama, prompts, params, async_scheduling=False, **kwargs)
    run(tiny_llama, prompts, params, **kwargs)  # warm-up: kernels compiled, pinned pool grown
    real = ModelRunner.launch

    def launch_without_waiting(self, *args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real(self, *args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(ModelRunner, "launch", launch_without_waiting)
    got, snap = run(tiny_llama, prompts, params, **kwargs)
    assert snap["num_overlapped_steps"] > 0.5 * snap["num_steps"]
    assert summary(got) == summary(want)
    # Unseeded sampled rows (the engine's shared generator) and logprobs launch without
    # waiting too.
    unseeded = [
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, logprobs=1, prompt_logprobs=1)
    ] * 4
    run(tiny_llama, prompts[:4], unseeded, **kwargs)

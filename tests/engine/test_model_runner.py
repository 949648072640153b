"""The model runner's pieces on their own: the flat step inputs (back to back, and padded as the
CUDA-graph runner lays them out), and a launched step's results resolved once."""

from __future__ import annotations

from blocks import make_request

from engine import LLM, SamplingParams
from engine.device import HostCopy
from engine.inputs import ForwardItem, flat_inputs, real_rows

BS = 4


def items_and_tables():
    a, b = make_request("a", [1, 2, 3, 4, 5, 6], BS), make_request("b", [7, 8], BS)
    tables = {a: [3, 5], b: [2]}
    # a: its last two tokens at positions 4, 5 (block 5); b: one token at position 1 (block 2).
    return [ForwardItem(a, 4, [5, 6]), ForwardItem(b, 1, [8])], tables


def test_flat_inputs_back_to_back():
    items, tables = items_and_tables()
    flat = flat_inputs(items, tables, BS)
    assert flat.input_ids == [5, 6, 8]
    assert flat.positions == [4, 5, 1]
    assert flat.slots == [5 * BS + 0, 5 * BS + 1, 2 * BS + 1]
    assert flat.seq_lens == [6, 2] and flat.query_lens == [2, 1]
    assert flat.tables == [[3, 5], [2]] and real_rows(flat.query_lens) == [0, 1, 2]


def test_flat_inputs_padded_for_static_shapes():
    """q = 3 rows per request, 3 requests: padding tokens are id 0 at position 0 storing
    nothing (slot -1); a request's seq_len counts its padding so its real queries keep their
    positions; the padding request has q keys (in the null block)."""
    items, tables = items_and_tables()
    flat = flat_inputs(items, tables, BS, q=3, num_reqs=3)
    assert flat.input_ids == [5, 6, 0, 8, 0, 0, 0, 0, 0]
    assert flat.positions == [4, 5, 0, 1, 0, 0, 0, 0, 0]
    assert flat.slots == [20, 21, -1, 9, -1, -1, -1, -1, -1]
    assert flat.seq_lens == [4 + 3, 1 + 3, 3]
    assert real_rows(flat.query_lens, 3) == [0, 1, 3]


def test_a_launched_step_waits_for_the_device_once(tiny_llama, monkeypatch):
    """wait() resolves the host copy into the step's result once; later calls return it."""
    llm = LLM(str(tiny_llama), num_kv_blocks=32, block_size=BS)
    params = SamplingParams(temperature=0, max_tokens=1)
    (want,) = llm.generate([[1, 2, 3]], params, use_tqdm=False)
    engine = llm.engine
    engine.add_request("r", [1, 2, 3], params)
    sched = engine.scheduler.schedule()
    waits = []
    real_wait = HostCopy.wait
    monkeypatch.setattr(HostCopy, "wait", lambda self: waits.append(1) or real_wait(self))
    launched = engine.runner.launch(sched, engine.kv.block_tables)
    first = launched.wait()
    assert launched.wait() is first and len(waits) == 1
    ((request, tokens),) = first.sampled
    assert request.request_id == "r" and tokens == want.outputs[0].token_ids
    assert launched.members == [request]

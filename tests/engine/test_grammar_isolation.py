"""A constraint that compiles slowly cannot hold up the others (issue 41, finding 1): it is
refused by size before compiling, or killed in its worker at the timeout and never cached; the
cache stays under its byte bound; an awaited compile holds no thread. SmolLM2's real tokenizer
(the hostile schemas' compile times in bench/RESULTS.md, "Hostile schemas", were taken with it).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import xgrammar as xgr

from engine import LLM, SamplingParams
from engine.grammar import StructuredOutputs
from engine.grammar.compiler import GrammarCompiler, tokenizer_info

# Compiles for seconds with SmolLM2's vocabulary (bench/hostile_schemas.py), within every limit
# but the time: depth 3, 2643 JSON values, 53 KB.
PATTERNS = {
    "type": "object",
    "properties": {
        f"p{i}": {"type": "string", "pattern": f"[a-z]{{3}}[0-9]+x{i}"} for i in range(880)
    },
}
TIMEOUT = 1.0  # far above a choice's compile (~1 ms), far below PATTERNS' (seconds)


def hostile(i: int) -> StructuredOutputs:
    """PATTERNS made distinct by i, so each is its own compile."""
    return StructuredOutputs(json={**PATTERNS, "title": f"hostile {i}"})


def nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.fixture(scope="module")
def info() -> xgr.TokenizerInfo:
    from transformers import AutoTokenizer

    from engine.models.registry import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    return tokenizer_info(tokenizer, 49152, {2})


def accepts(compiled: xgr.CompiledGrammar, text: str) -> bool:
    """The whole of text, then the end."""
    matcher = xgr.GrammarMatcher(compiled)
    stop = compiled.tokenizer_info.stop_token_ids[0]
    return matcher.accept_string(text) and matcher.accept_token(stop) and matcher.is_terminated()


def test_slow_schema_times_out_uncached_and_others_still_compile(info):
    compiler = GrammarCompiler(info, timeout=TIMEOUT, num_workers=5)
    errors: list[Exception] = []

    def slow(i: int) -> None:
        try:
            compiler.compile(hostile(i))
        except ValueError as e:
            errors.append(e)

    threads = [threading.Thread(target=slow, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    yes_no = compiler.compile(StructuredOutputs(choice=["yes", "no"]))  # while they run
    for t in threads:
        t.join()
    assert accepts(yes_no, "yes") and not accepts(yes_no, "maybe")
    assert len(errors) == 4
    assert all("compiling took longer than 1 s (grammar_compile_timeout)" in str(e) for e in errors)
    assert compiler.workers.num_killed == 4 and compiler.num_timeouts == 4
    assert compiler.cache_len == 1  # only the choice: no timed-out compile is kept
    with pytest.raises(ValueError, match="grammar_compile_timeout"):
        compiler.compile(hostile(0))  # compiles again (and times out again): nothing cached
    assert compiler.num_timeouts == 5
    regex = compiler.compile(StructuredOutputs(regex="[0-9]{3}"))  # right after, within TIMEOUT
    assert accepts(regex, "123")
    compiler.close()


def test_slow_schemas_through_the_engine_leave_a_choice_its_compile(tiny_llama):
    """Two slow schemas in flight (they filled the old 2-thread pool), then a choice generates."""
    llm = LLM(str(tiny_llama), num_kv_blocks=64, grammar_compile_timeout=TIMEOUT)
    errors: list[Exception] = []

    def slow(i: int) -> None:
        p = SamplingParams(structured_outputs={"json": hostile(i).json})
        try:
            llm.engine.compile_constraint(p.structured_outputs)
        except ValueError as e:
            errors.append(e)

    threads = [threading.Thread(target=slow, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    good = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"choice": ["ok!"]})
    (out,) = llm.generate([[65, 66]], good, use_tqdm=False)
    assert out.outputs[0].text == "ok!"
    for t in threads:
        t.join()
    assert [str(e) for e in errors] == [
        "structured_outputs.json: compiling took longer than 1 s (grammar_compile_timeout)"
    ] * 2
    compiler = llm.engine.grammar.compiler
    assert compiler.workers.num_killed == 2 and compiler.cache_len == 1  # the choice alone


@pytest.mark.parametrize(
    "kwargs, so, message",
    [
        (
            {},
            StructuredOutputs(json=nested_arrays(600)),
            "structured_outputs.json is nested 601 levels deep, over the limit "
            "grammar_max_schema_depth=64",
        ),
        (
            {"max_schema_depth": 8},
            StructuredOutputs(structural_tag={"a": [[[[[[[[1]]]]]]]]}),
            "structured_outputs.structural_tag is nested 9 levels deep, over the limit "
            "grammar_max_schema_depth=8",
        ),
        (
            {},
            StructuredOutputs(json={"enum": list(range(9000))}),
            "structured_outputs.json has 9002 JSON values, over the limit "
            "grammar_max_schema_nodes=8192",
        ),
        (
            {"max_schema_nodes": 100},
            StructuredOutputs(json=PATTERNS),
            "structured_outputs.json has 2643 JSON values, over the limit "
            "grammar_max_schema_nodes=100",
        ),
    ],
)
def test_refused_by_size_before_compiling(info, kwargs, so, message):
    compiler = GrammarCompiler(info, timeout=TIMEOUT, **kwargs)
    with pytest.raises(ValueError, match=message):
        compiler.compile(so)
    assert compiler.num_compiled == compiler.num_timeouts == 0  # no compile was started
    compiler.close()


def test_limits_reach_the_engine(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=64, grammar_max_schema_depth=20)
    p = SamplingParams(structured_outputs={"json": nested_arrays(20)})
    with pytest.raises(ValueError, match="nested 21 levels deep.*grammar_max_schema_depth=20"):
        llm.engine.add_request("deep", [65], p)
    ok = SamplingParams(structured_outputs={"json": nested_arrays(19)})
    llm.engine.add_request("fits", [65], ok)
    llm.engine.abort_request("fits")


def test_cache_stays_under_its_byte_bound(info):
    one = GrammarCompiler(info, timeout=10.0)
    size = one.compile(StructuredOutputs(choice=["choice 0"])).memory_size_bytes
    one.close()
    compiler = GrammarCompiler(info, timeout=10.0, cache_bytes=int(size * 3.5))
    kept = []
    for i in range(8):
        kept.append(compiler.compile(StructuredOutputs(choice=[f"choice {i}"])))
        assert compiler.cache_used_bytes <= compiler.cache_bytes
    assert compiler.cache_len == 3
    assert compiler.cache_used_bytes == sum(g.memory_size_bytes for g in kept[-3:])
    # Larger than the whole bound: compiled and returned, not kept (nor anything evicted).
    big = compiler.compile(StructuredOutputs(json=nested_arrays(20)))
    assert big.memory_size_bytes > compiler.cache_bytes
    assert accepts(big, "[" * 20 + '"x"' + "]" * 20)
    assert compiler.cache_len == 3 and compiler.num_compiled == 9
    compiler.compile(StructuredOutputs(choice=["choice 7"]))
    assert compiler.num_hits == 1
    compiler.close()


def test_awaiting_a_compile_holds_no_executor_thread(info):
    """The event loop's only executor thread stays free while a slow compile is awaited."""
    compiler = GrammarCompiler(info, timeout=TIMEOUT)

    async def main() -> bool:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(1))
        task = asyncio.ensure_future(compiler.compile_async(hostile(9)))
        await asyncio.sleep(0)  # the compile starts
        done_first = await loop.run_in_executor(None, task.done)
        with pytest.raises(ValueError, match="grammar_compile_timeout"):
            await task
        return done_first

    assert asyncio.run(main()) is False
    compiler.close()

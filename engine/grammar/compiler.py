"""Constraints -> xgrammar compiled grammars: checks first, then an LRU cache bounded in bytes in
front of compilation that a slow constraint cannot hold up.

`compile` (or `compile_async`, which holds no thread while it waits) is called where a request is
submitted. It returns at once on a cache hit. Otherwise the constraint's size is checked (schema
depth and node count), then it compiles on trial in a worker process that is killed if it runs
past `timeout` (engine.grammar.workers), and only then here, on a thread of its own (xgrammar
releases the GIL, so the engine loop keeps stepping). A compile that timed out is never cached
and leaves nothing running. Every problem is a ValueError naming the constraint: invalid JSON
schema, regex or grammar, a JSON-schema feature xgrammar would silently not enforce, a schema
too deep or too large, a compile that takes too long.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future

import xgrammar as xgr

from engine.grammar.constraint import StructuredOutputs, invalid
from engine.grammar.workers import CompileTimeout, CompileWorkers

# JSON-schema keywords xgrammar 0.2.8 accepts but does not enforce (measured: a violating
# instance is accepted); refusing them beats returning output that does not validate.
UNENFORCED_KEYWORDS = {
    "not": "'not' cannot be enforced",
    "if": "'if'/'then'/'else' cannot be enforced",
    "then": "'if'/'then'/'else' cannot be enforced",
    "else": "'if'/'then'/'else' cannot be enforced",
    "dependentRequired": "'dependentRequired' cannot be enforced",
    "dependentSchemas": "'dependentSchemas' cannot be enforced",
    "dependencies": "'dependencies' cannot be enforced",
    "unevaluatedItems": "'unevaluatedItems' cannot be enforced",
}
# Keywords whose value is a subschema, a list of subschemas, or a map of name -> subschema.
_SCHEMA_VALUED = (
    "additionalProperties",
    "items",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedProperties",
    "additionalItems",
)
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


# JSON-schema formats whose xgrammar 0.2.8 rule admits strings the format forbids, and a pattern
# to compile instead (measured against jsonschema's format checker):
# - ipv4: the octet rule [0-1]?\d?\d admits leading zeros ("01", "000"), which RFC 2673's
#   dotted-quad refuses; a sampled JSON answer had "80.0.237.000";
# - date: any month admits days 01-31 ("2023-02-30", "2023-04-31", "2023-02-29") and year 0000;
#   here the days each month has, February 29 in leap years only, years 0001-9999.
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_YEAR = r"([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP_YEAR = r"([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (
    rf"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
    rf"|02-(0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)"
)
FORMAT_PATTERNS = {"ipv4": rf"{_OCTET}(\.{_OCTET}){{3}}", "date": _DATE}


def with_strict_formats(schema):
    """The schema with every string format listed in FORMAT_PATTERNS replaced by its pattern
    (a copy where anything changes; check_schema has refused pattern beside format)."""
    if isinstance(schema, list):
        return [with_strict_formats(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: with_strict_formats(v) for k, v in schema.items()}
    if isinstance(out.get("format"), str) and out["format"] in FORMAT_PATTERNS:
        out["pattern"] = FORMAT_PATTERNS[out.pop("format")]
    return out


def clean_error(e: Exception) -> str:
    """xgrammar's message without its timestamp and C++ source location."""
    return _XGRAMMAR_PREFIX.sub("", str(e).strip()).strip()


def check_schema(schema, where: str = "#") -> None:
    """Refuse what xgrammar would compile but not enforce (see UNENFORCED_KEYWORDS)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise invalid(
            f"structured_outputs.json: the schema at {where} must be an object",
        )

    def refuse(why: str):
        return ValueError(f"structured_outputs.json: unsupported at {where}: {why}")

    for key, why in UNENFORCED_KEYWORDS.items():
        if key in schema:
            raise refuse(why)
    if schema.get("uniqueItems") is True:
        raise refuse("'uniqueItems' cannot be enforced")
    for key in ("oneOf", "allOf"):
        if len(schema.get(key) or []) > 1:
            raise refuse(f"'{key}' with several subschemas cannot be enforced (use anyOf)")
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise refuse(f"only local $ref ('#/...') is supported, got {ref!r}")
    if "pattern" in schema:
        pattern = schema["pattern"]
        if not isinstance(pattern, str):
            raise refuse("'pattern' must be a string")
        if {"minLength", "maxLength", "format"} & set(schema):
            raise refuse("'pattern' together with minLength/maxLength/format cannot be enforced")
        try:
            xgr.Grammar.from_regex(pattern)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError with a message
            raise refuse(f"pattern {pattern!r}: {clean_error(e)}") from None
    if "format" in schema and {"minLength", "maxLength"} & set(schema):
        raise refuse("'format' together with minLength/maxLength cannot be enforced")
    for key in _SCHEMA_VALUED:
        if isinstance(schema.get(key), dict):
            check_schema(schema[key], f"{where}/{key}")
    for key in _SCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or []):
            check_schema(sub, f"{where}/{key}/{i}")
    if isinstance(schema.get("items"), list):
        for i, sub in enumerate(schema["items"]):
            check_schema(sub, f"{where}/items/{i}")
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                check_schema(sub, f"{where}/{key}/{name}")


def tag_schemas(tag) -> list:
    """The JSON schemas inside a structural tag (its `json_schema` formats), at any depth."""
    if isinstance(tag, list):
        return [s for item in tag for s in tag_schemas(item)]
    if not isinstance(tag, dict):
        return []
    own = [tag["json_schema"]] if tag.get("type") == "json_schema" else []
    return own + [s for key, v in tag.items() if key != "json_schema" for s in tag_schemas(v)]


def compiled_tag(tag, any_whitespace: bool):
    """The structural tag with strict formats in its JSON schemas and, unless any_whitespace,
    each JSON-style schema as a grammar of compact JSON (xgrammar's json_schema format admits
    any whitespace), as the json kind writes it."""
    if isinstance(tag, list):
        return [compiled_tag(item, any_whitespace) for item in tag]
    if not isinstance(tag, dict):
        return tag
    if tag.get("type") != "json_schema":
        return {key: compiled_tag(v, any_whitespace) for key, v in tag.items()}
    schema = with_strict_formats(tag["json_schema"])
    if any_whitespace or tag.get("style", "json") != "json":
        return {**tag, "json_schema": schema}
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    return {"type": "grammar", "grammar": str(grammar)}


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids) -> xgr.TokenizerInfo:
    """xgrammar's view of an HF tokenizer, padded to the model's vocabulary size."""
    return xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
    )


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF for "exactly one of these strings" (JSON string escapes are xgrammar's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def schema_shape(value) -> tuple[int, int]:
    """(nesting depth of objects and arrays, number of values) of a parsed JSON document, walked
    without recursion (a schema nested 1000 deep would overflow Python's stack in check_schema)."""
    max_depth = num_nodes = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        num_nodes += 1
        if isinstance(node, dict | list):
            max_depth = max(max_depth, depth)
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)
    return max_depth, num_nodes


def check_shape(so: StructuredOutputs, max_depth: int, max_nodes: int) -> None:
    """Refuse a JSON schema or structural tag nested deeper than max_depth or with more than
    max_nodes values: compile time grows faster than the text (bench/RESULTS.md, "Hostile
    schemas"), so the 64 KiB cap alone does not bound it."""
    kind = so.kind
    if kind not in ("json", "structural_tag"):
        return
    depth, num_nodes = schema_shape(so.schema if kind == "json" else so.structural_tag)
    if depth > max_depth:
        raise invalid(
            f"structured_outputs.{kind} is nested {depth} levels deep, over the limit "
            f"grammar_max_schema_depth={max_depth}"
        )
    if num_nodes > max_nodes:
        raise invalid(
            f"structured_outputs.{kind} has {num_nodes} JSON values, over the limit "
            f"grammar_max_schema_nodes={max_nodes}"
        )


def check(so: StructuredOutputs, max_depth: int, max_nodes: int) -> None:
    """Every check that needs no compile: size first, then what xgrammar would not enforce."""
    check_shape(so, max_depth, max_nodes)
    if so.kind in ("json", "json_object"):
        check_schema(so.schema)
    for schema in tag_schemas(so.structural_tag):
        check_schema(schema)


def build(compiler: xgr.GrammarCompiler, info: xgr.TokenizerInfo, so: StructuredOutputs):
    """The compiled grammar of a checked constraint (in a worker on trial, then in the engine)."""
    kind = so.kind
    try:
        if kind in ("json", "json_object"):
            compiled = compiler.compile_json_schema(
                json.dumps(with_strict_formats(so.schema)), any_whitespace=so.any_whitespace
            )
        elif kind == "regex":
            compiled = compiler.compile_regex(so.regex)
        elif kind == "grammar":
            compiled = compiler.compile_grammar(so.grammar)
        elif kind == "structural_tag":
            tag = compiled_tag(so.structural_tag, so.any_whitespace)
            compiled = compiler.compile_structural_tag(json.dumps(tag))
        else:
            compiled = compiler.compile_grammar(choice_grammar(so.choice))
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError with a message
        raise invalid(f"structured_outputs.{kind}: {clean_error(e)}") from None
    # An empty language (e.g. "[^\\x00-\\U0010FFFF]", "root ::= x  x ::= x") compiles, but
    # no first token and no end is allowed: refuse it now rather than mid-generation.
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    if not bitmask.any():
        raise invalid(f"structured_outputs.{kind} admits no output at all")
    return compiled


class GrammarCompiler:
    """tokenizer_info: xgrammar's view of the vocabulary, built once per tokenizer
    (`TokenizerInfo.from_huggingface(tokenizer, vocab_size=<the model's>, stop_token_ids=...)`).
    cache_size / cache_bytes: compiled grammars kept (LRU), by count and by xgrammar's
    memory_size_bytes; a grammar larger than cache_bytes is returned but not kept.
    timeout: seconds a compile may run in its worker (and may wait for a free one);
    num_workers: compiles on trial at once."""

    def __init__(
        self,
        tokenizer_info: xgr.TokenizerInfo,
        cache_size: int = 256,
        timeout: float = 10.0,
        num_workers: int = 8,
        cache_bytes: int = 512 << 20,
        max_schema_depth: int = 64,
        max_schema_nodes: int = 8192,
    ):
        self.tokenizer_info = tokenizer_info
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=1, cache_enabled=False
        )
        self.cache_size, self.cache_bytes = cache_size, cache_bytes
        self.timeout = timeout
        self.max_schema_depth, self.max_schema_nodes = max_schema_depth, max_schema_nodes
        self.workers = CompileWorkers(tokenizer_info.serialize_json(), num_workers)
        weakref.finalize(self, self.workers.close)  # idle workers exit with their compiler
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._cache_used = 0  # bytes of the grammars in _cache
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()
        self.num_hits = self.num_compiled = self.num_timeouts = 0

    def compile(self, so: StructuredOutputs) -> xgr.CompiledGrammar:
        """The compiled grammar; blocks the calling thread until it is ready or refused."""
        hit = self._lookup(so)
        return hit if isinstance(hit, xgr.CompiledGrammar) else hit.result()

    async def compile_async(self, so: StructuredOutputs) -> xgr.CompiledGrammar:
        """As `compile`, awaited: the event loop and its executor's threads stay free."""
        hit = self._lookup(so)
        return hit if isinstance(hit, xgr.CompiledGrammar) else await asyncio.wrap_future(hit)

    def close(self) -> None:
        self.workers.close()

    @property
    def cache_len(self) -> int:
        return len(self._cache)

    @property
    def cache_used_bytes(self) -> int:
        return self._cache_used

    def _lookup(self, so: StructuredOutputs) -> xgr.CompiledGrammar | Future:
        """The cached grammar, or the future of its compile (one per constraint at a time)."""
        key = so.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.num_hits += 1
                return self._cache[key]
            future = self._pending.get(key)
            if future is not None:
                return future
            future = self._pending[key] = Future()
        name = "tandem-grammar-compile"
        threading.Thread(target=self._run, args=(so, key, future), daemon=True, name=name).start()
        return future

    def _run(self, so: StructuredOutputs, key: str, future: Future) -> None:
        """Checks (tens of ms for 64 KiB of patterns: not on the caller's event loop), a trial
        in a worker, then the compile here; the future gets the grammar or the error."""
        try:
            check(so, self.max_schema_depth, self.max_schema_nodes)  # raises before any compile
            error, seconds = self.workers.trial(so, self.timeout)
            if error is not None:
                raise invalid(error)
            if seconds > self.workers.demote_after:  # a long compile yields to the engine here too
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            compiled = build(self._compiler, self.tokenizer_info, so)
        except CompileTimeout as e:
            with self._lock:
                self.num_timeouts += 1
                self._pending.pop(key, None)
            future.set_exception(invalid(f"structured_outputs.{so.kind}: {e}"))
            return
        except BaseException as e:  # noqa: BLE001 - every error reaches the waiting callers
            with self._lock:
                self._pending.pop(key, None)
            future.set_exception(e)
            return
        with self._lock:
            self._pending.pop(key, None)
            self.num_compiled += 1
            self._keep(key, compiled)
        future.set_result(compiled)

    def _keep(self, key: str, compiled: xgr.CompiledGrammar) -> None:
        """Cache under both bounds, evicting least recently used first (under self._lock)."""
        size = compiled.memory_size_bytes
        if size > self.cache_bytes:
            return
        self._cache[key] = compiled
        self._cache_used += size
        while self._cache_used > self.cache_bytes or len(self._cache) > self.cache_size:
            _, old = self._cache.popitem(last=False)
            self._cache_used -= old.memory_size_bytes

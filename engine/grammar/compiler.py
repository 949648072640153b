"""Constraints -> xgrammar compiled grammars: checks first, then a bounded LRU cache in front of
compilation on worker threads.

`compile` is called where a request is submitted. It returns at once on a cache hit; otherwise a
worker thread compiles (xgrammar releases the GIL while it does, so an engine loop running in
another thread keeps stepping) and the caller waits at most `timeout` seconds. Every problem is a
ValueError naming the constraint: invalid JSON schema, regex or grammar, a JSON-schema feature
xgrammar would silently not enforce, a compile that takes too long.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import xgrammar as xgr

from engine.grammar.constraint import StructuredOutputs, invalid

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


class GrammarCompiler:
    """tokenizer_info: xgrammar's view of the vocabulary, built once per tokenizer
    (`TokenizerInfo.from_huggingface(tokenizer, vocab_size=<the model's>, stop_token_ids=...)`)."""

    def __init__(
        self,
        tokenizer_info: xgr.TokenizerInfo,
        cache_size: int = 256,
        timeout: float = 10.0,
        num_workers: int = 2,
    ):
        self.tokenizer_info = tokenizer_info
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=1, cache_enabled=False
        )
        self.cache_size = cache_size
        self.timeout = timeout
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="tandem-grammar")
        self.num_hits = self.num_compiled = 0

    def compile(self, so: StructuredOutputs) -> xgr.CompiledGrammar:
        key = so.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.num_hits += 1
                return self._cache[key]
            future = self._pending.get(key)
            if future is None:
                future = self._pending[key] = self._pool.submit(self._build, so, key)
        try:
            return future.result(timeout=self.timeout)
        except FutureTimeout:
            raise invalid(
                f"structured_outputs.{so.kind}: compiling took longer than {self.timeout:g} s "
                "(grammar_compile_timeout)",
            ) from None

    def _build(self, so: StructuredOutputs, key: str) -> xgr.CompiledGrammar:
        try:
            compiled = self._compile_now(so)
        except BaseException:
            with self._lock:
                self._pending.pop(key, None)
            raise
        with self._lock:
            self._pending.pop(key, None)
            self._cache[key] = compiled
            self.num_compiled += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile_now(self, so: StructuredOutputs) -> xgr.CompiledGrammar:
        kind = so.kind
        if kind in ("json", "json_object"):
            check_schema(so.schema)
        for schema in tag_schemas(so.structural_tag):
            check_schema(schema)
        try:
            if kind in ("json", "json_object"):
                compiled = self._compiler.compile_json_schema(
                    json.dumps(with_strict_formats(so.schema)), any_whitespace=so.any_whitespace
                )
            elif kind == "regex":
                compiled = self._compiler.compile_regex(so.regex)
            elif kind == "grammar":
                compiled = self._compiler.compile_grammar(so.grammar)
            elif kind == "structural_tag":
                tag = compiled_tag(so.structural_tag, so.any_whitespace)
                compiled = self._compiler.compile_structural_tag(json.dumps(tag))
            else:
                compiled = self._compiler.compile_grammar(choice_grammar(so.choice))
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError with a message
            raise invalid(f"structured_outputs.{kind}: {clean_error(e)}") from None
        # An empty language (e.g. "[^\\x00-\\U0010FFFF]", "root ::= x  x ::= x") compiles, but
        # no first token and no end is allowed: refuse it now rather than mid-generation.
        bitmask = xgr.allocate_token_bitmask(1, self.tokenizer_info.vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
        if not bitmask.any():
            raise invalid(f"structured_outputs.{kind} admits no output at all")
        return compiled

    @property
    def cache_len(self) -> int:
        return len(self._cache)

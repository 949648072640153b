"""What a request asks its output to match: `StructuredOutputs` (vLLM's names), validated for
shape on construction; its content (the schema, regex or grammar itself) is checked when the
engine compiles it (`engine.grammar.compiler`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.errors import ParamError

KINDS = ("json", "json_object", "regex", "grammar", "choice", "structural_tag")
MAX_CONSTRAINT_CHARS = 65536  # a schema's JSON text, a regex, a grammar, or all choices together


def invalid(message: str) -> ParamError:
    """A constraint the request got wrong: the error names the structured_outputs field."""
    return ParamError("structured_outputs", message)


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of:

    - json: a JSON schema (dict, or its JSON text);
    - json_object: True for any JSON object;
    - regex: the whole output must match it (xgrammar's regex dialect: no lookaround,
      backreferences or word boundaries);
    - grammar: an EBNF grammar in xgrammar's (GBNF-like) syntax, start rule `root`;
    - choice: the output is exactly one of these strings;
    - structural_tag: an xgrammar structural tag (dict, or its JSON text): free text and tagged
      parts whose content is constrained, e.g. tool calls (engine.entrypoints.tools builds them).

    any_whitespace (JSON, and JSON schemas in a structural tag): False (the default) writes
    compact JSON with ", " and ": " separators, so fixed keys and punctuation become tokens the
    grammar forces (free drafts) and a small model cannot wander off into whitespace; True
    allows any JSON whitespace.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    structural_tag: dict | str | None = None
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            kinds = ", ".join(KINDS)
            raise invalid(f"structured_outputs needs exactly one of {kinds}, got {given or 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        if kind in ("json", "structural_tag"):
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise invalid(f"structured_outputs.{kind} is not valid JSON: {e}") from None
            if not isinstance(value, dict):
                what = "JSON schema" if kind == "json" else "structural tag"
                raise invalid(
                    f"structured_outputs.{kind} must be a {what} object, got {value!r:.80}"
                )
            object.__setattr__(self, kind, value)  # keep the parsed object
        elif kind == "json_object" and value is not True:
            raise invalid(f"structured_outputs.json_object must be True, got {value!r}")
        elif kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise invalid(f"structured_outputs.{kind} must be a non-empty string")
        elif kind == "choice" and (not value or not all(isinstance(c, str) and c for c in value)):
            raise invalid(
                f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                f"got {list(value)!r:.80}",
            )
        if kind in ("json", "structural_tag"):
            size = len(json.dumps(value))
        elif kind == "choice":
            size = sum(map(len, value))
        else:  # regex and grammar text; json_object has no text
            size = len(value) if isinstance(value, str) else 0
        if size > MAX_CONSTRAINT_CHARS:
            raise invalid(
                f"structured_outputs.{kind} is {size} characters, over the limit of "
                f"{MAX_CONSTRAINT_CHARS}",
            )
        if not isinstance(self.any_whitespace, bool):
            raise invalid(
                f"structured_outputs.any_whitespace must be a bool, got {self.any_whitespace!r}",
            )

    @classmethod
    def coerce(cls, value: StructuredOutputs | dict | None) -> StructuredOutputs | None:
        """Accept the dataclass or a plain dict with its field names (e.g. from JSON)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(KINDS) - {"any_whitespace"}
            if unknown:
                raise invalid(f"structured_outputs has unknown fields {sorted(unknown)}")
            return cls(**value)
        raise invalid(
            f"structured_outputs must be a StructuredOutputs or a dict, got {value!r:.80}",
        )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def schema(self) -> dict | None:
        """The JSON schema (json_object is the schema {"type": "object"})."""
        return {"type": "object"} if self.json_object else self.json

    @property
    def key(self) -> str:
        """Canonical text of the constraint: the compile cache key."""
        kind = self.kind
        value = self.schema if kind in ("json", "json_object") else getattr(self, kind)
        spec = {"kind": kind, "value": value}
        if kind in ("json", "json_object", "structural_tag"):
            spec["any_whitespace"] = self.any_whitespace
        return json.dumps(spec, sort_keys=True, ensure_ascii=False, separators=(",", ":"))

"""Per-request sampling parameters, validated on construction (vLLM-compatible names)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import IntEnum

from engine.checks import Rule, check_rules, int_in, is_int, number_in
from engine.config import MAX_SPECULATIVE_TOKENS
from engine.errors import ParamError
from engine.grammar.constraint import StructuredOutputs

# Limits on one request (README: "Limits"): what a server accepts before any work is done.
MAX_N = 64  # completions per prompt (the engine also caps n at max_num_seqs)
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024  # per stop string
MAX_TOKEN_ID_LIST = 1024  # stop_token_ids and logit_bias entries

_EPS = 1e-5


class RequestOutputKind(IntEnum):
    """What each RequestOutput of a request holds (vLLM's names and values)."""

    CUMULATIVE = 0  # everything so far, after every step that adds to it (the default)
    DELTA = 1  # only what is new since the request's previous output (streaming)
    FINAL_ONLY = 2  # a single output, once the request has finished (batch generation)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy (exact argmax)
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0  # HF style, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI style, over output tokens
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # top-N logprobs per sampled token (plus the sampled one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    num_speculative_tokens: int | None = None  # drafts per step; None: the engine's default
    # Predicted Outputs: text (or token ids) the output will mostly repeat, verified as drafts.
    prediction: str | list[int] | None = None
    # Reasoning models: at most this many tokens inside <think>...</think>, then `</think>` is
    # forced (engine.grammar.thinking); None: no limit.
    thinking_token_budget: int | None = None
    # Constrained output: a JSON schema, json_object, regex, EBNF grammar or choice list
    # (a StructuredOutputs or a dict with its field names).
    structured_outputs: StructuredOutputs | dict | None = None
    # CUMULATIVE, DELTA or FINAL_ONLY (or their names in lower case, for JSON clients).
    output_kind: RequestOutputKind | str = RequestOutputKind.CUMULATIVE
    extra: dict = field(default_factory=dict)  # room for later features

    def __post_init__(self) -> None:
        for name in ("stop", "stop_token_ids"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str | list | tuple):
                raise ParamError(name, f"{name} must be a list (or None), got {v!r}")
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.structured_outputs = StructuredOutputs.coerce(self.structured_outputs)
        self.output_kind = _output_kind(self.output_kind)
        check_rules(self, _RULES, ParamError)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError(
                "min_tokens",
                f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}",
            )
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ParamError(
                "stop",
                f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                f"characters, got {len(self.stop)} (longest {max(map(len, self.stop))})",
            )
        if len(self.stop_token_ids) > MAX_TOKEN_ID_LIST:
            raise ParamError(
                "stop_token_ids",
                f"stop_token_ids takes at most {MAX_TOKEN_ID_LIST} ids, "
                f"got {len(self.stop_token_ids)}",
            )
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)

    def with_output_kind(self, kind: RequestOutputKind) -> SamplingParams:
        """A copy that differs only in output_kind (the caller's object stays as it is)."""
        return replace(self, output_kind=kind)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids given by the user must exist in the model's vocabulary."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", list((self.logit_bias or {}).keys())),
        ):
            for tid in ids:
                if tid >= vocab_size:
                    raise ParamError(
                        name,
                        f"{name} contains token id {tid}, outside the vocabulary of {vocab_size}",
                    )


def _output_kind(value) -> RequestOutputKind:
    if isinstance(value, RequestOutputKind):
        return value
    names = {k.name.lower(): k for k in RequestOutputKind}
    if isinstance(value, str) and value.lower() in names:
        return names[value.lower()]
    raise ParamError("output_kind", f"output_kind must be one of {', '.join(names)}, got {value!r}")


# Each field's rule: (name, check, what the message says it must be). Checked in this order.
_RULES: list[Rule] = [
    ("n", int_in(1, MAX_N), f"must be an integer in [1, {MAX_N}]"),
    ("temperature", number_in(0.0, 1e6, high_open=True), "must be a number in [0, 1e6)"),
    ("top_p", number_in(0.0, 1.0, low_open=True), "must be in (0, 1]"),
    ("top_k", int_in(0), "must be an integer >= 0 (0 or -1 disables)"),
    ("min_p", number_in(0.0, 1.0), "must be in [0, 1]"),
    (
        "seed",
        int_in(-(2**63), 2**63 - 1, optional=True),
        "must be an integer in [-2**63, 2**63) or None",
    ),
    ("max_tokens", int_in(1, optional=True), "must be an integer >= 1 or None"),
    ("min_tokens", int_in(0), "must be an integer >= 0"),
    ("stop", lambda v: all(isinstance(s, str) and s for s in v), "must be non-empty strings"),
    (
        "stop_token_ids",
        lambda v: all(is_int(t) and t >= 0 for t in v),
        "must be non-negative integers",
    ),
    ("repetition_penalty", number_in(0.0, 100.0, low_open=True), "must be in (0, 100]"),
    ("presence_penalty", number_in(-2.0, 2.0), "must be in [-2, 2]"),
    ("frequency_penalty", number_in(-2.0, 2.0), "must be in [-2, 2]"),
    (
        "num_speculative_tokens",
        int_in(0, MAX_SPECULATIVE_TOKENS, optional=True),
        f"must be an integer in [0, {MAX_SPECULATIVE_TOKENS}] or None",
    ),
    ("thinking_token_budget", int_in(0, optional=True), "must be an integer >= 0 or None"),
    ("logprobs", int_in(0, 20, optional=True), "must be an integer in [0, 20] or None"),
    ("prompt_logprobs", int_in(0, 20, optional=True), "must be an integer in [0, 20] or None"),
]


def _logit_bias(bias) -> dict[int, float]:
    """{token id: bias in [-100, 100]}, keys given as ints or digit strings (JSON)."""

    def bad(value, why: str) -> ParamError:
        return ParamError("logit_bias", f"logit_bias {why}, got {value!r}")

    if not isinstance(bias, dict):
        raise bad(bias, "must be a dict {token_id: bias}")
    if len(bias) > MAX_TOKEN_ID_LIST:
        raise bad(len(bias), f"takes at most {MAX_TOKEN_ID_LIST} entries")
    fixed = {}
    for k, v in bias.items():
        if isinstance(k, str) and k.isdigit():
            k = int(k)
        if not is_int(k):
            raise bad(k, "keys must be integer token ids")
        if k < 0:
            raise bad(k, "keys must be non-negative token ids")
        if not number_in(-100.0, 100.0)(v):
            raise bad(v, "values must be in [-100, 100]")
        fixed[k] = float(v)
    return fixed

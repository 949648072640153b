"""Per-request sampling parameters, validated on construction (vLLM-compatible names)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import IntEnum

from engine.config import MAX_SPECULATIVE_TOKENS
from engine.grammar.constraint import StructuredOutputs

# Limits on one request (README: "Limits"): what a server accepts before any work is done.
MAX_N = 64  # completions per prompt (the engine also caps n at max_num_seqs)
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024  # per stop string
MAX_TOKEN_ID_LIST = 1024  # stop_token_ids and logit_bias entries
SEED_RANGE = (-(2**63), 2**63)

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
                raise ValueError(f"{name} must be a list (or None), got {v!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.structured_outputs = StructuredOutputs.coerce(self.structured_outputs)
        self.output_kind = _output_kind(self.output_kind)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, value, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {value!r}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", self.n, f"must be an integer in [1, {MAX_N}]")
        if not isinstance(self.temperature, int | float) or not 0.0 <= self.temperature < 1e6:
            raise bad("temperature", self.temperature, "must be a number in [0, 1e6)")
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", self.top_k, "must be an integer >= 0 (0 or -1 disables)")
        if not isinstance(self.min_p, int | float) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if self.seed is not None and (
            not is_int(self.seed) or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]
        ):
            raise bad("seed", self.seed, "must be an integer in [-2**63, 2**63) or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 1 or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"must be <= max_tokens={self.max_tokens}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", self.stop, "must be non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(
                f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                f"characters, got {len(self.stop)} (longest {max(map(len, self.stop))})"
            )
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "must be non-negative integers")
        if len(self.stop_token_ids) > MAX_TOKEN_ID_LIST:
            raise ValueError(
                f"stop_token_ids takes at most {MAX_TOKEN_ID_LIST} ids, "
                f"got {len(self.stop_token_ids)}"
            )
        if not isinstance(self.repetition_penalty, int | float) or not (
            0.0 < self.repetition_penalty <= 100.0
        ):
            raise bad("repetition_penalty", self.repetition_penalty, "must be in (0, 100]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not -2.0 <= v <= 2.0:
                raise bad(name, v, "must be in [-2, 2]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", self.logit_bias, "must be a dict {token_id: bias}")
            if len(self.logit_bias) > MAX_TOKEN_ID_LIST:
                raise ValueError(
                    f"logit_bias takes at most {MAX_TOKEN_ID_LIST} entries, "
                    f"got {len(self.logit_bias)}"
                )
            fixed = {}
            for k, v in self.logit_bias.items():
                if isinstance(k, str) and k.isdigit():
                    k = int(k)
                if not is_int(k):
                    raise bad("logit_bias", k, "keys must be integer token ids")
                if k < 0:
                    raise bad("logit_bias", k, "keys must be non-negative token ids")
                if not isinstance(v, int | float) or not -100.0 <= v <= 100.0:
                    raise bad("logit_bias", v, "values must be in [-100, 100]")
                fixed[k] = float(v)
            self.logit_bias = fixed
        k = self.num_speculative_tokens
        if k is not None and (not is_int(k) or not 0 <= k <= MAX_SPECULATIVE_TOKENS):
            raise bad(
                "num_speculative_tokens",
                k,
                f"must be an integer in [0, {MAX_SPECULATIVE_TOKENS}] or None",
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= 20):
                raise bad(name, v, "must be an integer in [0, 20] or None")

    def with_output_kind(self, kind: RequestOutputKind) -> SamplingParams:
        """A copy that differs only in output_kind (the caller's object stays as it is)."""
        copy = replace(self)  # __post_init__ normalised every field already
        copy.output_kind = kind
        return copy

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
                    raise ValueError(
                        f"{name} contains token id {tid}, outside the vocabulary of {vocab_size}"
                    )


def _output_kind(value) -> RequestOutputKind:
    if isinstance(value, RequestOutputKind):
        return value
    names = {k.name.lower(): k for k in RequestOutputKind}
    if isinstance(value, str) and value.lower() in names:
        return names[value.lower()]
    raise ValueError(f"output_kind must be one of {', '.join(names)}, got {value!r}")

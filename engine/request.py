"""Engine-side request state. One `Request` per generated sequence (n > 1 makes n of them)."""

from __future__ import annotations

import logging
from enum import IntEnum
from typing import TYPE_CHECKING

import torch

from engine.block_pool import extend_block_hashes
from engine.errors import NonFiniteLogits, RequestError
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.grammar.matcher import RequestGrammar
    from lora.adapter import LoRAAdapter

logger = logging.getLogger("tandem.engine")


class RequestStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FORK_PENDING = 3  # n > 1 sibling waiting for its leader's prompt to be computed
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13  # its own processing raised (Request.fail); the engine went on


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


# One letter per output token: p plain (no drafts that step), f forced token accepted,
# a proposer's draft accepted, b bonus (every draft held), r resampled (replaced a rejected draft).
TOKEN_KINDS = {"p": "plain", "f": "forced", "a": "accepted", "b": "bonus", "r": "resampled"}


def step_token_kinds(num_drafts: int, num_forced: int, num_accepted: int) -> str:
    """Kinds of the tokens a verification emits: the accepted drafts, then one more token."""
    if num_drafts == 0:
        return "p"
    drafts = "".join("f" if j < num_forced else "a" for j in range(num_accepted))
    return drafts + ("b" if num_accepted == num_drafts else "r")


class TokenHistory:
    """Output counts derived from `token_ids` (prompt + output) and `num_prompt_tokens`."""

    __slots__ = ()

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


class Request(TokenHistory):
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: set[int],
        max_model_len: int,
        index: int = 0,
        cache_extra_keys: bytes = b"",
        block_size: int = 16,
    ):
        self.request_id = request_id
        self.index = index  # position among the n completions of its group
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        # Async scheduling: tokens sampled by a step in flight, not yet in token_ids. The
        # scheduler counts them (the next step computes the first from the device's copy).
        self.num_pending = 0
        # Tokens counted in num_computed_tokens whose K/V a launched step is still writing.
        self.num_inflight_tokens = 0
        self.status = RequestStatus.WAITING
        self.eos_token_ids = set() if params.ignore_eos else eos_token_ids
        budget = max_model_len - self.num_prompt_tokens
        self.max_output_tokens = min(params.max_tokens or budget, budget)
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first schedule; -1 = not yet
        self.cache_extra_keys = cache_extra_keys
        self.block_size = block_size
        self.block_hashes: list[bytes] = []
        self.generator: torch.Generator | None = None  # seeded requests' own draws, on CPU
        self._device_generator: torch.Generator | None = None  # the same seed elsewhere
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed + 1_000_003 * index)
        self.siblings: list[Request] = []  # n > 1: requests forked from this leader
        # Tokens whose KV the draft model holds (it may lag the target); a step's drafts live on
        # its SchedulerOutput, the speculation counters in spec/.
        self.num_draft_computed = 0
        self.grammar: RequestGrammar | None = None  # set when params.structured_outputs is
        self.lora: LoRAAdapter | None = None  # the request's adapter (target model)
        self.draft_lora: LoRAAdapter | None = None  # the draft model's adapter, if any
        self.error: str | None = None  # set by fail(); the engine ends its group after the step
        self.error_status = 500  # 400 when the request itself was at fault (RequestError)
        self.has_invalid_kv = False  # its logits were NaN: its blocks must not be cached

    def fail(self, where: str, exc: BaseException) -> None:
        """This request's own processing raised (its grammar, its detokenizer, ...): keep a
        message for the client (a RequestError's own; otherwise one without internals, the
        traceback going to the log) and let the engine end the request's group at the end of
        the step, leaving every other request untouched."""
        if self.error is not None:
            return
        if isinstance(exc, RequestError):
            self.error, self.error_status = str(exc), 400
            return
        if isinstance(exc, NonFiniteLogits):
            logger.error("request %s failed: %s", self.request_id, exc)
            self.error, self.has_invalid_kv = str(exc), True
            return
        logger.error("request %s failed in its %s", self.request_id, where, exc_info=exc)
        self.error = f"internal error in this request's {where} ({type(exc).__name__})"

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose K/V is still to compute, those sampled in flight included."""
        return self.num_tokens + self.num_pending - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Every token but the last is computed: next step is a decode (or a verification)."""
        return self.num_uncomputed == 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:  # every FINISHED_* status is at least FINISHED_STOPPED
        return self.status >= RequestStatus.FINISHED_STOPPED

    def generator_on(self, device: torch.device) -> torch.Generator | None:
        """This request's own generator on device (None when unseeded): `generator` on CPU,
        else one made from the same initial state, on first use."""
        if self.generator is None or device.type == "cpu":
            return self.generator
        if self._device_generator is None:
            seed = self.generator.initial_seed()
            self._device_generator = torch.Generator(device).manual_seed(seed)
        return self._device_generator

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def full_block_hashes(self) -> list[bytes]:
        """Chained hashes of every full block of tokens, extended incrementally."""
        return extend_block_hashes(
            self.block_hashes, self.token_ids, self.block_size, self.cache_extra_keys
        )

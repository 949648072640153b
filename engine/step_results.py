"""A launched step's results: what it computed on the device (DeviceResults), what turns
their host copy into per-request tokens, verdicts and logprobs (PendingStep.resolve), and the
handle the engine waits on (LaunchedStep)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.device import HostCopy
from engine.errors import NonFiniteLogits
from engine.rejection import PendingVerify, VerifyResult, VerifyRow, verify_greedy
from engine.request import Request
from engine.sampler import RawLogprobs, TopLogprobs

NAN_MESSAGE = "the model's output for this request is not a number (NaN logits)"


@dataclass
class StepResult:
    # (request, emitted tokens): one token, under speculation the accepted drafts plus one,
    # or a lookahead call's tokens (EngineConfig.num_scheduler_steps)
    sampled: list[tuple[Request, list[int]]] = field(default_factory=list)
    num_accepted: dict[Request, int] = field(default_factory=dict)  # drafts accepted
    logprobs: dict[Request, list[RawLogprobs]] = field(default_factory=dict)  # per emitted token
    # The prompt positions this step computed for requests that ask: (first position, entries).
    prompt_logprobs: dict[Request, tuple[int, list[RawLogprobs]]] = field(default_factory=dict)
    # Set by the engine once verdicts are in: each emitted token's kind (request.TOKEN_KINDS;
    # absent: one plain token), and the drafts the target rejected.
    kinds: dict[Request, str] = field(default_factory=dict)
    rejected: dict[Request, list[int]] = field(default_factory=dict)


@dataclass
class DeviceResults:
    """What a step computed for the host, still on the device; copied back in one go."""

    argmax: torch.Tensor | None = None  # [R] every sampling row's argmax (for greedy members)
    tokens: torch.Tensor | None = None  # [S, rows] verification's emitted tokens, then -1
    num_accepted: torch.Tensor | None = None  # [S] drafts accepted per verified member
    logprobs: TopLogprobs | None = None  # the verified members' rows whose requests ask
    prompt_logprobs: list[TopLogprobs] = field(default_factory=list)  # per PromptAsk
    is_nan: torch.Tensor | None = None  # [R] whether a sampling row's logits hold a NaN
    # LayerStack.decode's steps: [B, S] each member's tokens, and is_nan [B, S] per step
    decoded: torch.Tensor | None = None


@dataclass
class PromptAsk:
    """Prompt logprobs this step computes for a request: positions from `first`, predicting
    `targets` (the prompt tokens after them), with the top `num_top`."""

    request: Request
    first: int
    targets: list[int]
    num_top: int


@dataclass
class PendingStep:
    """A launched step's results: `device` on the device, and what turns their host copy into
    a StepResult. Members sample in span order: a greedy member whose logits nothing reshapes
    (`fast`) reads its rows' argmax; the others (`slow`, in order) were verified together."""

    device: DeviceResults
    members: list[Request] = field(default_factory=list)
    spans: list[VerifyRow] = field(default_factory=list)  # starts index the step's logits rows
    fast: list[bool] = field(default_factory=list)
    slow: list[int] = field(default_factory=list)  # members verified, in verification order
    verify: PendingVerify | None = None
    # Verified members that asked for logprobs: (member index, its span within the slow rows).
    logprob_spans: list[tuple[int, VerifyRow]] = field(default_factory=list)
    prompt: list[PromptAsk] = field(default_factory=list)

    def resolve(self, host: DeviceResults) -> StepResult:
        """The step's results from the host copy of `device`."""
        result = StepResult()
        if host.decoded is not None:
            return self._decoded(host, result)
        verdicts: list[VerifyResult | None] = [None] * len(self.spans)
        if self.slow:
            slow_verdicts = self.verify.results(host.tokens.tolist(), host.num_accepted.tolist())
            for i, verdict in zip(self.slow, slow_verdicts, strict=True):
                verdicts[i] = verdict
        if host.argmax is not None:
            argmax = host.argmax.tolist()
            for i, fast in enumerate(self.fast):
                if fast:
                    verdicts[i] = verify_greedy(self.spans[i], argmax)
        if host.is_nan is not None and host.is_nan.any():  # they fail alone: NaN argmax tokens
            self._fail_nan(host.is_nan.tolist())
        for span, member, verdict in zip(self.spans, self.members, verdicts, strict=True):
            result.sampled.append((member, verdict.tokens))
            if span.drafts:
                result.num_accepted[member] = verdict.num_accepted
        if self.logprob_spans:  # each asking member's rows, up to where its walk ended
            picks, owners, row = [], [], 0
            for i, span in self.logprob_spans:
                member = self.members[i]
                for j, token in enumerate(verdicts[i].tokens):
                    picks.append((row + j, token, member.params.logprobs))
                    owners.append(member)
                row += span.num_rows
            for member, entry in zip(owners, host.logprobs.entries(picks), strict=True):
                result.logprobs.setdefault(member, []).append(entry)
        for ask, top in zip(self.prompt, host.prompt_logprobs, strict=True):
            picks = [(j, t, ask.num_top) for j, t in enumerate(ask.targets)]
            result.prompt_logprobs[ask.request] = (ask.first, top.entries(picks))
        return result

    def _decoded(self, host: DeviceResults, result: StepResult) -> StepResult:
        """Each member's tokens of a decode call, up to its first NaN step: a NaN at the first
        fails the request; at a later one, the tokens before it are kept and the next step
        meets the NaN again (the same logits), as one step at a time would."""
        for member, tokens, nans in zip(
            self.members, host.decoded.tolist(), host.is_nan.tolist(), strict=True
        ):
            if True in nans:
                tokens = tokens[: nans.index(True)]
                if not tokens:
                    member.fail("logits", NonFiniteLogits(NAN_MESSAGE))
                    continue
            result.sampled.append((member, tokens))
            if len(tokens) > 1:
                result.num_accepted[member] = len(tokens) - 1
        return result

    def _fail_nan(self, is_nan: list[bool]) -> None:  # is_nan: [R] per logits row
        for span, member in zip(self.spans, self.members, strict=True):
            if any(is_nan[span.start : span.start + span.num_rows]):
                member.fail("logits", NonFiniteLogits(NAN_MESSAGE))


class LaunchedStep:
    """A step whose work is queued on the device, its results' copy to the host queued behind
    it: `wait()` brings them back. `members`: the requests that sample in it."""

    def __init__(self, pending: PendingStep, device: torch.device):
        self.pending = pending
        self.members = pending.members
        self._copy = HostCopy(pending.device, device)
        self._result: StepResult | None = None

    def wait(self) -> StepResult:
        if self._result is None:
            self._result = self.pending.resolve(self._copy.wait())  # the step's one wait
        return self._result

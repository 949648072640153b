"""Beam search over the engine: beams are requests that share their common prefix's KV blocks.

Each round, every live beam of a prompt runs one greedy step and brings back its top-K
next-token log-probabilities (K = (1 + number of EOS ids) * beam_width, so at least beam_width
candidates never end). The round's candidates are ranked by accumulated log-probability; the
best beam_width that do not end become the next beams, and those among the best beam_width that
end (an EOS token, or max_tokens reached) become finished hypotheses scored
cum_logprob / num_tokens ** length_penalty, of which the best beam_width are kept. The search
stops when the best live beam cannot beat the worst finished hypothesis any more (HF's default
heuristic, early_stopping=False) or at max_tokens. This is HF `generate(num_beams=...)`'s rule,
step for step, scores in float32 as HF keeps them, so greedy beams equal HF's.

KV: a beam's request computed its prefix once. The first candidate of a beam reuses its request
(the token the step sampled is not computed yet, so it is simply replaced); every further
candidate forks it (`Scheduler.fork`: the child shares every block, copy-on-write on its first
append), and a beam that has no candidate is aborted, its blocks returned (those its children
share stay). A beam that has brought back its candidates is held out of scheduling until its
round is complete, so each beam advances exactly one token per round whatever the batch does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from engine.checks import Rule, check_rules, int_in, number_in
from engine.errors import ParamError
from engine.outputs import RequestGroup
from engine.request import Request, RequestStatus
from engine.sampling_params import RequestOutputKind, SamplingParams

MAX_CANDIDATES = 20  # the engine's top-logprobs limit bounds K


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0  # finished scores are cum_logprob / num_tokens ** length_penalty
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        check_rules(self, _RULES, ParamError)


_RULES: list[Rule] = [
    ("beam_width", int_in(1), "must be an integer >= 1"),
    ("max_tokens", int_in(1), "must be an integer >= 1"),
    # a finite bound: len ** length_penalty must stay a float (NaN fails the check too)
    ("length_penalty", number_in(-10, 10), "must be a number in [-10, 10]"),
]


@dataclass
class BeamSequence:
    token_ids: list[int]  # generated tokens (an ending EOS included)
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    text: str = ""
    finish_reason: str = "length"  # "stop" when it ended with an EOS token


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]  # best first, beam_width of them


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


@dataclass
class _Beam:
    request: Request
    score: torch.Tensor  # float32 accumulated log-probability
    top: list[tuple[int, float]] | None = None  # this round's candidates: (token, logprob)


@dataclass
class _Search:
    """One prompt's search: its live beams, its finished hypotheses, where it stands."""

    prompt: list[int]
    beams: list[_Beam] = field(default_factory=list)
    finished: list[tuple[torch.Tensor, list[int], torch.Tensor]] = field(default_factory=list)
    improvable: bool = True
    done: bool = False

    @property
    def num_generated(self) -> int:
        return len(self.beams[0].request.token_ids) - len(self.prompt) - 1


class BeamSearch:
    """Runs beam searches for several prompts at once on one engine (its other requests, if
    any, keep running beside them)."""

    def __init__(self, engine, params: BeamSearchParams, cache_salt: str | None = None):
        """cache_salt: the prefix cache's salt for every beam (forks keep their parent's), as
        an ordinary request's: a server's tenant shares no KV with another's."""
        self.engine, self.params, self.cache_salt = engine, params, cache_salt
        eos = set() if params.ignore_eos else set(engine.eos_token_ids)
        self.eos = eos
        self.num_candidates = (1 + len(eos)) * params.beam_width
        if self.num_candidates > MAX_CANDIDATES:
            raise ParamError(
                "beam_width",
                f"beam_width={params.beam_width} needs {self.num_candidates} candidates per beam; "
                f"at most {MAX_CANDIDATES} (beam_width <= {MAX_CANDIDATES // (1 + len(eos))})",
            )
        # Greedy steps that bring back the top-K log-probabilities; the search decides when a
        # beam ends, so the engine never stops one on EOS.
        self.step_params = SamplingParams(
            temperature=0,
            max_tokens=params.max_tokens,
            ignore_eos=True,
            logprobs=self.num_candidates,
            num_speculative_tokens=0,
            output_kind=RequestOutputKind.DELTA,
            extra={"lands_first": True},  # never overlapped: the search rewrites its tokens
        )
        self._ids = itertools.count()
        self.beam_of: dict[str, tuple[_Search, _Beam]] = {}
        self.searches: list[_Search] = []

    def run(self, prompts: list[list[int]]) -> list[BeamSearchOutput]:
        """Search every prompt to the end, stepping the engine."""
        try:
            self.start(prompts)
            while not self.done:
                self.feed(self.engine.step())
        finally:
            self.close()
        return self.outputs()

    def start(self, prompts: list[list[int]]) -> None:
        """Submit every prompt's first beam; then feed() the engine's outputs after each step."""
        self.searches = [_Search(list(p)) for p in prompts]
        for search in self.searches:
            self._start(search)

    def feed(self, outputs) -> None:
        """One engine step's outputs: beams bring back candidates; complete rounds advance."""
        for out in outputs:
            self._collect(out)
        for search in self.searches:
            if not search.done and all(b.top is not None for b in search.beams):
                self._advance(search)

    @property
    def done(self) -> bool:
        return all(s.done for s in self.searches)

    def close(self) -> None:
        """Abort the beams still live (a search given up, or one that failed mid-round: its
        new forks too)."""
        self._drop([beam for _, beam in list(self.beam_of.values())])

    def outputs(self) -> list[BeamSearchOutput]:
        return [self._output(s) for s in self.searches]

    def _start(self, search: _Search) -> None:
        rid = self._new_id()
        self.engine.add_request(rid, search.prompt, self.step_params, cache_salt=self.cache_salt)
        request = self.engine.groups[rid].leader
        beam = _Beam(request, _f32(0.0))
        search.beams.append(beam)
        self.beam_of[rid] = (search, beam)

    def _new_id(self) -> str:
        return f"beam-{id(self):x}-{next(self._ids)}"

    def _collect(self, out) -> None:
        """A beam's step came back: its candidates, and it waits for the rest of its round."""
        found = self.beam_of.get(out.request_id)
        if found is None or not out.outputs:
            return
        _, beam = found
        (completion,) = out.outputs
        assert beam.top is None and len(completion.token_ids) == 1, "one token per round"
        position = completion.logprobs[-1]
        ranked = sorted(position.items(), key=lambda kv: kv[1].rank)
        beam.top = [(t, lp.logprob) for t, lp in ranked if lp.rank <= self.num_candidates]
        self.engine.scheduler.held.add(beam.request)

    def _advance(self, search: _Search) -> None:
        """One round of HF's beam step for this prompt (see the module docstring)."""
        p, width = self.params, self.params.beam_width
        candidates = [
            (beam.score + _f32(lp), beam, token) for beam in search.beams for token, lp in beam.top
        ]
        # HF ranks over every beam's whole vocabulary; each beam's top K hold the global top K.
        candidates.sort(key=lambda c: -c[0].item())
        candidates = candidates[: self.num_candidates]
        num_tokens = search.num_generated + 1  # each candidate's generated length
        at_limit = num_tokens >= p.max_tokens
        ends = [at_limit or token in self.eos for _, _, token in candidates]
        if search.improvable:
            for rank, ((score, beam, token), end) in enumerate(zip(candidates, ends, strict=True)):
                if end and rank < width:
                    tokens = self._generated(search, beam) + [token]
                    normed = score / (num_tokens**p.length_penalty)
                    search.finished.append((normed, tokens, score))
            search.finished.sort(key=lambda f: -f[0].item())
            del search.finished[width:]
        going = [c for c, end in zip(candidates, ends, strict=True) if not end][:width]
        if at_limit or not going:
            self._finish(search)
            return
        search.beams = self._next_beams(search, going)
        best = search.beams[0].score / (num_tokens**p.length_penalty)
        if len(search.finished) == width and not best > search.finished[-1][0]:
            search.improvable = False
            self._finish(search)

    def _finish(self, search: _Search) -> None:
        """The search ends: its live beams are dropped (its finished hypotheses stay)."""
        search.done = True
        self._drop(search.beams)
        search.beams = []

    def _generated(self, search: _Search, beam: _Beam) -> list[int]:
        """The beam's generated tokens before this round's (its last token is the step's own
        sample, about to be replaced)."""
        return beam.request.token_ids[len(search.prompt) : -1]

    def _next_beams(self, search: _Search, going) -> list[_Beam]:
        """The chosen candidates as requests: a beam's first candidate takes over its request,
        the others fork it; beams left without a candidate are dropped."""
        reused: set[int] = set()
        beams = []
        for score, parent, token in going:
            if id(parent) not in reused:
                reused.add(id(parent))
                request = parent.request
                request.token_ids[-1] = token
                # A block hash that covered the replaced token is stale.
                del request.block_hashes[(len(request.token_ids) - 1) // request.block_size :]
            else:
                request = self._fork(parent.request, token)
            beam = _Beam(request, score)
            self.beam_of[request.request_id] = (search, beam)
            beams.append(beam)
        self._drop([b for b in search.beams if id(b) not in reused])
        for beam in beams:
            self.engine.scheduler.held.discard(beam.request)
        return beams

    def _fork(self, parent: Request, token: int) -> Request:
        engine = self.engine
        rid = self._new_id()
        ids = parent.token_ids[:-1] + [token]
        child = Request(
            rid,
            ids,
            self.step_params,
            engine.eos_token_ids,
            engine.max_model_len,
            0,
            parent.cache_extra_keys,
            parent.block_size,
        )
        child.lora = parent.lora
        engine.groups[rid] = RequestGroup(rid, None, [child], engine.decoder)
        if parent.status == RequestStatus.RUNNING:
            engine.scheduler.fork(parent, child)  # shares its blocks: copy-on-write
        else:  # preempted: it recomputes its tokens (the prefix cache may still hold them)
            engine.scheduler.add(child)
        return child

    def _drop(self, beams: list[_Beam]) -> None:
        for beam in beams:
            rid = beam.request.request_id
            self.beam_of.pop(rid, None)
            self.engine.scheduler.held.discard(beam.request)
            self.engine.abort_request(rid)

    def _output(self, search: _Search) -> BeamSearchOutput:
        decode = self.engine.decoder
        sequences = [
            BeamSequence(
                tokens,
                cum.item(),
                score.item(),
                decode(tokens, skip_special_tokens=True),
                "stop" if tokens[-1] in self.eos else "length",
            )
            for score, tokens, cum in search.finished
        ]
        return BeamSearchOutput(search.prompt, sequences)

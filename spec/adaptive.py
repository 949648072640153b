"""Adaptive speculation: each step, pick every decoding request's number of drafts k so that the
expected tokens emitted per second of step time is highest (goodput, as in SmartSpec, Liu et al.
2024).

Two things are estimated online, nothing is assumed about the machine:

- per request, the probability `a` that a draft is accepted given that the ones before it were:
  exponentially decayed counts of accepted drafts over verified positions (a rejection ends a
  step's chain), shrunk towards the engine-wide rate while a request has little history; and
  engine-wide, the same rate at each draft position, since it changes with depth (once a copied
  span is entered it tends to run on). A request's rate at position j is the engine's at j,
  shifted in log-odds by how the request compares with the engine; draft j then adds
  P(drafts 1..j all land) expected tokens (a^j if acceptance were the same at every depth);
- step times by exponentially weighted least squares: the target's forward (plus sampling and
  verification) over the rows of decode steps as a + b * rows + c * keys (`StepCost`: keys, the
  context the rows attend, summed over them), and, with a draft model, each draft pass over its
  rows (a + b * rows). A step that carries a prompt chunk is not fitted: a chunk's rows cost
  what a prefill's do (a GEMM over hundreds of rows), not what a verified row adds to a decode
  step, and a few 1024-row chunks would otherwise set the line's slope.

A plan starts from no proposed drafts: per decode 1 token plus the drafts that ride ahead of the
proposer's (forced tokens and a prediction's, counted as accepted; a prediction gives a request up
to engine.config.MAX_PREDICTED_DRAFTS, a longer step than any proposer's), at the target's time
for all those rows. It adds
draft positions level by level: at level j the candidates are the requests that took j - 1 drafts,
best `a` first, and the engine takes the number of them that maximises tokens / seconds, paying b
per verified row and, with a draft model, the pass's fixed cost once plus its per-row cost (at
level 1: the tokens the draft must catch up on). Levels go on while candidates are left (a level
that costs more than it returns may open deeper ones that repay it) and the plan is the best one
met: with a large batch, or low acceptance, that is k = 0, and speculation is off.
Prefill rows are left out of the comparison: they cost the same with or without drafts.

A draft far behind its request (a long prompt it never saw, or steps it sat out) computes the
gap once and then drafts for the rest of the request: the gap's rows are spread over the steps
the request has left at the tokens per step it would draft at, so a 2048-token prompt with 64
tokens to go keeps the draft off, and with 2048 to go turns it on.

A closed batch (an offline `generate`: every request there from the start, none waiting) ends
when its last request does. Drafts for a request that finishes, even at one token a step, before
another request surely does only add rows to steps the batch takes anyway, so they are dropped.

Until the cost fits have seen rows of at least two sizes, requests take their cap on every other
step and no drafts on the others (two row counts, so the fits become ready).

Plans without drafts teach the estimates nothing: the cost fit keeps its last line and the
acceptance counts fade towards the prior, so a fit whose rows look dear (verified rows attend a
long context) could keep a prior-rate request off for good, although its drafts would land. So
after EXPLORE_AFTER such plans in a row the best candidate is given one draft (proposers without
a draft model: a draft model's first draft after idle steps computes all it sat out), on every plan
until one is verified (a proposer without drafts for it costs nothing); an explored draft that
is rejected doubles the wait, up to EXPLORE_AFTER_MAX plans: where drafting never pays, at most
one verified row per EXPLORE_AFTER_MAX steps is spent finding out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.step_budget import LinearCost


@dataclass
class Acceptance:
    """Decayed counts of one request's (or the engine's) verification outcomes, and of how often
    the proposer had drafts for it when asked."""

    accepted: float = 0.0
    trials: float = 0.0  # positions verified: accepted drafts plus the rejection that ended a step
    offered: float = 0.0  # steps the proposer had drafts for it, of
    asked: float = 0.0  # steps it was given draft slots

    def observe(self, num_drafts: int, num_accepted: int, decay: float) -> None:
        if num_drafts == 0:
            return
        self.fade(decay)
        self.accepted += num_accepted
        self.trials += num_accepted + (num_accepted < num_drafts)

    def fade(self, decay: float) -> None:
        self.accepted *= decay
        self.trials *= decay

    def rate(self, prior: float, prior_weight: float) -> float:
        return (self.accepted + prior * prior_weight) / (self.trials + prior_weight)

    def ask(self, has_drafts: bool, decay: float) -> None:
        self.offered = self.offered * decay + has_drafts
        self.asked = self.asked * decay + 1.0

    @property
    def offer_rate(self) -> float:
        """Share of steps the proposer had drafts for it (a prompt-lookup miss has none);
        optimistic (1) until it has been asked."""
        return (self.offered + 1.0) / (self.asked + 1.0)


@dataclass
class Candidate:
    """A decoding request as the planner sees it."""

    acceptance: float  # a: P(draft j accepted | drafts before it accepted)
    cap: int  # most drafts it may take this step
    catch_up_rows: float = 1.0  # draft rows before its first proposal (a long gap: spread)
    reach: list[float] | None = None  # [j - 1]: P(drafts 1..j all accepted); default a^j
    num_free: int = 0  # drafts ahead of the proposer's (forced, a prediction's): verified anyway
    remaining: int | None = None  # most tokens it may still emit (None: unknown)
    must_run: int = 0  # tokens it emits for sure (EOS ignored, no stop condition)
    offered: float = 1.0  # share of its steps the proposer has drafts for
    context: int = 0  # tokens each of its rows attends (a verified row costs more deep in)

    def gain(self, level: int) -> float:
        """Expected tokens that draft `level` adds."""
        return self.reach[level - 1] if self.reach is not None else self.acceptance**level

    def tokens_per_step(self, k: int) -> float:
        return 1.0 + self.offered * sum(self.gain(j) for j in range(1, k + 1))


class StepCost:
    """A target step's seconds ~ fixed + per_row * rows + per_key * keys, keys being the context
    the step's rows attend, summed over them: each verified row reads its whole context, so a
    draft costs more deep in a conversation than near its start (several times more at 3.6k
    tokens than at 0.8k on one CPU thread: bench/RESULTS.md "Suffix decoding on an agent
    loop"). A rows-only line priced every row at the deepest recent context and, with no
    drafts, kept that price for good (all steps one row: nothing to refit). Exponentially
    weighted least squares, as LinearCost; the keys term only once keys vary apart from rows
    (else per_key = 0: the rows-only line, LinearCost's fit of the same steps); a fit is kept
    while recent steps have one row count."""

    KEY_SCALE = 1e-3  # keys in thousands in the normal equations (better conditioned)

    def __init__(self, decay: float = 0.97):
        self.decay = decay
        self.moments = np.zeros((4, 4))  # weighted sums of x x^T, x = (1, rows, keys, seconds)
        self.rows = LinearCost(decay)  # the rows-only line, where keys say nothing apart
        self.fixed: float | None = None
        self.per_row: float | None = None
        self.per_key = 0.0  # seconds per attended key

    @property
    def fitted(self) -> bool:
        return self.per_row is not None

    def observe(self, rows: int, seconds: float, keys: int = 0) -> None:
        self.rows.observe(rows, seconds)
        x = np.array([1.0, rows, keys * self.KEY_SCALE, seconds])  # [4]
        self.moments = self.moments * self.decay + np.outer(x, x)
        m = self.moments
        mean = m[0, :3] / m[0, 0]
        cov = m[:3, :3] / m[0, 0] - np.outer(mean, mean)  # [3, 3] of (1, rows, keys)
        if cov[1, 1] < LinearCost.MIN_SPREAD or not self.rows.fitted:
            return
        # Keys apart from rows: their covariance is not (near) singular.
        if cov[2, 2] * cov[1, 1] - cov[1, 2] ** 2 > 1e-6 * cov[1, 1] * max(cov[2, 2], 1e-12):
            fixed, per_row, per_key = np.linalg.solve(m[:3, :3], m[:3, 3])
            if per_row < 0.0 <= per_key:  # deep in, a row's cost is all attention: noise
                per_row = 0.0  # took its slope below 0; then fixed + per_key * keys alone
                fixed, per_key = np.linalg.solve(m[np.ix_([0, 2], [0, 2])], m[[0, 2], 3])
            if per_row >= 0.0 and per_key >= 0.0:
                self.fixed, self.per_row = max(fixed, 0.0), per_row
                self.per_key = per_key * self.KEY_SCALE
                return
        self.fixed, self.per_row, self.per_key = self.rows.fixed, self.rows.per_row, 0.0

    def __call__(self, rows: int, keys: int = 0) -> float:
        return self.fixed + self.per_row * rows + self.per_key * keys

    def row(self, context: int) -> float:
        """What one more row attending `context` tokens adds."""
        return self.per_row + self.per_key * context


class AdaptiveSpeculation:
    DECAY = 0.95  # per verification step, for a request's acceptance counts
    ENGINE_DECAY = 0.98  # per verification, for the engine-wide counts
    PRIOR_WEIGHT = 4.0  # positions' worth of the engine-wide rate in a request's estimate
    MAX_ACCEPTANCE = 0.98
    EXPLORE_AFTER = 16  # plans in a row without drafts before one draft is tried
    EXPLORE_AFTER_MAX = 256  # the wait, doubled by each rejected try, goes no further

    def __init__(self, uses_draft_model: bool):
        self.target = StepCost()  # decode steps only (see observe_target)
        self.draft = LinearCost() if uses_draft_model else None
        self.engine_acceptance = Acceptance()
        self.by_position: list[Acceptance] = []  # [j]: engine-wide, draft j+1 given j landed
        self._explore = False  # unready: whether this plan takes the caps (else no drafts)
        self._idle_plans = 0  # plans in a row without drafts since the last verification
        self._explore_after = self.EXPLORE_AFTER
        self._exploring = False  # a draft was given to find out, not because it pays

    @property
    def ready(self) -> bool:
        return self.target.fitted and (self.draft is None or self.draft.fitted)

    def observe_target(
        self, num_rows: int, has_prompt_chunk: bool, seconds: float, num_keys: int = 0
    ) -> None:
        """A step's target time (forward, sampling, verification) over its num_rows rows that
        attend num_keys tokens in all; a step with a prompt chunk is left out (the module
        docstring says why)."""
        if not has_prompt_chunk:
            self.target.observe(num_rows, seconds, num_keys)

    def observe_verification(self, own: Acceptance, num_drafts: int, num_accepted: int) -> None:
        if num_drafts and self._exploring:
            wait = self.EXPLORE_AFTER if num_accepted else 2 * self._explore_after
            self._explore_after = min(wait, self.EXPLORE_AFTER_MAX)
        if num_drafts:
            self._idle_plans = 0
        own.observe(num_drafts, num_accepted, self.DECAY)
        self.engine_acceptance.observe(num_drafts, num_accepted, self.ENGINE_DECAY)
        num_judged = min(num_accepted + 1, num_drafts)  # up to and including a rejection
        while len(self.by_position) < num_judged:
            self.by_position.append(Acceptance())
        for j in range(num_judged):
            self.by_position[j].observe(1, int(j < num_accepted), self.ENGINE_DECAY)

    def idle(self, own: Acceptance) -> None:
        """A step without drafts: fade the request's history so that it is tried again once
        the engine-wide rate (or the load) says drafting pays."""
        own.fade(self.DECAY)

    def acceptance(self, own: Acceptance) -> float:
        return min(own.rate(self.engine_rate, self.PRIOR_WEIGHT), self.MAX_ACCEPTANCE)

    @property
    def engine_rate(self) -> float:
        return self.engine_acceptance.rate(0.5, 1.0)

    def candidate(
        self,
        own: Acceptance,
        cap: int,
        lag: int,
        remaining: int,
        must_run: int = 0,
        num_free: int = 0,
        context: int = 0,
    ) -> Candidate:
        """The request as the planner sees it. lag: tokens its draft model has not computed;
        remaining: most tokens it may still emit; must_run: those it surely emits; num_free:
        drafts riding ahead of the proposer's (forced, a prediction's), which the draft model
        computes too; context: the tokens its rows attend."""
        mine = self.acceptance(own)
        reach = self._reach(mine, cap)
        usual = min(lag, cap + 1)  # after a step that drafted: its accepted drafts and bonus
        per_step = 1.0 + num_free + sum(reach)  # tokens a step at the cap emits, expected
        spread = (lag - usual) * per_step / max(remaining, 1)  # the gap, once over its steps
        return Candidate(
            mine, cap, usual + spread + num_free, reach,
            num_free=num_free, remaining=remaining, must_run=must_run, offered=own.offer_rate,
            context=context,
        )  # fmt: skip

    def _reach(self, mine: float, cap: int) -> list[float]:
        """P(drafts 1..j all land) for j = 1..cap. Acceptance is not the same at every depth
        (a copied span, once entered, tends to run on), so each position has its engine-wide
        rate, shifted in log-odds by how much better or worse this request does than the
        engine; positions never judged yet take the request's own rate."""
        engine = self.engine_rate
        shift = _logit(mine) - _logit(engine)
        out, p = [], 1.0
        for j in range(cap):
            if j < len(self.by_position) and self.by_position[j].trials >= 1.0:
                rate = self.by_position[j].rate(engine, 1.0)
                rate = min(_sigmoid(_logit(rate) + shift), self.MAX_ACCEPTANCE)
            else:
                rate = mine
            p *= rate
            out.append(p)
        return out

    def describe(self) -> dict:
        """The planner's current view, for the snapshot."""

        def fit(cost: LinearCost | StepCost | None):
            if cost is None or not cost.fitted:
                return None
            out = {"fixed_seconds": cost.fixed, "seconds_per_row": cost.per_row}
            return out | ({"seconds_per_key": cost.per_key} if cost is self.target else {})

        return {
            "ready": self.ready,
            "target_cost": fit(self.target),
            "draft_cost": fit(self.draft),
            "engine_acceptance": self.engine_rate,
        }

    def plan(self, candidates: list[Candidate], closed_steps: int | None = None) -> list[int]:
        """k per candidate (see the module docstring). closed_steps: the batch is closed, and
        its other requests (prefilling, or with their own k) surely take that many steps."""
        if not candidates:
            return []
        if not self.ready:
            self._explore = not self._explore
            return [c.cap if self._explore else 0 for c in candidates]
        ks = self._goodput_plan(candidates)
        self._exploring = False  # (the last plan's drafts, if any, are verified by now)
        if not any(ks):
            ks = self._explored(candidates, ks)
        if closed_steps is not None:
            ks = _drop_drafts_the_batch_waits_for(candidates, ks, closed_steps)
        if not any(ks):
            self._fade_engine_history()
        return ks

    def _goodput_plan(self, candidates: list[Candidate]) -> list[int]:
        """Level by level, the best number of the level's pool to extend. A level may cost more
        than it returns and still open deeper ones that repay it (a far-behind draft's catch-up
        is all paid at level 1), so the levels go on while candidates are left, and the plan is
        the best one met on the way."""
        ks = [0] * len(candidates)
        rows = sum(1 + c.num_free for c in candidates)  # decode rows and free drafts' rows
        keys = sum((1 + c.num_free) * c.context for c in candidates)
        tokens, seconds = float(rows), self.target(rows, keys)
        best_ks, best = list(ks), (tokens, seconds)
        for level in range(1, max(c.cap for c in candidates) + 1):
            pool = [i for i, c in enumerate(candidates) if ks[i] == level - 1 and c.cap >= level]
            pool.sort(key=lambda i: -candidates[i].gain(level))
            gain, cost = 0.0, self.draft.fixed if self.draft is not None else 0.0
            take = None  # (n, tokens, seconds) of the best step among n = 1 .. len(pool)
            for n, i in enumerate(pool, start=1):
                c = candidates[i]
                gain += c.gain(level)
                cost += self.target.row(c.context)
                if self.draft is not None:
                    cost += self.draft.per_row * (c.catch_up_rows if level == 1 else 1)
                if take is None or _faster((tokens + gain, seconds + cost), take[1:]):
                    take = (n, tokens + gain, seconds + cost)
            if take is None:
                break
            for i in pool[: take[0]]:
                ks[i] = level
            tokens, seconds = take[1:]
            if _faster((tokens, seconds), best):
                best_ks, best = list(ks), (tokens, seconds)
        return best_ks

    def _explored(self, candidates: list[Candidate], ks: list[int]) -> list[int]:
        """A plan without drafts, or after EXPLORE_AFTER of them (the wait since the last
        verification) one draft for the best candidate that may take one. Not with a draft
        model: its first draft after idle steps computes every token it sat out (the catch-up
        the goodput plan prices), so a try is not one row."""
        self._idle_plans += 1
        able = [i for i, c in enumerate(candidates) if c.cap >= 1]
        if self.draft is not None or self._idle_plans < self._explore_after or not able:
            return ks
        best = max(able, key=lambda i: candidates[i].gain(1))
        self._exploring = True
        return [int(i == best) for i in range(len(candidates))]

    def _fade_engine_history(self) -> None:
        """A step in which nobody drafts teaches nothing. Without this, a few early rejections
        could switch speculation off for good: estimates that nothing updates never recover.
        Fading them towards the prior means drafting is tried again after a while (~20 idle
        steps), and kept only if it pays."""
        for counts in (self.engine_acceptance, *self.by_position):
            counts.fade(self.DECAY)


def _drop_drafts_the_batch_waits_for(
    candidates: list[Candidate], ks: list[int], floor_steps: int
) -> list[int]:
    """A closed batch's steps are set by its slowest request: drafts for a request that surely
    finishes (at its `remaining` tokens, one a step) within the steps another surely takes (its
    `must_run` tokens at its expected tokens per step, or floor_steps for the requests outside
    the plan) shorten nothing. Dropping drafts only lengthens the others' expected steps, so
    this repeats until no more drop."""
    ks = list(ks)
    while True:
        steps = [c.must_run / c.tokens_per_step(k) for c, k in zip(candidates, ks, strict=True)]
        dropped = False
        for i, c in enumerate(candidates):
            others = max([floor_steps, *steps[:i], *steps[i + 1 :]])
            if ks[i] and c.remaining is not None and c.remaining <= others:
                ks[i], dropped = 0, True
        if not dropped:
            return ks


def _faster(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether (tokens, seconds) a emits more tokens per second than b."""
    return a[0] * b[1] > b[0] * a[1]


def _logit(p: float) -> float:
    p = min(max(p, 1e-4), 1 - 1e-4)
    return math.log(p / (1 - p))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))

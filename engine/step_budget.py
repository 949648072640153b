"""A step-time budget: while requests are decoding, a step's prompt tokens are limited so the
step stays within `max_step_ms` (each decoding stream waits one step per token, so a prefill
chunk that shares its step sets their inter-token latency). Step time is fitted online as
fixed + per_token * tokens from the steps the engine runs; alone, a prefill takes the whole
token budget as before.

The budget bounds the tail, not the mean: steps are planned so that the fit's prediction plus
a margin (the recent residuals' mean plus two standard deviations, each residual a step's time
less the fit's prediction made before seeing it) stays within `max_step_ms`. Planned on the
mean fit alone, steps overran the budget by ~20% at p95 (a 100 ms budget gave 119-122 ms p95
inter-token gaps through the server on both CPUs measured, 114-116 ms in process): the mixed
steps' cost is noisy and not quite linear in their tokens. With the margin, 94-98 ms at the
same tokens/s (bench/RESULTS.md, "The step budget bounds the tail").
"""

from __future__ import annotations


class LinearCost:
    """seconds ~ fixed + per_row * rows, fitted by exponentially weighted least squares. Keeps
    the last well-conditioned fit while recent observations all have the same row count."""

    MIN_SPREAD = 0.25  # weighted variance of the row counts (rows^2) needed to refit

    def __init__(self, decay: float = 0.97):
        self.decay = decay
        self.sums = [0.0] * 5  # weight, w*n, w*n^2, w*t, w*n*t
        self.fixed: float | None = None
        self.per_row: float | None = None
        self.errors = [0.0] * 3  # weight, w*e, w*e^2 of the residuals e = t - prediction

    @property
    def fitted(self) -> bool:
        return self.per_row is not None

    @property
    def margin(self) -> float:
        """Seconds to plan below a bound so that ~97% of steps stay within it: the recent
        residuals' mean plus two standard deviations (0 before any residual)."""
        w, e, ee = self.errors
        if w == 0.0:
            return 0.0
        mean = e / w
        return max(mean + 2.0 * max(ee / w - mean * mean, 0.0) ** 0.5, 0.0)

    def observe(self, rows: int, seconds: float) -> None:
        if self.fitted:  # out of sample: the fit before this step saw it
            e = seconds - self(rows)
            fresh = (1.0, e, e * e)
            self.errors = [v * self.decay + x for v, x in zip(self.errors, fresh, strict=True)]
        s = [v * self.decay for v in self.sums]
        for i, v in enumerate((1.0, rows, rows * rows, seconds, rows * seconds)):
            s[i] += v
        self.sums = s
        w, n, nn, t, nt = s
        var = nn / w - (n / w) ** 2
        if var < self.MIN_SPREAD:
            return
        per_row = (nt / w - (n / w) * (t / w)) / var
        self.per_row = max(per_row, 0.0)
        self.fixed = max((t - self.per_row * n) / w, 0.0)

    def __call__(self, rows: int) -> float:
        return self.fixed + self.per_row * rows


class StepBudget:
    def __init__(self, max_step_ms: float, min_chunk: int):
        self.seconds = max_step_ms / 1000.0
        self.min_chunk = min_chunk  # prompt tokens a step may always take (progress)
        self.cost = LinearCost()

    def observe(self, tokens: int, seconds: float) -> None:
        self.cost.observe(tokens, seconds)

    def prompt_tokens(self, num_decode_rows: int, max_tokens: int) -> int:
        """Prompt tokens a step with num_decode_rows decode rows (drafts included) may take:
        what fits in the budget less the fit's margin (at most half the budget), but never
        fewer than min_chunk or the decode rows (a budget below the step's fixed cost would
        otherwise starve prompts: at most half of the rows of a step go to decodes, so prefill
        keeps at least half its pace)."""
        cost = self.cost
        if not num_decode_rows or not cost.fitted or cost.per_row == 0.0:
            return max_tokens
        room = self.seconds - min(cost.margin, self.seconds / 2)
        fits = int((room - cost.fixed) / cost.per_row) - num_decode_rows
        return min(max(fits, self.min_chunk, num_decode_rows), max_tokens)

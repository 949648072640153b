"""A step-time budget: while requests are decoding, a step's prompt tokens are limited so the
step stays within `max_step_ms` (each decoding stream waits one step per token, so a prefill
chunk that shares its step sets their inter-token latency). Step time is fitted online as
fixed + per_token * tokens from the steps the engine runs; alone, a prefill takes the whole
token budget as before.
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

    @property
    def fitted(self) -> bool:
        return self.per_row is not None

    def observe(self, rows: int, seconds: float) -> None:
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
        what fits in the budget, but never fewer than min_chunk or the decode rows (a budget
        below the step's fixed cost would otherwise starve prompts: at most half of the rows
        of a step go to decodes, so prefill keeps at least half its pace)."""
        cost = self.cost
        if not num_decode_rows or not cost.fitted or cost.per_row == 0.0:
            return max_tokens
        fits = int((self.seconds - cost.fixed) / cost.per_row) - num_decode_rows
        return min(max(fits, self.min_chunk, num_decode_rows), max_tokens)

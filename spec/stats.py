"""Speculation counters: per request, per adapter and per engine (spec.speculation keeps them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class SpecStats:
    num_steps: int = 0  # verification steps that carried at least one draft
    num_drafts: int = 0  # draft tokens proposed and verified
    num_accepted: int = 0
    num_forced: int = 0  # drafts that were forced tokens (e.g. by a grammar), not proposals
    num_forced_accepted: int = 0
    num_predicted: int = 0  # drafts from the request's prediction (Predicted Outputs)
    num_predicted_accepted: int = 0
    # Per request: its share of step time (draft passes by its drafts, the target's forward and
    # verification by its rows). The engine's own totals are Speculation.seconds.
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    drafted_at: list[int] = field(default_factory=list)  # [j]: steps with a draft at position j
    accepted_at: list[int] = field(default_factory=list)  # [j]: ... whose draft j was accepted

    @classmethod
    def merged(cls, parts) -> SpecStats:
        total = cls()
        for part in parts:
            for f in fields(cls):
                mine, theirs = getattr(total, f.name), getattr(part, f.name)
                if isinstance(mine, list):  # drafted_at, accepted_at: summed by position
                    mine += [0] * (len(theirs) - len(mine))
                    for j, v in enumerate(theirs):
                        mine[j] += v
                else:
                    setattr(total, f.name, mine + theirs)
        return total

    def record(
        self, num_drafts: int, num_accepted: int, num_forced: int = 0, num_predicted: int = 0
    ) -> None:
        """One verification: the first num_accepted of num_drafts drafts were accepted; the
        first num_forced drafts were forced tokens, the num_predicted after them a prediction's."""
        if num_drafts == 0:
            return
        if not 0 <= num_accepted <= num_drafts or not 0 <= num_forced + num_predicted <= num_drafts:
            raise ValueError(
                f"accepted {num_accepted}, forced {num_forced}, predicted {num_predicted} "
                f"of {num_drafts}"
            )
        self.num_steps += 1
        self.num_drafts += num_drafts
        self.num_accepted += num_accepted
        self.num_forced += num_forced
        self.num_forced_accepted += min(num_forced, num_accepted)
        self.num_predicted += num_predicted
        self.num_predicted_accepted += max(0, min(num_predicted, num_accepted - num_forced))
        grow = num_drafts - len(self.drafted_at)  # ([0] * a negative count is [])
        self.drafted_at += [0] * grow
        self.accepted_at += [0] * grow
        for j in range(num_drafts):
            self.drafted_at[j] += 1
            self.accepted_at[j] += j < num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafts if self.num_drafts else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step: 1 + accepted drafts per step."""
        return 1.0 + self.num_accepted / self.num_steps if self.num_steps else 1.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at, strict=True)]

    def as_dict(self) -> dict:
        return asdict(self) | {
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_by_position": self.acceptance_by_position,
        }

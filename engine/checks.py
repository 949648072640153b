"""Declarative field checks: a table of (field, check, rule) rows that a config or a request
validates itself against, each failure naming its field."""

from __future__ import annotations

from collections.abc import Callable

Rule = tuple[str, Callable[[object], bool], str]  # (field, check, what the field must be)


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def int_in(low: int, high: float = float("inf"), optional: bool = False):
    """An integer in [low, high] (or None when optional)."""
    return lambda v: (optional and v is None) or (is_int(v) and low <= v <= high)


def number_in(low: float, high: float, low_open: bool = False, high_open: bool = False):
    """A real number (not a bool, not NaN) in the interval, each end open or closed."""

    def ok(v) -> bool:
        if not isinstance(v, int | float) or isinstance(v, bool):
            return False
        above = v > low if low_open else v >= low
        below = v < high if high_open else v <= high
        return above and below

    return ok


def one_of(*values):
    return lambda v: v in values


def check_rules(obj, rules: list[Rule], error: Callable[[str, str], Exception]) -> None:
    """Raise error(field, message) for the first row whose check fails on obj's field."""
    for name, ok, rule in rules:
        value = getattr(obj, name)
        if not ok(value):
            raise error(name, f"{name} {rule}, got {value!r}")

"""Errors the engine's packages raise to each other, in a module that imports nothing of theirs."""

from __future__ import annotations


class RequestError(ValueError):
    """A problem with the request itself that shows only while it runs (e.g. a constraint that
    admits no continuation): the request ends with this message as a client error (400)."""


class ParamError(ValueError):
    """A bad value for one request parameter; `param` names it (the server's error field)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class NonFiniteLogits(RuntimeError):
    """The model's logits for a request hold NaN (a corrupt adapter or weights, an overflow):
    the request ends with an error, and the K/V it computed is not to be trusted (never cached)."""

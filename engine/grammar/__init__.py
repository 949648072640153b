"""Grammar-constrained decoding with xgrammar: constraints, compilation, per-request matchers."""

from engine.grammar.constraint import StructuredOutputs

__all__ = ["StructuredOutputs"]

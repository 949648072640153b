"""Tandem spec package."""

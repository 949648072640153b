"""Tandem kernels package."""

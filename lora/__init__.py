"""Tandem lora package."""

"""Tandem playground package."""

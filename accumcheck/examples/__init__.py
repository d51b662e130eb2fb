"""Runnable examples: ``python -m accumcheck.examples.diverge``."""

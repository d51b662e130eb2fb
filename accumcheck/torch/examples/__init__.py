"""Runnable examples: ``python -m accumcheck.torch.examples.diverge``."""

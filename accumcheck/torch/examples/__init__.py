"""Runnable examples: ``python -m accumcheck.frameworks.torch.examples.diverge``."""

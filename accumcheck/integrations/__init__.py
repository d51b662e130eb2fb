"""Training stacks under accumcheck, one module per stack: ``transformers`` (the Hugging Face
Trainer), ``accelerate``, ``lightning``, ``gluon`` (MXNet's Gluon Trainer), ``deepspeed`` and
``keras`` (Keras 3 optimizers with ``gradient_accumulation_steps``, on the torch backend). Each
imports its framework and its stack; one that is missing is one AccumcheckError saying what to
install."""

from __future__ import annotations

from ..errors import AccumcheckError


def missing(module: str, exc: ModuleNotFoundError, what: str, install: str) -> Exception:
    """The error to raise when importing the integration ``module`` found ``exc``: an
    AccumcheckError saying what to install, or ``exc`` itself when it is accumcheck's own."""
    if (exc.name or "").startswith("accumcheck"):
        return exc
    return AccumcheckError(f"{module} needs {what} ({exc.name} is not installed); install them with {install}")

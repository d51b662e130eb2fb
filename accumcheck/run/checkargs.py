"""One call shape for the check of your own model, and the validation every framework shares.

    check(model, loss_fn=None, batches=None, accum_steps=None, *, device=None, step=None,
          mode="native", oracle=False, inject=None, full_batch=False, collate=None,
          loss_reduction=None, train_mode=False, memory_budget=None, force=False, progress=None,
          <the framework's own keywords>)

``accumcheck.torch.check``, ``accumcheck.mxnet.check`` and ``accumcheck.jax.check`` take these
(JAX's first argument is the parameters, named ``params``: they are what is checked), with these
defaults, in this order. Each framework's check declares once, as a ``CheckShape``, which of the
shared options it honours and its own convention for ``loss_reduction`` (None means it), and
calls ``CheckShape.validate``: what does not depend on the framework is checked there, in one
place, and an option the framework cannot honour, given a value other than its default, is
refused in one line. What depends on the framework (the model's type, the device, its own
keywords) stays in its package.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import AccumcheckError
from ..options.choices import MODES, REDUCTIONS
from .budget import checked_budget
from .faults import Fault, parse_fault

# The shared parameters after the model: those that may be positional (default None), then the
# keyword-only ones with their defaults, in the order every check declares them.
POSITIONAL = ("loss_fn", "batches", "accum_steps")
KEYWORDS: dict[str, Any] = {
    "device": None, "step": None, "mode": "native", "oracle": False, "inject": None, "full_batch": False,
    "collate": None, "loss_reduction": None, "train_mode": False, "memory_budget": None, "force": False,
    "progress": None,
}
SWITCHES = ("oracle", "full_batch", "train_mode", "force")
FUNCTIONS = ("loss_fn", "step", "collate", "progress")


@dataclass(frozen=True)
class CheckArguments:
    """What ``CheckShape.validate`` made of the shared arguments."""

    fault: Fault | None  # ``inject`` parsed; the adapter resolves it against the parameters
    loss_reduction: str  # the framework's convention where None was given
    budget: int | None  # ``memory_budget`` in bytes


@dataclass(frozen=True)
class CheckShape:
    """What one framework's check does with the shared options: the options it honours (the others
    are refused when given a value other than their default, with ``why_not``'s reason), the
    ``loss_reduction`` that None stands for, and keywords it took under another name (old name ->
    new name), which the setup file and the plugin refuse naming the new one."""

    where: str  # the check's public name, "accumcheck.<framework>.check"
    honoured: frozenset[str]
    reduction: str
    why_not: Mapping[str, str] = field(default_factory=dict)
    renamed: Mapping[str, str] = field(default_factory=dict)

    def validate(self, *, loss_fn: Any, batches: Any, accum_steps: Any, device: Any, step: Any, mode: Any,
                 oracle: Any, inject: Any, full_batch: Any, collate: Any, loss_reduction: Any, train_mode: Any,
                 memory_budget: Any, force: Any, progress: Any) -> CheckArguments:
        """The shared arguments checked: AccumcheckError, in one line, for the first that is wrong."""
        given = {"device": device, "step": step, "mode": mode, "oracle": oracle, "inject": inject,
                 "full_batch": full_batch, "collate": collate, "loss_reduction": loss_reduction,
                 "train_mode": train_mode, "memory_budget": memory_budget, "force": force, "progress": progress}
        for name, value in given.items():
            if name not in self.honoured and not _is_default(value, KEYWORDS[name]):
                why = self.why_not.get(name, "this framework's check has no use for it")
                raise AccumcheckError(f"check: {self.where} cannot honour {name}={_shown(value)} ({why}); "
                                      "leave it out")
        if batches is None:
            raise AccumcheckError("check: batches is missing; pass the micro-batches (a sequence, an iterable or a "
                                  "function of the micro-step index)")
        if step is not None and loss_fn is not None:
            raise AccumcheckError("check: pass loss_fn or step, not both (step(model, batch) computes the loss "
                                  "itself)")
        for name, value in (("loss_fn", loss_fn), ("step", step), ("collate", collate), ("progress", progress)):
            if value is not None and not callable(value):
                raise AccumcheckError(f"check: {name} must be a function, got a {type(value).__name__}")
        if accum_steps is not None and (not isinstance(accum_steps, int) or isinstance(accum_steps, bool)
                                        or accum_steps < 1):
            raise AccumcheckError(f"check: accum_steps must be a positive integer, got {accum_steps!r}")
        if mode not in MODES:
            raise AccumcheckError(f"check: mode must be one of {', '.join(MODES)}, got {mode!r}")
        if loss_reduction is not None and loss_reduction not in REDUCTIONS:
            raise AccumcheckError(f"check: loss_reduction must be one of {', '.join(REDUCTIONS)} (or None: "
                                  f"{self.reduction}, this framework's convention), got {loss_reduction!r}")
        for name in SWITCHES:
            if not isinstance(given[name], bool):
                raise AccumcheckError(f"check: {name} must be True or False, got {given[name]!r}")
        if inject is not None and not isinstance(inject, str):
            raise AccumcheckError(f"check: inject must be a text such as 'scale' or 'drop-step:NAME', got "
                                  f"{inject!r}")
        return CheckArguments(fault=parse_fault(inject) if inject is not None else None,
                              loss_reduction=loss_reduction if loss_reduction is not None else self.reduction,
                              budget=checked_budget(memory_budget, oracle, full_batch))

    def refuse_renamed(self, names: Collection[str], what: str) -> None:
        """AccumcheckError naming the first of ``names`` that this check took under an old name, and
        its new one (``what`` says where the names came from)."""
        for name in names:
            if name in self.renamed:
                raise AccumcheckError(f"{what}: {name!r} is now {self.renamed[name]!r} in {self.where}, the one "
                                      f"shape every framework's check takes; rename it")


def shape_of(check: Callable[..., Any]) -> CheckShape | None:
    """The CheckShape a framework's check declares (its ``shape`` attribute), if any."""
    shape = getattr(check, "shape", None)
    return shape if isinstance(shape, CheckShape) else None


def _is_default(value: Any, default: Any) -> bool:
    if default is None:
        return value is None
    return type(value) is type(default) and value == default


def _shown(value: Any) -> str:
    """A value as a refusal names it: a function by its kind, not its address."""
    if callable(value) and not isinstance(value, type):
        return f"<{type(value).__name__}>"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

"""The run configuration: a frozen, typed RunConfig, made by ``accumcheck.run.validation.configure`` from the
options ``accumcheck.options`` specifies. A report keeps ``RunConfig.record()``, from which
``options.command_line`` rebuilds the command that reruns it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..case.definition import Case
from ..options.spec import RUN_OPTIONS
from .faults import Fault


@dataclass(frozen=True)
class RunConfig:
    """One comparison, validated and resolved (``accumcheck.run.validation.configure`` builds it): the case with
    its seed and loss normalisation applied, the number of micro-steps, the fault aimed at its
    tensor and micro-step, and every option. ``backend_options`` holds the backend's own options
    that were given (name, value). Frozen: it travels unchanged to each backend and rank."""

    case: Case
    accum_steps: int
    frameworks: tuple[str, ...] = ()
    device: str = "cpu"
    fault: Fault | None = None
    oracle: bool = False
    full_batch: bool = False
    loss_reduction: str | None = None
    world_size: int | None = None
    reduce_dtype: str = "float32"
    inject_rank: int | None = None
    dtype: str = "float32"
    accum_dtype: str = "float32"
    mode: str = "native"
    memory_budget: int | None = None
    grad_norms: str | None = None
    force: bool = False
    fail_on: str = "marginal"
    strict: bool = False
    backend_options: tuple[tuple[str, Any], ...] = ()

    @property
    def framework(self) -> str:
        """The (first) framework."""
        return self.frameworks[0]

    @property
    def fault_rank(self) -> int:
        """The rank whose accumulation the fault perturbs in a data-parallel run."""
        return self.inject_rank or 0

    def option(self, name: str, default: Any = None) -> Any:
        """A backend option's value, or ``default`` where it was not given."""
        return dict(self.backend_options).get(name, default)

    def record(self) -> dict[str, Any]:
        """The options as plain data: what a report keeps so that ``command_line`` reruns it."""
        # Options that are not the run's own (--repro writes a file beside it; --strict is a
        # fail_on) are not kept; fail_on only where it is not the default, as reports before it had none.
        values = {option.name: getattr(self, option.name) for option in RUN_OPTIONS
                  if option.name in _FIELDS and option.name != "strict"}
        values.update(framework=",".join(self.frameworks), case=case_source_argument(self.case),
                      seed=self.case.seed, inject=None if self.fault is None else self.fault.target)
        if self.full_batch:  # the normalisation is what a full-batch check is about: say it
            values["loss_reduction"] = self.case.loss_reduction
        if not self.force:  # a setting of the machine's limits, not of the run: kept only when it was needed
            del values["force"]
        if self.fail_on == "marginal":
            del values["fail_on"]
        if self.memory_budget is None:  # reports before it had none
            del values["memory_budget"]
        values["backend_options"] = dict(self.backend_options)
        return values


_FIELDS = {f.name for f in fields(RunConfig)}


def case_source_argument(case: Case) -> str:
    """What ``--case`` takes to find ``case`` again: a built-in's name, else its file."""
    return case.name if case.source.startswith("case ") else case.source



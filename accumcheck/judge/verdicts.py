"""From a finished run to a Report: every tensor's verdict, made once, from all its figures.

Verdicts:
  identical       native and manual agree in every element
  round-off       they differ, but both are within the bound of E (``accumcheck.bounds``)
  precision-loss  native is within its own (reduced) dtype's round-off, beyond the accumulation
                  dtype's
  diverged        some element of some mode is further from E than round-off can explain (in a
                  data-parallel run also: a rank's own total, or native against one process)
  non-finite      an inf or nan in either mode (or in E)
  no-gradient     the parameter received no gradient in any micro-step (a user's model)
  overflow        loss-scaled micro-gradients that overflowed (E non-finite): the scaler skips the
                  optimizer step; not flagged
A tensor whose sum cancels heavily (condition number S/|E| >= ILL_CONDITIONED) is also marked
ill-conditioned: large relative differences there are expected and are not a bug.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
from typing import Any

import numpy as np

from ..bounds import UNIT_ROUNDOFF, ModeBound
from ..case.definition import Case
from ..errors import NothingJudgedError
from ..report import Report, TensorResult
from ..run.faults import Fault
from ..run.results import RunResult
from ..version import __version__
from . import dataparallel
from .attribution import Examined, Replay
from .dataparallel import RankChecks
from .fullbatch import full_batch_verdict
from .ratio import ratio_map, unravel
from .secondpass import examine, severity, wanted
from .statistics import Reducer, tensor_figures

# A sum is called ill-conditioned when cancellation makes S exceed |E| a hundredfold: its relative
# error may then be a hundred times the relative error of a sum without cancellation.
ILL_CONDITIONED = 100.0


def compare_tensor(name: str, kind: str, native: np.ndarray, manual: np.ndarray, exact: np.ndarray,
                   absum: np.ndarray, native_bound: ModeBound, manual_bound: ModeBound,
                   oracle: np.ndarray | None = None, reference_bound: ModeBound | None = None,
                   ulps: bool = False, parallel: RankChecks | None = None, no_gradient: bool = False,
                   overflow: bool = False, reducer: Reducer | None = None) -> TensorResult:
    """Judge one parameter tensor: its figures (``statistics.tensor_figures``, the same
    arguments) and, for a data-parallel run, its ``parallel`` checks. ``no_gradient``: the
    parameter received no gradient at all; ``overflow``: the run was loss-scaled, so a non-finite
    E (the micro-gradients themselves overflowed) is a step the scaler skips, not a fault;
    ``reducer``: the arrays' reduction where they live (``statistics.tensor_figures``).
    Returns the TensorResult."""
    figures = tensor_figures(name, kind, native, manual, exact, absum, native_bound, manual_bound, oracle,
                             reference_bound, ulps, reducer)
    nonfinite = figures.pop("nonfinite")
    if no_gradient:
        verdict = "no-gradient"
    elif nonfinite and overflow and not np.isfinite(np.asarray(exact, np.float64)).all():
        verdict = "overflow"
    elif nonfinite:
        verdict = "non-finite"
    elif figures["mismatched"] == 0:
        verdict = "identical"
    elif figures["ratio"] <= 1.0:
        verdict = "round-off"
    else:
        verdict = "diverged"
    if verdict in ("identical", "round-off") and figures.get("precision_ratio", 0.0) > 1.0:
        verdict = "precision-loss"
    ill = figures["condition"] >= ILL_CONDITIONED and verdict not in ("non-finite", "overflow", "no-gradient")
    if parallel is not None:
        figures.update(parallel.figures)
        worst = max(parallel.candidates, key=lambda c: c.ratio, default=None)
        beyond = parallel.flagged_ranks or (worst is not None and worst.ratio > 1.0)
        if beyond and verdict not in ("precision-loss", "diverged", "non-finite"):
            verdict = "diverged"
        if worst is not None and worst.ratio > figures["ratio"]:  # point at the worst check
            absum = float(np.asarray(worst.absum, np.float64).reshape(-1)[worst.flat_index])
            figures.update(ratio=worst.ratio, worst_mode=worst.mode, bound_at_worst=worst.bound.at(absum),
                           worst_index=unravel(worst.flat_index, figures["shape"]))
    return TensorResult(verdict=verdict, ill_conditioned=ill, **figures)


def build_report(case: Case | None, run: RunResult, accum_steps: int, fault: Fault | None, oracle: bool,
                 seconds: float, config: dict[str, Any] | None = None, replay: Replay | None = None) -> Report:
    """Judge every tensor of a backend's RunResult and wrap the verdicts in a Report. ``case`` is
    None for a user's own model (then ``config`` is ``{"model": its class name}``); ``config`` is
    the run's ``RunConfig.record()``. ``replay`` streams the run's clean micro-gradients again for
    the tensors named (``attribution``): with it, flagged tensors get a cause and the statistical
    tier runs."""
    judge = Judge(accum_steps, config, replay)
    judge.add(run)
    return judge.report(case, fault, oracle, seconds)


def received_gradient(t: TensorResult) -> bool:
    """Whether a tensor was judged on something: a gradient that is not missing and not zero in
    every micro-step (E and S both zero, native and manual equal), or a non-finite one."""
    if t.verdict == "no-gradient":
        return False
    zero = t.max_abs_grad == 0 and t.condition == 1.0 and t.mismatched == 0  # S = 0: every micro-gradient zero
    return not zero or t.verdict in ("non-finite", "overflow")


class Judge:
    """Judges a run's tensors group by group (``--memory-budget``: one RunResult per group, each
    dropped once ``add`` returns) and makes the Report from what it kept: the verdicts, no array.
    A run judged in one group is judged exactly as ``build_report`` judges it."""

    def __init__(self, accum_steps: int, config: dict[str, Any] | None = None, replay: Replay | None = None):
        self.accum_steps, self.config, self.replay = accum_steps, dict(config or {}), replay
        self.run: RunResult | None = None  # the first group's, for the run's facts
        self.tensors: list[TensorResult] = []
        self.checks: list[RankChecks | None] = []
        self.notes: list[str] = []
        self.groups = 0

    def add(self, run: RunResult) -> None:
        """Judge the tensors of ``run`` (the next group's, in canonical order): verdicts, second
        pass, severities and the ratio maps of those that may need one."""
        if self.run is None:
            self.run = dataclasses.replace(run, params=[])  # the facts, none of the arrays
            self._bounds(run)
        self.groups += 1
        native_bound, manual_bound, reference, parallel = self.bounds
        accum_steps = self.accum_steps
        ulps = self.config.get("mode", "native") != "native"  # how close a GradAccumulator gets
        checks = [None if parallel is None else dataparallel.check_tensor(p, run.ranks or [], parallel)
                  for p in run.params]
        tensors, examined = [], []
        for p, check in zip(run.params, checks):
            own, own_reference = native_bound, reference
            if p.dtype is not None and p.dtype != run.param_dtype:  # a model of mixed dtypes: each its own bound
                own = ModeBound.for_sum(p.dtype, accum_steps, run.native_kernel_allowance)
                own_reference = ModeBound.for_sum("float32", accum_steps) if UNIT_ROUNDOFF[p.dtype] > \
                    UNIT_ROUNDOFF["float32"] else None
            t = compare_tensor(p.name, p.kind, p.native, p.manual, p.exact, p.absum, own, manual_bound, p.oracle,
                               reference_bound=own_reference, ulps=ulps, parallel=check,
                               no_gradient=p.steps_with_grad == 0, overflow=run.grad_scale is not None,
                               reducer=p.reducer)
            t.aliases = list(p.aliases) or None
            t.steps_with_grad = p.steps_with_grad
            tensors.append(t)
            if self.replay is not None and parallel is None and wanted(t):
                examined.append(Examined(t, p.native, p.manual, p.exact, p.absum,
                                         {"native": own_reference or own, "manual": manual_bound},
                                         {"native": UNIT_ROUNDOFF[own.dtype], "manual": UNIT_ROUNDOFF[manual_bound.dtype]}))
        if examined:
            note = examine(examined, accum_steps, self.replay)
            if note and note not in self.notes:
                self.notes.append(note)
        del examined
        for t in tensors:
            t.severity = severity(t)
        self.tensors += tensors
        self.checks += checks
        # Where the differences sit: the flagged tensors and the three nearest their bound, of the
        # whole run (``report`` drops the maps of tensors a later group pushed out of the three).
        mapped = self._mapped()
        for p, t in zip(run.params, tensors):
            if t.name in mapped and t.verdict not in ("non-finite", "overflow"):
                t.ratio_map, t.ratio_map_cell = ratio_map(p.native, p.manual, p.exact, p.absum, native_bound,
                                                          manual_bound)

    def _bounds(self, run: RunResult) -> None:
        accum_steps = self.accum_steps
        native_bound = ModeBound.for_sum(run.param_dtype, accum_steps, run.native_kernel_allowance)
        manual_bound = ModeBound.for_sum(run.accum_dtype, accum_steps)
        # Parameters below float32 (bfloat16, float16): judge native against float32's bound too, the
        # precision a float32 buffer would have kept. (A float64 buffer does not make float32 a loss.)
        reference = None
        if UNIT_ROUNDOFF[run.param_dtype] > UNIT_ROUNDOFF["float32"]:
            reference = ModeBound.for_sum("float32", accum_steps)
        parallel = None
        if run.data_parallel is not None:
            parallel = dataparallel.bounds_for(run.param_dtype, run.accum_dtype, accum_steps,
                                               run.data_parallel.world_size, run.data_parallel.reduce_dtype)
            native_bound, manual_bound, reference = parallel.native, parallel.manual, parallel.reference
        self.bounds = (native_bound, manual_bound, reference, parallel)

    def _mapped(self) -> set[str]:
        """The flagged tensors so far and the three nearest their bound so far: a tensor among the
        whole run's three is among them when its group is judged (groups come in canonical order)."""
        mapped = {t.name for t in self.tensors if t.flagged}
        return mapped | {t.name for t in sorted(self.tensors, key=lambda t: -t.ratio if t.ratio == t.ratio else 0)[:3]}

    def report(self, case: Case | None, fault: Fault | None, oracle: bool, seconds: float) -> Report:
        """The Report of every tensor added."""
        run, tensors, config = self.run, self.tensors, self.config
        assert run is not None, "no tensors were judged"
        if not any(received_gradient(t) for t in tensors):
            steps = self.accum_steps
            raise NothingJudgedError(
                f"nothing was judged: none of the {len(tensors)} parameter tensors received a non-zero gradient in "
                f"the {steps} micro-batch{'es' * (steps != 1)}; make the loss depend on the parameters (a loss "
                "computed under no_grad, detached, or a constant gives none)")
        native_bound, manual_bound, _, parallel = self.bounds
        notes = list(run.notes) + self.notes
        bound = {"native": vars(native_bound), "manual": vars(manual_bound)}
        result = None
        if parallel is not None:
            bound.update(single_process=vars(parallel.single_process), rank=vars(parallel.rank))
            result = dataparallel.summarise(run.data_parallel, run.ranks or [], tensors, self.checks)
        whole = sum(t.grad_sum_sq for t in tensors)
        for t in tensors:
            t.norm_share = t.grad_sum_sq / whole if whole > 0 else 0.0
        mapped = self._mapped()
        for t in tensors:
            if t.name not in mapped:
                t.ratio_map, t.ratio_map_cell = None, None
        if case is None:
            case = Case(config.get("model", "model"), "", -1, self.accum_steps, None, "", 0.0, 0.0, (),
                        source=f"<user model {config.get('model', 'model')}>")
        return Report(
            case=case.name, case_source=case.source, case_fingerprint=case.fingerprint(), case_toml=case.text,
            framework=run.framework, versions={"accumcheck": __version__, **run.versions}, device=run.device,
            param_dtype=run.param_dtype, accum_dtype=run.accum_dtype, accum_steps=self.accum_steps, seed=case.seed,
            oracle=oracle, inject=None if fault is None else str(fault), bound=bound,
            loss_reduction=case.loss_reduction, settings=run.settings, notes=notes, losses=run.losses,
            seconds=round(seconds, 3), created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            tensors=tensors, config=config,
            full_batch=None if run.full_batch is None else full_batch_verdict(run.full_batch, self.accum_steps),
            data_parallel=result, groups=self.groups)

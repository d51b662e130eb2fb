"""The Python entry point. ``compare`` runs a case in a framework (or two) and returns its Report;
``compare_frameworks``, ``sweep`` and ``train`` are its siblings. Each builds its RunConfig once
(``accumcheck.run.validation.configure``), runs the chosen backend, and hands the backend's arrays to the judge.

    import accumcheck
    report = accumcheck.compare("transformer-small", framework="torch", accum_steps=32)
    assert report.exit_code == 0, [t.name for t in report.flagged]
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .case.definition import Case
from .case.reading import resolve_case
from .diagnostics.layers import layer_norms
from .diagnostics.tensorboard import ScalarWriter
from .errors import AccumcheckError
from .judge import Judge, agreement, build_report, forward_agreement, odd_one_out
from .judge.agreement import FLOAT64_KERNEL_ALLOWANCE
from .options.choices import STACKS
from .options.spec import TRAIN_OPTIONS, TRAIN_RUN_OPTIONS
from .report import CrossReport, Report, SweepReport, TrajectoryReport
from .repro.request import ReproFiles, check_request, target_of, write_text
from .repro.request import write as write_script
from .repro.shrink import MAX_TRIALS, case_toml
from .repro.shrink import shrink as shrink_case
from .run.backend import Backend, Progress
from .run.budget import plan
from .run.config import RunConfig
from .run.faults import Fault, resolve_fault
from .run.launch import launched_world_size
from .run.registry import backend_names, backend_options, get_backend, installed_backends
from .run.resources import check_stack_resources, estimate_stack
from .run.results import RunResult
from .run.validation import checked_values, configure


def compare(case: str | Path | Case = "embed-attention", framework: str | Sequence[str] | None = None,
            accum_steps: int | None = None, *, progress: Progress | None = None, repro: str | Path | None = None,
            shrink: bool = False, **options: Any) -> Any:
    """Run ``case`` (a built-in name, a TOML path or a Case) for ``accum_steps`` micro-steps
    (default: the case's own) with native and manual accumulation, and judge every parameter
    tensor, in ``framework`` (default: the first installed backend). ``options`` are the run
    options by name (``accumcheck compare --help`` lists them:
    ``device``, ``seed``, ``oracle``, ``inject``, ``dtype``, ``accum_dtype``, ``mode``,
    ``loss_reduction``, ``full_batch``, ``world_size``, ``reduce_dtype``, ``inject_rank``,
    ``grad_norms``, ``memory_budget`` (bytes, or a text such as "512M": the tensors are run and
    judged in groups that fit it), and a backend's own such as MXNet's ``hybridize``). ``world_size`` runs
    data-parallel: under torchrun every rank calls it and gets the same Report (a script that
    spawns ranks needs the usual ``if __name__ == "__main__":`` guard).

    ``repro`` (a .py path) also writes the run's reproduction script (``write_repro``), after
    shrinking the case with ``shrink``.

    Returns the Report, or a CrossReport when ``framework`` names two or more frameworks. Raises
    AccumcheckError for an unknown case, framework, device, fault or option, a malformed case
    file, or a combination the backend cannot run."""
    config = configure({"case": case, "framework": framework, "accum_steps": accum_steps, **options})
    check_request(config, repro, shrink)  # before the run: what could not be written is refused
    report = run(config, progress)
    if repro is not None:
        write_repro(report, config, repro, shrink=shrink)
    return report


def compare_frameworks(case: str | Path | Case = "embed-attention", frameworks: Sequence[str] | None = None,
                       accum_steps: int | None = None, *, progress: Progress | None = None,
                       weights: dict[str, dict[str, np.ndarray]] | None = None, **options: Any) -> CrossReport:
    """Run ``case`` in each framework (default: every installed one) with the float64 oracle,
    which the agreement bound needs, judge each one as ``compare`` does, and compare every pair of
    frameworks' manual sums; with three or more, the report names the framework that alone
    disagrees with all the others on a tensor (``CrossReport.odd_one_out``). ``weights`` may give
    one framework other initial weights (to prove the check fires). Raises AccumcheckError as ``compare`` does, or for fewer
    than two distinct frameworks."""
    frameworks = installed_backends() if frameworks is None else frameworks
    if len(set(frameworks)) < 2:
        raise AccumcheckError(f"--framework: name two frameworks to compare (installed: "
                              f"{', '.join(installed_backends()) or 'none'}), got {list(frameworks)!r}")
    config = configure({"case": case, "framework": list(frameworks), "accum_steps": accum_steps, **options})
    return _cross(config, progress, weights or {})


def run(config: RunConfig, progress: Progress | None = None) -> Any:
    """Run a configured comparison: its Report (a CrossReport for several frameworks)."""
    if len(config.frameworks) > 1:
        return _cross(config, progress, {})
    backend = get_backend(config.framework)
    writer = ScalarWriter(config.grad_norms) if config.grad_norms is not None else None  # fails before the run
    started = time.perf_counter()
    if config.memory_budget is not None:
        groups = plan(backend.tensor_needs(config), config.memory_budget)
        if len(groups) > 1:
            return _grouped(config, backend, groups, started, progress)
    result = backend.run(config, progress)
    if writer is not None:
        _log_norms(writer, result, config.accum_steps)
    return _report(config, result, started, backend, progress)


def _report(config: RunConfig, result: RunResult, started: float, backend: Backend | None = None,
            progress: Progress | None = None, weights: dict[str, np.ndarray] | None = None) -> Report:
    return build_report(config.case, result, config.accum_steps, config.fault, config.oracle,
                        time.perf_counter() - started, config.record(), _replay(config, backend, progress, weights))


def _replay(config: RunConfig, backend: Backend | None, progress: Progress | None,
            weights: dict[str, np.ndarray] | None = None) -> Callable[[list[str]], Any] | None:
    """The judge's second pass: the run's micro-gradients again, where the backend replays them."""
    if backend is None or not backend.capabilities.replay or config.world_size is not None:
        return None

    def replay(names: list[str]) -> Any:
        return backend.micro_gradients(config, names, progress, weights)

    return replay


def _grouped(config: RunConfig, backend: Backend, groups: list[list[str]], started: float,
             progress: Progress | None) -> Report:
    """A run judged in ``groups`` (--memory-budget): each group's tensors judged and dropped before
    the next group runs."""
    judge = Judge(config.accum_steps, config.record(), _replay(config, backend, progress))
    for part in backend.run_groups(config, groups, progress):
        judge.add(part)
        del part  # before the next group runs
    return judge.report(config.case, config.fault, config.oracle, time.perf_counter() - started)


def _log_norms(writer: ScalarWriter, result: RunResult, step: int) -> None:
    """Both modes' per-layer gradient norms (``grad_norm_native/<layer>``, ``grad_norm_manual/``)."""
    names = [p.name for p in result.params]
    for mode in ("native", "manual"):
        for layer, norm in layer_norms(names, [getattr(p, mode) for p in result.params]).items():
            writer.add_scalar(f"grad_norm_{mode}/{layer}", norm, step)
    writer.close()


def _own(config: RunConfig, backend: Backend) -> RunConfig:
    """``config`` for ``backend`` alone, as a cross-framework run makes it: the float64 oracle on,
    only the backend options that are its own."""
    own = {option.name for option in backend.capabilities.options}
    return dataclasses.replace(config, frameworks=(backend.name,), oracle=True,
                               backend_options=tuple((k, v) for k, v in config.backend_options if k in own))


def _cross(config: RunConfig, progress: Progress | None, weights: dict[str, dict[str, np.ndarray]]) -> CrossReport:
    backends = [get_backend(name) for name in config.frameworks]  # all found before any runs
    results, reports = [], []
    for backend in backends:
        own = _own(config, backend)
        started = time.perf_counter()
        result = backend.run(own, progress, weights=weights.get(backend.name))
        results.append(result)
        reports.append(_report(own, result, started, backend, progress, weights.get(backend.name)))
    names = list(config.frameworks)
    pairs = list(itertools.combinations(range(len(results)), 2))  # every pair, i < j
    agreements = [a for i, j in pairs for a in agreement(results[i], results[j], [names[i], names[j]])]
    forwards = [forward_agreement(results[i], results[j], [names[i], names[j]]) for i, j in pairs]
    return CrossReport(frameworks=names, reports=reports, agreement=agreements, forward=forwards[0],
                       forward_rest=[f for f in forwards[1:] if f is not None],
                       odd_one_out=odd_one_out(names, agreements), allowance=FLOAT64_KERNEL_ALLOWANCE)


def sweep(case: str | Path | Case, steps: Sequence[int], *, progress: Progress | None = None,
          **options: Any) -> SweepReport:
    """``compare(case, accum_steps=N, **options)`` for each N in ``steps``. A double-step fault
    needs a running total, so at N = 1 it runs without it (the report says so)."""
    reports = []
    for i, n in enumerate(steps):
        def step_progress(phase: str, done: int, total: int, i: int = i) -> None:
            if progress is not None:
                progress("sweep", i + done / total, len(steps))

        run_options = dict(options)
        skipped = n < 2 and str(run_options.get("inject") or "").startswith("double-step")
        if skipped:
            run_options["inject"] = None
        report = compare(case, accum_steps=n, progress=step_progress, **run_options)
        if skipped:
            report.notes.append(f"fault not injected: {options['inject']}: no running total at N = 1")
        reports.append(report)
    return SweepReport(reports)


def train(case: str | Path | Case = "tiny-grads", *, steps: int = 20, optimizer: str = "adam", lr: float = 1e-3,
          progress: Progress | None = None, **options: Any) -> TrajectoryReport:
    """``steps`` optimizer steps of ``case`` from the same start with native and manual
    accumulation (and the whole model in float64 with ``oracle``): ``accumcheck train``.
    ``options``: framework, device, accum_steps, seed, inject, oracle, dtype, and a backend's
    own (MXNet's ``hybridize``, ``multi_precision``). Raises AccumcheckError
    for bad input or a backend that cannot train."""
    own = checked_values({"steps": steps, "optimizer": optimizer, "lr": lr}, TRAIN_OPTIONS)
    config = configure({"case": case, **options}, only=TRAIN_RUN_OPTIONS + tuple(backend_options()), what="train")
    backend = get_backend(config.framework)
    if not backend.capabilities.trajectory:
        able = [name for name in backend_names() if get_backend(name, installed=False).capabilities.trajectory]
        raise AccumcheckError(f"train: the {backend.name} backend runs no training trajectories; "
                              f"use --framework {' or '.join(able) or 'NAME of one that does'}")
    if config.dtype not in backend.capabilities.trajectory_dtypes:
        able = [name for name in backend_names()
                if config.dtype in get_backend(name, installed=False).capabilities.trajectory_dtypes]
        raise AccumcheckError(f"train --dtype {config.dtype}: the {backend.name} backend trains "
                              f"{', '.join(backend.capabilities.trajectory_dtypes)} parameters only"
                              + (f"; use --framework {' or '.join(able)}" if able else ""))
    return backend.train(config, own["steps"], own["optimizer"], own["lr"], progress)


# The integration that runs a built-in case through each training stack (its ``run_case``).
STACK_MODULES = {
    "transformers": "accumcheck.integrations.transformers",
    "accelerate": "accumcheck.integrations.accelerate",
    "lightning": "accumcheck.integrations.lightning",
    "gluon": "accumcheck.integrations.gluon",
    "loop": "accumcheck.torch.loopcase",
    "fsdp2": "accumcheck.torch.loopcase",  # its run_sharded_case
    "deepspeed": "accumcheck.integrations.deepspeed",
}
# the stacks that run on several ranks, and how each built-in run is reached; and the one that runs data
# parallel inside one process (Gluon: several contexts under a kvstore)
PARALLEL_STACKS = ("transformers", "accelerate", "lightning", "loop", "fsdp2", "deepspeed")
IN_PROCESS_PARALLEL = ("gluon",)


def stack(stack: str, case: str | Path | Case = "padded-tokens", accum_steps: int | None = None,
          batches: int | None = None, fault: str | None = None, force: bool = False, world_size: int = 1) -> Any:
    """A built-in case (or case file) run through a training stack ("transformers",
    "accelerate", "lightning", "gluon") as a user would write it, every optimizer step judged
    against its window as one batch; ``fault`` breaks the loop on purpose ("micro-batch-mean",
    "loss-over-n", and for gluon "step-per-micro-batch" and, with ``world_size`` contexts,
    "step-per-context-batch"). Returns a StackReport. A run that
    needs more memory than is available is refused before it starts, with the estimate
    (``accumcheck.run.resources.estimate_stack``), unless ``force``."""
    if stack not in STACKS:
        raise AccumcheckError(f"--stack {stack}: not a training stack accumcheck knows; use one of {', '.join(STACKS)}")
    resolved = resolve_case(case)
    for name, value in (("--accum-steps", accum_steps), ("--batches", batches)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise AccumcheckError(f"{name} {value}: give a positive whole number")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise AccumcheckError(f"--world-size {world_size}: give a positive whole number")
    if world_size > 1 and stack not in PARALLEL_STACKS + IN_PROCESS_PARALLEL:
        raise AccumcheckError(f"--stack {stack} with --world-size: runs in one process here; use one of "
                              f"{', '.join(PARALLEL_STACKS + IN_PROCESS_PARALLEL)}, or leave --world-size out")
    steps = accum_steps or resolved.accum_steps
    check_stack_resources(estimate_stack(resolved, steps, batches), force=force)
    if world_size > 1 and launched_world_size() is None and stack in PARALLEL_STACKS:  # torchrun runs the ranks
        if not isinstance(case, (str, Path)):
            raise AccumcheckError("stack with world_size > 1: pass the case by name or file, which every rank reads")
        from .torch.stacks.launch import launch

        arguments = [f"--stack={stack}", f"--case={case}", f"--accum-steps={steps}", "--force"] + \
            ([f"--batches={batches}"] if batches is not None else []) + ([f"--fault={fault}"] if fault else [])
        return launch(arguments, world_size)
    module = importlib.import_module(STACK_MODULES[stack])  # imports the stack's framework
    run_case = getattr(module, "run_sharded_case" if stack == "fsdp2" else "run_case")
    if stack in PARALLEL_STACKS + IN_PROCESS_PARALLEL:
        return run_case(resolved, steps, batches, fault, world_size=world_size)
    return run_case(resolved, steps, batches, fault)


def write_repro(report: Report, config: RunConfig, path: str | Path, *, shrink: bool = False,
                log: Callable[[str], None] | None = None, max_trials: int = MAX_TRIALS) -> ReproFiles:
    """Write the standalone script ``path`` (a .py file) that reproduces ``config``'s run (its
    ``report``) with the framework and numpy alone, and its data beside it (the same name, .npz):
    ``accumcheck compare --repro``. With ``shrink`` the case is first made as small as it gets
    while a tensor stays flagged (at most ``max_trials`` runs; ``accumcheck.repro.shrink``), and written
    beside them (.toml); a run that flagged nothing is not shrunk. ``log`` is told each kept
    reduction. Returns the files. Raises AccumcheckError for what cannot be reproduced or
    written."""
    files = check_request(config, path, shrink)
    assert files is not None
    say = log or (lambda line: None)
    shrunk_from = None
    target = target_of(report, config.fault.param if config.fault is not None else None)
    if shrink and target is None:
        say(f"--shrink: case {config.case.name} flagged nothing, so there is nothing to shrink; the script "
            "reproduces the case as it is")
    elif shrink:
        result = shrink_case(config.case, config.accum_steps, _trial(config), target, str(files.case),
                             max_trials=max_trials, log=say)
        if result.report is None:
            say(f"--shrink: no reduction of case {config.case.name} kept {target[0]} flagged; it is written as it is")
            case_text = case_toml(dict(config.case.to_document(), accum_steps=config.accum_steps))
        else:
            say(result.line(config.case.name))
            shrunk_from = f"case {config.case.name} at N = {config.accum_steps}"
            case_text, report = result.case.text, result.report
            config = dataclasses.replace(config, case=result.case, accum_steps=result.accum_steps,
                                         fault=_fault_for(config.fault, result.case, result.accum_steps))
        write_text(files.case, case_text)
        files = dataclasses.replace(files, shrunk=True)
    write_script(files, config, report, shrunk_from)
    return files


def _fault_for(fault: Fault | None, case: Case, accum_steps: int) -> Fault | None:
    """``fault`` aimed again at the same parameter, for ``case`` at ``accum_steps``."""
    if fault is None:
        return None
    return resolve_fault(Fault(fault.kind, fault.param), [(p.name, p.kind) for p in case.parameters()], accum_steps)


def _trial(config: RunConfig) -> Callable[[Case, int], Report]:
    """A shrink's run of ``config`` on another case and N: the same framework, device, fault and
    options, without the extras that judge nothing per tensor (oracle, full batch, norms)."""
    def run_case(case: Case, accum_steps: int) -> Report:
        return run(dataclasses.replace(config, case=case, accum_steps=accum_steps,
                                       fault=_fault_for(config.fault, case, accum_steps), oracle=False,
                                       full_batch=False, grad_norms=None))

    return run_case

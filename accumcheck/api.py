"""``accumcheck.compare``: one call runs a case in a framework and returns the Report;
``accumcheck.compare_frameworks`` runs it in several and says whether they agree."""

from __future__ import annotations

import datetime as _dt
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from . import dataparallel
from .backends import get_backend
from .backends.base import Progress, RunResult
from .bounds import UNIT_ROUNDOFF, ModeBound
from .cases import Case, resolve_case
from .compare import compare_tensor, ratio_map
from .crosscheck import CrossReport, agreement, forward_agreement
from .diagnostics.layers import layer_norms
from .diagnostics.tensorboard import ScalarWriter
from .errors import AccumcheckError
from .faults import Fault, parse_fault, resolve_fault
from .report import Report


def compare(
    case: str | Path | Case = "embed-attention",
    framework: str = "torch",
    accum_steps: int | None = None,
    device: str = "cpu",
    seed: int | None = None,
    oracle: bool = False,
    inject: str | Fault | None = None,
    progress: Progress | None = None,
    hybridize: bool = True,
    grad_norms: str | Path | None = None,
    dtype: str = "float32",
    accum_dtype: str = "float32",
    mode: str = "native",
    loss_reduction: str | None = None,
    full_batch: bool = False,
    world_size: int | None = None,
    reduce_dtype: str = "float32",
    inject_rank: int | None = None,
) -> Report:
    """Run ``case`` (a built-in name, a TOML path or a Case) for ``accum_steps`` micro-steps
    (default: the case's own) in native and manual mode, and judge every parameter tensor.

    ``hybridize`` applies to MXNet (Gluon ``hybridize(static_alloc=True)``); other frameworks
    ignore it. ``grad_norms`` names a TensorBoard log folder for the per-layer gradient norms of
    both modes (tags ``grad_norm_native/<layer>``, ``grad_norm_manual/<layer>``, step N).
    ``dtype`` is that of the parameters and gradients (so of the native accumulation: float32,
    bfloat16 or float16), ``accum_dtype`` that of the manual buffer (float32 or float64).
    ``mode`` fills the native slot: "native" (the framework's own accumulation), "accumulator"
    or "compensated" (``accumcheck.torch.GradAccumulator``, PyTorch only). ``loss_reduction``
    overrides the case's ("mean", "sum" or "token_count"); ``full_batch`` also compares the
    accumulated gradient with the whole batch's in one backward pass (PyTorch, float64), and a
    mismatch there (how the loss is normalised) is flagged as semantic.
    ``world_size`` runs the case data-parallel under torch.distributed (PyTorch only; see
    ``accumcheck.backends.torch_distributed``): W ranks of N micro-steps each, DDP with
    ``no_sync()`` as native, an all-reduce every micro-step as manual, and one process over the
    same W*N micro-batches as the reference; ``reduce_dtype`` is DDP's all-reduce dtype (float32,
    bfloat16 or float16), ``inject_rank`` the rank whose native accumulation ``inject`` perturbs
    (default 0). Under torchrun every rank calls it and gets the same Report.
    Returns the Report. Raises AccumcheckError for an unknown case, framework, device or fault,
    a malformed case file, or a non-positive ``accum_steps``."""
    started = time.perf_counter()
    the_case, steps, fault = _prepare(case, accum_steps, seed, inject)
    if loss_reduction is not None:
        the_case = the_case.with_reduction(loss_reduction)
    backend = get_backend(framework)
    writer = ScalarWriter(str(grad_norms)) if grad_norms is not None else None  # fails before the run
    for flag, value, allowed in (("--dtype", dtype, ("float32", "bfloat16", "float16")),
                                 ("--accum-dtype", accum_dtype, ("float32", "float64")),
                                 ("--mode", mode, ("native", "accumulator", "compensated"))):
        if value not in allowed:
            raise AccumcheckError(f"{flag}: {value!r} is not one of {', '.join(allowed)}")
    if full_batch and the_case.conditional_layers():
        raise AccumcheckError(f"--full-batch: case {the_case.name!r} routes each micro-batch through its conditional "
                              "layers on its own, so the whole batch has no single route; drop --full-batch")
    if world_size is None:
        for flag, value, default in (("--reduce-dtype", reduce_dtype, "float32"), ("--inject-rank", inject_rank, None)):
            if value != default:
                raise AccumcheckError(f"{flag} {value}: applies to data-parallel runs; add --world-size W")
        run = backend.run(the_case, steps, device, fault=fault, oracle=oracle, progress=progress,
                          options={"hybridize": hybridize, "dtype": dtype, "accum_dtype": accum_dtype, "mode": mode,
                                   "full_batch": full_batch})
    else:
        run = _run_data_parallel(the_case, steps, framework, device, fault, oracle, progress, dtype, accum_dtype, mode,
                                 full_batch, world_size, reduce_dtype, inject_rank)
    if writer is not None:
        names = [p.name for p in run.params]
        for mode in ("native", "manual"):
            for layer, norm in layer_norms(names, [getattr(p, mode) for p in run.params]).items():
                writer.add_scalar(f"grad_norm_{mode}/{layer}", norm, steps)
        writer.close()
    return build_report(the_case, run, steps, fault, oracle, time.perf_counter() - started)


def _run_data_parallel(case: Case, steps: int, framework: str, device: str, fault: Fault | None, oracle: bool,
                       progress: Progress | None, dtype: str, accum_dtype: str, mode: str, full_batch: bool,
                       world_size: int, reduce_dtype: str, inject_rank: int | None) -> RunResult:
    """Check what a data-parallel run supports, then run it."""
    if framework != "torch":
        raise AccumcheckError(f"--world-size with --framework {framework}: data-parallel runs use torch.distributed; "
                              "use --framework torch")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise AccumcheckError(f"--world-size: {world_size!r} is not a positive integer")
    for flag, value, default in (("--dtype", dtype, "float32"), ("--mode", mode, "native"),
                                 ("--full-batch", full_batch, False)):
        if value != default:
            raise AccumcheckError(f"{flag} {value}: not available with --world-size (data-parallel runs keep float32 "
                                  "parameters and DDP's own accumulation; --reduce-dtype sets the all-reduce's dtype)")
    from .backends.torch_distributed import REDUCE_DTYPES, run_data_parallel

    if reduce_dtype not in REDUCE_DTYPES:
        raise AccumcheckError(f"--reduce-dtype: {reduce_dtype!r} is not one of {', '.join(REDUCE_DTYPES)}")
    rank = 0 if inject_rank is None else inject_rank
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise AccumcheckError(f"--inject-rank {inject_rank}: ranks are 0..{world_size - 1}")
    if inject_rank is not None and fault is None:
        raise AccumcheckError(f"--inject-rank {inject_rank}: names the rank of an --inject fault; add --inject KIND")
    return run_data_parallel(case, steps, world_size, device, fault=fault, fault_rank=rank,
                             reduce_dtype=reduce_dtype, accum_dtype=accum_dtype, oracle=oracle, progress=progress)


def compare_frameworks(
    case: str | Path | Case = "embed-attention",
    frameworks: Sequence[str] = ("torch", "mxnet"),
    accum_steps: int | None = None,
    device: str = "cpu",
    seed: int | None = None,
    inject: str | Fault | None = None,
    progress: Progress | None = None,
    hybridize: bool = True,
    weights: dict[str, dict[str, np.ndarray]] | None = None,
) -> CrossReport:
    """Run ``case`` in each framework (with the float64 oracle, which the agreement bound needs),
    judge each one as ``compare`` does, and compare the first framework's manual sums with every
    other's. ``weights`` may give one framework other initial weights (to prove the check fires).

    Returns a CrossReport; raises AccumcheckError as ``compare`` does, or for fewer than two
    distinct frameworks."""
    names = list(dict.fromkeys(frameworks))
    if len(names) < 2:
        raise AccumcheckError(f"--framework: name two frameworks to compare (e.g. torch,mxnet), got {frameworks!r}")
    the_case, steps, fault = _prepare(case, accum_steps, seed, inject)
    backends = [get_backend(name) for name in names]  # all checked before any runs
    runs, reports = [], []
    for backend in backends:
        started = time.perf_counter()
        run = backend.run(the_case, steps, device, fault=fault, oracle=True, progress=progress,
                          options={"hybridize": hybridize}, weights=(weights or {}).get(backend.framework_name))
        runs.append(run)
        reports.append(build_report(the_case, run, steps, fault, True, time.perf_counter() - started))
    agreements = [a for other in runs[1:] for a in agreement(runs[0], other)]
    return CrossReport(frameworks=names, reports=reports, agreement=agreements,
                       forward=forward_agreement(runs[0], runs[1]))


def _prepare(case: str | Path | Case, accum_steps: int | None, seed: int | None,
             inject: str | Fault | None) -> tuple[Case, int, Fault | None]:
    the_case = resolve_case(case)
    if seed is not None:
        the_case = the_case.with_seed(seed)
    steps = the_case.accum_steps if accum_steps is None else accum_steps
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise AccumcheckError(f"--accum-steps: {steps!r} is not a positive integer")
    fault = None
    if inject is not None:
        fault = parse_fault(inject) if isinstance(inject, str) else inject
        fault = resolve_fault(fault, [(p.name, p.kind) for p in the_case.parameters()], steps)
    return the_case, steps, fault


def build_report(case: Case | None, run: RunResult, accum_steps: int, fault: Fault | None, oracle: bool,
                 seconds: float, model: str = "") -> Report:
    """Judge every tensor of a backend's RunResult and wrap the verdicts in a Report. ``case`` is
    None for a user's own model, named by ``model``."""
    from . import __version__

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
                                           run.data_parallel["world_size"], run.data_parallel["reduce_dtype"])
        native_bound, manual_bound, reference = parallel.native, parallel.manual, parallel.reference
    ulps = run.settings.get("mode", "native") != "native"  # how close a GradAccumulator gets
    tensors = [compare_tensor(p.name, p.kind, p.native, p.manual, p.exact, p.absum, native_bound, manual_bound,
                              p.oracle, reference_bound=reference, ulps=ulps) for p in run.params]
    settings, bound = run.settings, {"native": vars(native_bound), "manual": vars(manual_bound)}
    if parallel is not None:
        settings = {**settings, "data_parallel": {**run.data_parallel, **dataparallel.judge(tensors, run, parallel)}}
        bound.update(single_process=vars(parallel.single_process), rank=vars(parallel.rank))
    whole = sum(t.grad_sum_sq for t in tensors)
    for t in tensors:
        t.norm_share = t.grad_sum_sq / whole if whole > 0 else 0.0
    # Where the differences sit, for the flagged tensors and the three nearest their bound.
    mapped = {t.name for t in tensors if t.flagged}
    mapped |= {t.name for t in sorted(tensors, key=lambda t: -t.ratio if t.ratio == t.ratio else 0)[:3]}
    for p, t in zip(run.params, tensors):
        if t.name in mapped and t.verdict != "non-finite":
            t.ratio_map, t.ratio_map_cell = ratio_map(p.native, p.manual, p.exact, p.absum, native_bound, manual_bound)
    if case is None:
        case = Case(model or "model", "", -1, accum_steps, None, "", 0.0, 0.0, (), source=f"<user model {model}>")
    return Report(
        case=case.name, case_source=case.source, case_fingerprint=case.fingerprint(), case_toml=case.text,
        framework=run.framework, versions={"accumcheck": __version__, **run.versions}, device=run.device,
        param_dtype=run.param_dtype, accum_dtype=run.accum_dtype, accum_steps=accum_steps, seed=case.seed,
        oracle=oracle, inject=None if fault is None else str(fault),
        bound=bound, loss_reduction=case.loss_reduction, settings=settings, losses=run.losses, seconds=round(seconds, 3),
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), tensors=tensors)

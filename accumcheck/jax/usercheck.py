"""Check gradient accumulation on your own JAX model.

    import accumcheck.jax
    report = accumcheck.jax.check(params, loss_fn, batches, accum_steps=16)
    accumcheck.assert_faithful(report)

``params`` is any pytree of float arrays (flax's and haiku's nested dicts, lists, tuples): what is
checked, in the place of the model of the other frameworks' checks; ``loss_fn(params, batch)``
returns the scalar loss. One gradient per micro-batch (``jax.value_and_grad(loss_fn)``,
jit-compiled unless ``jit=False``) feeds both modes: ``optax.MultiSteps(optax.sgd(1.0),
every_k_schedule=N)`` initialised on your parameters (its accumulator in their dtypes) and a
float32 buffer added with ``tree_map`` (float64 for float64 parameters), with float64 sums E and S
on the host. Each parameter array is judged as ``accumcheck compare --framework jax`` judges a
case. Your params (NumPy arrays among them, by value, also those your code edits), batches, JAX's
x64 flag and Python's and NumPy's random states are left as found, also when the check raises.
"""

from __future__ import annotations

import time
from collections import Counter
from functools import partial
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from ..errors import AccumcheckError, NothingJudgedError
from ..judge import build_report
from ..report import Report
from ..run.backend import Progress
from ..run.checkargs import CheckShape
from ..run.faults import Fault, resolve_fault
from ..run.resources import check_resources, estimate_model
from ..run.usermodel import Batch, batch_source, host_random_states
from .devices import check_device
from .engine import Model, gradient, replay, run_model
from .library import versions
from .multisteps import accumulator_note, harmonic_note, settings
from .paramtree import ParamTree
from .usercode import LossFn, check_loss, guarded, oracle_guarded

# The shared options it honours; the others are refused when given. None as loss_reduction: "mean",
# the scalar loss of each micro-batch that MultiSteps averages (it takes no other value here).
SHAPE = CheckShape(
    "accumcheck.jax.check", frozenset(("device", "oracle", "inject", "force", "progress")), reduction="mean",
    why_not={"step": "loss_fn(params, batch) is the step: it computes the loss itself",
             "mode": "optax.MultiSteps is the one native accumulation it checks",
             "full_batch": "it runs no full-batch reference", "collate": "it runs no full-batch reference",
             "loss_reduction": "it describes the loop for full_batch, which it does not run",
             "train_mode": "loss_fn(params, batch) is a pure function: it has no training mode",
             "memory_budget": "it runs every parameter at once"})
Batches = Sequence[Batch] | Iterable[Batch] | Callable[[int], Batch]


def check(params: Any, loss_fn: LossFn | None = None, batches: Batches | None = None,
          accum_steps: int | None = None, *, device: Any = None, step: Any = None, mode: str = "native",
          oracle: bool = False, inject: str | None = None, full_batch: bool = False, collate: Any = None,
          loss_reduction: str | None = None, train_mode: bool = False, memory_budget: int | str | None = None,
          force: bool = False, progress: Progress | None = None, jit: bool = True, grad_mean: bool = True) -> Report:
    """Accumulate ``accum_steps`` micro-batches with optax.MultiSteps and by hand, and judge every
    parameter array.

    ``batches`` is a sequence or iterable (the first ``accum_steps`` are used; default all) or a
    function of the micro-step index; each batch is passed to ``loss_fn`` as it is. ``params``'
    arrays may be float32, bfloat16, float16 or float64 (mixed: each judged by its own dtype);
    float64 ones run under JAX's x64 mode (``jax.enable_x64``) for the check only.

    It takes the call shape every framework's check shares (``accumcheck.run.checkargs``) and
    honours ``device``, ``oracle``, ``inject``, ``force`` and ``progress``; ``step``, ``mode``
    other than "native", ``full_batch``, ``collate``, ``loss_reduction``, ``train_mode`` and
    ``memory_budget`` are refused when given (``loss_fn`` is the step; MultiSteps is the one
    native mode; a pure function has no training mode). ``device`` ("cpu", "gpu", "gpu:N",
    "cuda:N" or a jax device) is where params' jax arrays must be; NumPy arrays are put there.
    ``grad_mean`` is MultiSteps' ``use_grad_mean`` (its running mean, optax's default, or a
    running sum). ``oracle`` also runs ``loss_fn`` on a float64 copy of params (JAX's x64 mode for
    that pass only). ``inject`` (e.g. ``"scale"``, ``"drop-step:params.Dense_0.kernel"``) perturbs
    the native accumulation to prove the check fires. A check that would need more memory beside
    params than is available is refused unless ``force``. Returns a Report; raises, in one line,
    AccumcheckError for bad input (the order of JAX's former ``check(loss_fn, params, batches)``
    among it), UserCodeError for an exception raised by ``loss_fn`` or the batches (SystemExit
    too), NothingJudgedError when no array received a gradient.
    """
    started = time.perf_counter()
    if callable(params) and not callable(loss_fn):
        raise AccumcheckError("check: accumcheck.jax.check takes check(params, loss_fn, batches): the parameters "
                              "first (what is checked, where the other frameworks' checks take the model), then "
                              "loss_fn(params, batch); swap the first two arguments")
    if loss_fn is None:
        raise AccumcheckError("check: loss_fn is missing; pass loss_fn(params, batch) -> the scalar loss, as "
                              "check(params, loss_fn, batches)")
    shared = SHAPE.validate(loss_fn=loss_fn, batches=batches, accum_steps=accum_steps, device=device, step=step,
                            mode=mode, oracle=oracle, inject=inject, full_batch=full_batch, collate=collate,
                            loss_reduction=loss_reduction, train_mode=train_mode, memory_budget=memory_budget,
                            force=force, progress=progress)
    for name, value in (("jit", jit), ("grad_mean", grad_mean)):
        if not isinstance(value, bool):
            raise AccumcheckError(f"check: {name} must be True or False, got {value!r}")
    tree = ParamTree(params)
    if device is not None:
        tree.place(check_device(device))
    check_resources(estimate_model(sum(int(np.prod(leaf.shape)) for leaf in tree.leaves), oracle), "check",
                    force=force)
    with host_random_states(), tree.kept():
        return _check(loss_fn, tree, batches, accum_steps, oracle, inject, shared.fault, progress, jit, grad_mean,
                      started)


check.shape = SHAPE  # type: ignore[attr-defined]  # what the setup file and the plugin read (checkargs.shape_of)


def _check(loss_fn: LossFn, tree: ParamTree, batches: Batches, accum_steps: int | None, oracle: bool,
           inject: str | None, fault: Fault | None, progress: Progress | None, jit: bool, grad_mean: bool,
           started: float) -> Report:
    """check's run, its arguments known to be right."""
    get_batch, steps = batch_source(batches, accum_steps)
    fault = resolve_fault(fault, list(tree.kinds.items()), steps) if fault is not None else None
    model = Model(tree, gradient(loss_fn, jit), get_batch, guard=partial(guarded, jit),
                  check_first=partial(check_loss, loss_fn, jit))
    # The float64 oracle's: the same loss_fn and batches, freshly compiled; loss_fn's exception says so.
    oracle_model = None if not oracle else Model(tree, gradient(loss_fn, jit), get_batch,
                                                 guard=partial(oracle_guarded, jit))
    result, micro = run_model(model, steps, jit=jit, grad_mean=grad_mean, fault=fault, oracle=oracle_model,
                              progress=progress, versions=versions(),
                              settings=settings(steps, jit, grad_mean, tree.accum_dtype, " initialised on your params"),
                              notes=_notes(tree, steps, jit, grad_mean))
    options = {"oracle": oracle or None, "inject": inject, "jit": None if jit else False,
               "grad_mean": None if grad_mean else False}
    name = getattr(loss_fn, "__name__", None)
    config = {"model": name if name and name != "<lambda>" else "loss_fn", "loss": "loss_fn(params, batch)",
              **{k: v for k, v in options.items() if v is not None}}
    try:
        return build_report(None, result, steps, fault, oracle, time.perf_counter() - started, config=config,
                            replay=partial(replay, micro, steps, progress))
    except NothingJudgedError as exc:
        raise NothingJudgedError(
            f"check: nothing was judged: loss_fn's gradient was zero for all {len(tree.names)} arrays of params in "
            f"the {steps} micro-batch{'es' * (steps != 1)}; make loss_fn depend on params (a constant, or a loss "
            "under jax.lax.stop_gradient, gives none)") from exc


def _notes(tree: ParamTree, steps: int, jit: bool, grad_mean: bool) -> list[str]:
    notes = ["loss_fn gradient jit-compiled" if jit else "op by op (no jit)"]
    if grad_mean:
        notes.append(harmonic_note(steps))
    counts = Counter(tree.dtypes.values())
    if len(counts) > 1:
        notes.append("mixed parameter dtypes (" + ", ".join(f"{counts[d]} {d}" for d in sorted(counts))
                     + "), each judged by its own; MultiSteps' accumulator keeps each parameter's dtype")
    elif tree.param_dtype != "float32":
        notes.append(accumulator_note(tree.param_dtype))
    if tree.accum_dtype == "float64":
        notes.append("float64 parameters: the check ran in JAX's x64 mode (jax.enable_x64)")
    return notes

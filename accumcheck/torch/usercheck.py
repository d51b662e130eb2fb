"""Check gradient accumulation on your own PyTorch model.

    import accumcheck.torch
    report = accumcheck.torch.check(model, loss_fn, batches, accum_steps=16)
    report = accumcheck.torch.check(hf_model, batches=dict_batches, accum_steps=16)  # output.loss
    accumcheck.assert_faithful(report)

One backward pass per micro-batch feeds both modes: ``.grad`` accumulating natively, and a
manual buffer (float32, or the parameters' dtype when wider) with float64 sums E and S, fed from
the same micro-gradients. Each parameter is judged as ``accumcheck compare`` judges a case. The
model runs in eval mode (dropout off, batch-norm statistics frozen) unless ``train_mode``, and is
left as it was found, also when the check raises: its parameter and buffer tensors (the very
objects, with their values), ``.grad``, training flags, and PyTorch's, Python's and NumPy's random
states (``modelstate``). What the user's code raises is a UserCodeError naming the micro-batch; a
loss that ``backward()`` was already called on, a loss that depends on no parameter and a loss
scale that is not positive and finite are refused before anything is judged.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import operator
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from ..case.definition import infer_kind
from ..errors import AccumcheckError
from ..files import size_text
from ..judge import Judge, build_report
from ..report import Report
from ..run.backend import Progress
from ..run.budget import FIXED_BYTES, minimum, plan
from ..run.checkargs import CheckShape
from ..run.faults import resolve_fault
from ..run.resources import check_resources, estimate_model
from ..run.results import ParamAccumulation, RunResult
from ..run.usermodel import Batch, batch_source, host_random_states
from . import engine
from .modelstate import ModelState, snapshot_bytes
from .needs import model_needs
from .userbatch import backward_error, item_count, join, micro_loss, to_device

AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# Every shared option is honoured; a loss_reduction of None is PyTorch's convention, a mean per micro-batch.
SHAPE = CheckShape("accumcheck.torch.check", frozenset(
    ("device", "step", "mode", "oracle", "inject", "full_batch", "collate", "loss_reduction", "train_mode",
     "memory_budget", "force", "progress")), reduction="mean")
_GRAD = operator.attrgetter("grad")


def _leaves_host_state(check: Callable[..., Report]) -> Callable[..., Report]:
    """``check`` with Python's and NumPy's random states and autograd's grad mode put back after
    it, also when it raises (the user's code may draw from them or switch grad off)."""
    @functools.wraps(check)
    def run(*args: Any, **kwargs: Any) -> Report:
        with host_random_states(), torch.set_grad_enabled(torch.is_grad_enabled()):
            return check(*args, **kwargs)

    return run


@_leaves_host_state
def check(model: Any, loss_fn: Callable[..., Any] | None = None,
          batches: Sequence[Batch] | Iterable[Batch] | Callable[[int], Batch] | None = None,
          accum_steps: int | None = None, *, device: str | None = None,
          step: Callable[[Any, Any], Any] | None = None, mode: str = "native", oracle: bool = False,
          inject: str | None = None, full_batch: bool = False, collate: Callable[[list[Any]], Any] | None = None,
          loss_reduction: str | None = None, train_mode: bool = False, memory_budget: int | str | None = None,
          force: bool = False, progress: Progress | None = None, autocast: Any = None,
          grad_scaler: Any = None) -> Report:
    """Accumulate ``accum_steps`` micro-batches natively and by hand, and judge every parameter.

    ``model`` is any ``torch.nn.Module`` with parameters in float32, bfloat16, float16 or float64.
    The loss of a micro-batch is ``loss_fn(model(inputs), target)`` for ``(inputs, target)``
    batches (``loss_fn(output)`` where a batch has no target), the model's own ``output.loss``
    when ``loss_fn`` is None (a dict batch is passed as ``model(**batch)``), or
    ``step(model, batch)``. ``batches`` is a sequence or iterable (the first ``accum_steps`` are
    used; default all) or a function of the micro-step index; nested tensors are moved to the
    model's device (``device`` must be where the model is).

    It takes the call shape every framework's check shares (``accumcheck.run.checkargs``) and
    honours all of it. ``mode`` fills the native slot with ``.grad`` ("native") or a
    GradAccumulator ("accumulator", "compensated"). ``autocast`` (torch.bfloat16 or torch.float16) runs each
    forward under ``torch.autocast``; ``grad_scaler`` (a ``torch.amp.GradScaler``) scales each
    loss by its scale and the gradients are judged unscaled (an overflow is a skipped step, not a
    fault). ``train_mode`` runs the model in training mode (batch-norm batch statistics) with its
    dropout modules off. ``oracle`` also runs a float64 copy of the model. ``full_batch`` also
    runs the N micro-batches as one batch (joined along dim 0, or by ``collate``) in float64 and
    judges the accumulated gradient against it, divided by N for a ``loss_reduction`` "mean"
    loop (the loop divides each micro-batch's mean loss by N), as it is for "sum" and
    "token_count"; None is PyTorch's convention, "mean". ``inject`` (e.g. ``"scale"``, ``"drop-step:fc.weight"``) perturbs the native
    accumulation to prove the check fires. A check that would need more memory beside the model
    than is available is refused unless ``force``. ``memory_budget`` (bytes, or a text such as
    ``"512M"``) bounds what the check holds beside the model: the parameters are run and judged in
    groups that fit it, the micro-batches replayed for each group (not with ``oracle`` or
    ``full_batch``); it includes the copy of the parameters and buffers kept to put them back.
    Returns a Report; raises AccumcheckError for bad input, UserCodeError (one) for an exception
    the user's batches, model, loss, ``step`` or gradient hooks raised (chained as its cause), and
    NothingJudgedError when no parameter received a gradient.
    """
    started = time.perf_counter()
    shared = SHAPE.validate(loss_fn=loss_fn, batches=batches, accum_steps=accum_steps, device=device, step=step,
                            mode=mode, oracle=oracle, inject=inject, full_batch=full_batch, collate=collate,
                            loss_reduction=loss_reduction, train_mode=train_mode, memory_budget=memory_budget,
                            force=force, progress=progress)
    budget, loss_reduction = shared.budget, shared.loss_reduction
    if grad_scaler is not None and not (hasattr(grad_scaler, "get_scale") and hasattr(grad_scaler, "is_enabled")):
        raise AccumcheckError(f"check: grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
    cast = _autocast_dtype(autocast)
    groups = _parameters(model)
    params = {names[0]: p for names, p in groups}
    first = next(iter(params.values()))
    where = first.device
    _check_device(params, device, where)
    get_batch, steps = batch_source(batches, accum_steps)
    kinds = _kinds(model, params)
    fault = shared.fault
    if fault is not None:
        canonical = {alias: names[0] for names, _ in groups for alias in names[1:]}  # a tied weight's other names
        fault = resolve_fault(dataclasses.replace(fault, param=canonical.get(fault.param, fault.param)),
                              list(kinds.items()), steps)
    dtypes = {name: str(p.dtype).replace("torch.", "") for name, p in params.items()}
    param_dtype = max(set(dtypes.values()), key=list(dtypes.values()).count)
    if any(dtype not in ("float32", "bfloat16", "float16", "float64") for dtype in dtypes.values()):
        raise AccumcheckError(f"check: parameters must be floating point (float32, bfloat16, float16, float64); "
                              f"found {', '.join(sorted(set(dtypes.values())))}")
    # The manual buffer: float32, or float64 for a float64 model; a GradAccumulator's is float32.
    accum_dtype = torch.float64 if param_dtype == "float64" and mode == "native" else torch.float32
    uniform = first.dtype if len(set(dtypes.values())) == 1 else None
    scale = _scale_of(grad_scaler)
    kept = snapshot_bytes(model)  # the copy that puts the model back
    need = estimate_model(sum(p.numel() for p in params.values()), oracle or full_batch, budget)
    check_resources(need if budget is not None else dataclasses.replace(need, bytes=need.bytes + kept), "check",
                    force=force)
    parts = _groups(model_needs(params, accum_dtype, mode, scale, where), budget, kept)

    saved = ModelState(model)
    subject = ModelSubject(model, groups, where, steps, get_batch, loss_fn, step, collate, uniform, cast, scale,
                           loss_reduction, train_mode, saved)
    options = {"mode": mode if mode != "native" else None, "oracle": oracle or None, "inject": inject,
               "autocast": None if cast is None else str(cast), "train_mode": train_mode or None,
               "grad_scaler": "<your GradScaler>" if grad_scaler is not None else None,
               "full_batch": full_batch or None, "loss_reduction": loss_reduction if full_batch else None,
               "memory_budget": budget}
    loss = "step" if step is not None else "loss_fn" if loss_fn is not None else "output.loss"
    config = {"model": type(model).__name__, "loss": loss, **{k: v for k, v in options.items() if v is not None}}

    def run_of(names: list[str], sums: engine.Sums, wide: engine.Float64Pass | None = None) -> RunResult:
        own = mode == "native" and len(set(dtypes.values())) > 1
        aliases = {g[0][0]: g[0][1:] for g in groups}
        return RunResult(
            params=[ParamAccumulation(name, kinds[name], **sums.arrays[name],
                                      oracle=wide.accumulated[name] if wide is not None and oracle else None,
                                      dtype=dtypes[name] if own else None, aliases=tuple(aliases[name]),
                                      steps_with_grad=sums.steps_with_grad.get(name))
                    for name in names],
            framework="torch", versions={"torch": torch.__version__}, device=str(where),
            # the GradAccumulator sums in float32, whatever the parameters' dtype
            param_dtype=param_dtype if mode == "native" else "float32",
            accum_dtype=str(accum_dtype).replace("torch.", ""), losses={"mean_loss": sums.loss},
            notes=_notes(train_mode, cast, scale, dtypes, mode),
            settings={"train_mode": train_mode, "autocast": None if cast is None else str(cast).replace("torch.", ""),
                      "grad_scale": scale},
            full_batch=wide.full_batch if wide is not None else None, grad_scale=scale)

    def replay(names: list[str]) -> Iterator[dict[str, np.ndarray]]:
        """The micro-gradients of ``names`` again (``engine.replay``), from the model as found; its
        tensors and values, gradients and flags are as they were before it, after it, also when it
        stops midway."""
        return engine.replay(subject, names, progress)

    try:
        if len(parts) == 1:
            sums, wide = engine.run_whole(subject, fault, accum_dtype, mode, oracle, full_batch, progress,
                                          hold_steps=budget is None)
            run = run_of(list(params), sums, wide)
            del sums, wide
        else:  # judged group by group, each group's buffers dropped before the next runs
            judge = Judge(steps, config, replay)
            for names, sums in engine.in_groups(subject, parts, fault, accum_dtype, mode, progress):
                judge.add(run_of(names, sums))
                del sums
    finally:
        saved.restore()
    if len(parts) > 1:
        return judge.report(None, fault, oracle, time.perf_counter() - started)
    return build_report(None, run, steps, fault, oracle, time.perf_counter() - started, config=config, replay=replay)


check.shape = SHAPE  # type: ignore[attr-defined]  # what the setup file and the plugin read (checkargs.shape_of)


class ModelSubject(engine.Subject):
    """A user's model, its micro-batches and the loss the user's loop computes (``userbatch``), for
    the engine. ``uniform``: the parameters' one dtype, for the batches' floating tensors (None
    where they differ); ``cast``: the autocast dtype; ``saved``: the model as found."""

    strict = False  # a user's model may use an operation without a deterministic kernel: it warns

    def __init__(self, model: Any, groups: list[tuple[list[str], Any]], device: Any, steps: int,
                 get_batch: Callable[[int], Any], loss_fn: Callable[..., Any] | None,
                 step: Callable[[Any, Any], Any] | None, collate: Callable[[list[Any]], Any] | None, uniform: Any,
                 cast: Any, scale: float | None, reduction: str, train_mode: bool, saved: ModelState) -> None:
        self.model, self.groups, self.device, self.steps = model, groups, device, steps
        self.params = {names[0]: p for names, p in groups}
        self.get_batch, self.loss_fn, self.step, self.collate = get_batch, loss_fn, step, collate
        self.uniform, self.cast, self.scale, self.reduction = uniform, cast, scale, reduction
        self.train_mode, self.saved = train_mode, saved
        self.user = "step" if step is not None else "loss_fn" if loss_fn is not None else "the model"
        self.joined: list[Any] | None = None

    def step_loss(self, net: Any) -> Callable[[int], Any]:
        """The loss of micro-batch k as the user's loop computes it; on the model in its dtype,
        under autocast and scaled by the GradScaler's scale, on the float64 twin in float64."""
        dtype, autocast_to, scaled = (self.uniform, self.cast, self.scale) if net is self.model else \
            (torch.float64, None, None)
        watched, where, user = list(net.parameters()), self.device, self.user

        def run(index: int) -> Any:
            batch = to_device(self.get_batch(index), where, dtype, index)
            grads = list(map(_GRAD, watched))  # to tell a loss that backward() was already called on
            versions = [g._version for g in grads if g is not None]
            with torch.autocast(where.type, dtype=autocast_to) if autocast_to else contextlib.nullcontext():
                loss = micro_loss(net, batch, index, self.loss_fn, self.step)
            if any(map(operator.is_not, grads, map(_GRAD, watched))) or \
                    versions != [g._version for g in grads if g is not None]:
                raise AccumcheckError(f"check: {user} changed the parameters' .grad on micro-batch {index} (it called "
                                      "backward() or zero_grad() itself); return the loss: accumcheck calls "
                                      "backward() itself, once per micro-batch")
            if loss.device != where:
                raise AccumcheckError(f"check: the loss of micro-batch {index} is on {loss.device}, the model on "
                                      f"{where}; compute the loss from the model's output, on the model's device")
            return loss * scaled if scaled is not None else loss
        return run

    def prepare(self, net: Any) -> None:
        _set_mode(net, self.train_mode)

    def settle(self) -> None:
        self.saved.restore_values()

    def float64_twin(self) -> tuple[Any, dict[str, Any]]:
        twin = _float64_copy(self.model)
        return twin, _same_parameters(twin, self.groups)

    def whole_batch(self) -> Any:
        self.joined = [self.get_batch(k) for k in range(self.steps)]
        return self.joined

    def whole_loss(self, twin: Any, batches: Any) -> Any:
        what = "the micro-batches joined into one batch"
        whole = to_device(join(batches, self.collate), self.device, torch.float64, what)
        return micro_loss(twin, whole, what, self.loss_fn, self.step)

    def item_counts(self) -> list[int] | None:
        counts = [item_count(b, self.loss_fn is not None) for b in self.joined or []]
        return None if None in counts else counts

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        flags = [(m, m.training) for m in self.model.modules()]
        grads = [(p, p.grad) for p in self.params.values()]
        self.saved.restore_values()
        try:
            yield
        finally:
            self.saved.restore_values()
            for module, flag in flags:
                module.training = flag
            for p, grad in grads:
                p.grad = grad

    def backward_error(self, exc: BaseException, index: int | str) -> Exception:
        return backward_error(exc, index)


def _autocast_dtype(autocast: Any) -> Any:
    if autocast is None or autocast is False:
        return None
    name = str(autocast).replace("torch.", "")
    if name not in AUTOCAST_DTYPES:
        raise AccumcheckError(f"check: autocast must be torch.bfloat16 or torch.float16, got {autocast!r}")
    return AUTOCAST_DTYPES[name]


def _scale_of(grad_scaler: Any) -> float | None:
    """The scaler's current scale, read without changing the scaler (``scale()`` would initialise
    it). A scale that is not positive and finite is refused: gradients scaled by 0 or nan are 0/0
    when unscaled, not an overflow, and nothing could be judged."""
    if grad_scaler is None or not grad_scaler.is_enabled():
        return None
    scale = float(grad_scaler.get_scale())
    if not (math.isfinite(scale) and scale > 0):
        raise AccumcheckError(f"check: the GradScaler's scale is {scale!r}, and a loss scale must be positive and "
                              "finite (a gradient scaled by it cannot be unscaled, so nothing could be judged); "
                              "pass a GradScaler whose scale has settled, or one made with a positive init_scale")
    return scale


def _groups(needs: list[Any], budget: int | None, kept: int) -> list[list[str]]:
    """The parameters' groups under ``memory_budget`` (``budget.plan``), with the copy of the model
    kept to put it back (``kept`` bytes) inside the budget."""
    if budget is None:
        return plan(needs, None)
    least = minimum(needs) + kept
    if budget < least:
        largest = max(needs, key=lambda n: n.alone)
        raise AccumcheckError(f"check: memory_budget {size_text(budget)}: tensor {largest.name} alone needs "
                              f"{size_text(largest.alone)} beside the model, the copy of the parameters and buffers "
                              f"kept to put them back {size_text(kept)}, and {size_text(FIXED_BYTES)} is kept for "
                              f"accumcheck's own code; give at least {least} ({size_text(least)})")
    return plan(needs, budget - kept, "check: memory_budget")


def _parameters(model: Any) -> list[tuple[list[str], Any]]:
    """Each trainable parameter once, under all its names (tied weights share one tensor)."""
    if not isinstance(model, torch.nn.Module):
        raise AccumcheckError(f"check: model must be a torch.nn.Module, got {type(model).__name__}")
    groups: dict[int, tuple[list[str], Any]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.requires_grad:
            groups.setdefault(id(p), ([], p))[0].append(name)
    if not groups:
        raise AccumcheckError("check: the model has no parameter that requires grad")
    return list(groups.values())


def _kinds(model: Any, params: dict[str, Any]) -> dict[str, str]:
    """Each parameter's kind: by the module that holds it (an embedding, a normalisation layer),
    else by its name and shape."""
    by_module = {}
    for module in model.modules():
        kind = "embedding" if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) else \
            "norm" if "Norm" in type(module).__name__ else None
        if kind is not None:
            by_module.update({id(p): kind for p in module.parameters(recurse=False)})
    return {name: by_module.get(id(p)) or infer_kind(name, p.dim()) for name, p in params.items()}


def _same_parameters(twin: Any, groups: list[tuple[list[str], Any]]) -> dict[str, Any]:
    named = dict(twin.named_parameters(remove_duplicate=False))
    return {names[0]: named[names[0]] for names, _ in groups}


def _check_device(params: dict[str, Any], device: str | None, where: Any) -> None:
    if where.type == "meta":
        raise AccumcheckError("check: the model's parameters are on the meta device, which holds shapes but no "
                              "values; materialise them first (model.to_empty(device=...), then load its weights)")
    others = sorted({str(p.device) for p in params.values()} - {str(where)})
    if others:
        raise AccumcheckError(f"check: the model's parameters are on {where} and {', '.join(others)}; "
                              "accumcheck checks a model on one device")
    if device is None:
        return
    try:
        wanted = torch.device("cuda" if device == "gpu" else device)
    except (RuntimeError, TypeError) as exc:
        raise AccumcheckError(f"check: device {device!r} is not a device name (cpu, cuda, cuda:1, gpu)") from exc
    if wanted.type != where.type or (wanted.index is not None and wanted.index != where.index):
        raise AccumcheckError(f"check: the model is on {where}, not {device}; move it there or pass "
                              f"device={str(where)!r}")


def _float64_copy(model: Any) -> Any:
    try:
        return copy.deepcopy(model).double()
    except Exception as exc:
        raise AccumcheckError(f"check: oracle and full_batch need a float64 copy of the model, and copy.deepcopy "
                              f"failed ({type(exc).__name__}: {exc}); run without them") from exc


def _set_mode(model: Any, train_mode: bool) -> None:
    """Eval mode, or training mode with every dropout module off."""
    model.train(train_mode)
    if train_mode:
        for module in model.modules():
            if isinstance(module, torch.nn.modules.dropout._DropoutNd):
                module.eval()


def _notes(train_mode: bool, cast: Any, scale: float | None, dtypes: dict[str, str], mode: str) -> list[str]:
    notes = ["model in training mode, dropout off" if train_mode else "model in eval mode"]
    if cast is not None:
        notes.append(f"forward under {str(cast).replace('torch.', '')} autocast")
    if scale is not None:
        notes.append(f"losses scaled by {scale:g} (GradScaler), gradients judged unscaled")
    if len(set(dtypes.values())) > 1 and mode == "native":
        counts = {d: list(dtypes.values()).count(d) for d in sorted(set(dtypes.values()))}
        notes.append("mixed parameter dtypes (" + ", ".join(f"{c} {d}" for d, c in counts.items())
                     + "), each judged by its own")
    return notes

"""Keras 3 under accumcheck: ``model.fit`` with an optimizer built with ``gradient_accumulation_steps=N``,
each optimizer step's gradient set beside its window's micro-batches as one batch, its update beside
the optimizer applied once.

    report = check(model, x, y, batch_size=8, steps=2)  # compiled with AdamW(..., gradient_accumulation_steps=4)

    with AccumulationCheck(steps=2) as check:           # around a fit of your own (tf.data, a generator)
        model.fit(dataset, callbacks=[check])

Keras runs on its PyTorch backend (``KERAS_BACKEND=torch``). Its optimizer adds each micro-batch's
gradient into a float32 accumulator and at every N-th call applies their mean: that mean is read at
the update and set beside the model's ``compute_loss`` of the window's micro-batches joined, at the
parameters the window started from, in the model's dtype, within the round-off of a float32 sum.
The update (parameters after the step minus before the window) is set beside a fresh optimizer of
the same class (``get_config()``, no accumulation, float hyperparameters rounded to the model's dtype
as Keras casts them) on float64 copies of the parameters and of the state before the window,
applied once to that gradient; where they differ, the replays with weight decay, clipping, Adam's
step count or the learning-rate schedule taken at every micro-step name the cause (keras#19990:
Keras 3.0-3.4 did the first three; fixed in 3.5). The model's and optimizer's variables, dropout
rates and the random states are put back when the fit ends (or, with ``with``, raises); a fit that
judged nothing does not pass (NothingJudgedError).
"""

from __future__ import annotations

import inspect
import os
import random
from itertools import combinations
from typing import Any

import numpy as np

from ..errors import AccumcheckError, NothingJudgedError
from ..judge.stack import Coverage, stack_report
from ..report import StackReport
from ..run.results import Hypotheses, StackWindow, StepPrecision, StepUpdate
from . import missing

try:
    import keras
    import torch
except ModuleNotFoundError as exc:
    _backend = os.environ.get("KERAS_BACKEND", "tensorflow")  # Keras's own default
    if (exc.name or "").split(".")[0] == _backend != "torch":
        raise AccumcheckError(f"{__name__}: Keras is set to run on {_backend}, which is not installed; the check runs "
                              "Keras on PyTorch: set KERAS_BACKEND=torch before keras is imported") from None
    raise missing(__name__, exc, "Keras 3 and PyTorch", "pip install 'accumcheck[keras]'") from None

WHO = "keras.AccumulationCheck"
DECAY_EACH = "weight decay applied at every micro-step"
BIAS_EACH = "Adam's bias correction counting micro-steps"
CLIP_EACH = "clipping applied to each micro-batch's gradient"
LR_EACH = "the learning-rate schedule counting micro-steps"
_DROPOUTS = (keras.layers.Dropout, keras.layers.GaussianDropout, keras.layers.AlphaDropout)


def _numpy(value: Any) -> Any:
    return None if value is None else np.array(keras.ops.convert_to_numpy(value), copy=True)


def _values(variables: list[Any]) -> list[np.ndarray]:
    return [_numpy(v) for v in variables]


def _assign(variables: list[Any], values: list[np.ndarray]) -> None:
    for v, value in zip(variables, values):
        v.assign(value)


def _counter(optimizer: Any) -> Any:
    """The optimizer's own count of ``apply`` calls (Keras 3.5 on keeps it apart from ``iterations``)."""
    raw = getattr(optimizer, "_iterations", None)
    return raw if isinstance(raw, keras.Variable) else optimizer.iterations


def _state(optimizer: Any) -> list[Any]:
    """The optimizer's slot variables: all but its counter, its learning rate and its accumulators."""
    skip = {id(_counter(optimizer)), id(getattr(optimizer, "_learning_rate", None))}
    skip |= {id(a) for a in getattr(optimizer, "_accumulated_gradients", None) or []}
    return [v for v in optimizer.variables if id(v) not in skip]


def _lr_at(optimizer: Any, step: int) -> float:
    """The learning rate Keras uses when its counter stands at ``step``."""
    lr = optimizer._learning_rate
    if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
        return float(keras.ops.convert_to_numpy(lr(step)))
    if callable(lr) and not isinstance(lr, keras.Variable):
        return float(keras.ops.convert_to_numpy(lr()))
    return float(keras.ops.convert_to_numpy(lr))


class _Window:
    """What the check holds of the window being run: its micro-batches, the parameters and optimizer
    state it started from, the gradients handed to the optimizer, the parameters that moved."""

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.start = _values(model.trainable_variables)
        self.state = {id(v): _numpy(v) for v in optimizer.variables}
        self.count = int(keras.ops.convert_to_numpy(_counter(optimizer)))
        self.batches: list[tuple[int, Any]] = []  # (the run's index, (x, y, sample_weight)) as fed
        self.grads, self.moved = [], set()  # the gradients handed to apply(); the parameters that moved


class AccumulationCheck(keras.callbacks.Callback):
    """The check of a Keras fit as a callback. ``steps`` stops the fit after that many optimizer
    steps. ``report`` is the StackReport once the fit has ended; it raises NothingJudgedError for a
    fit in which nothing was judged. Used as a context manager, it also puts the model back when
    the fit raises."""

    def __init__(self, steps: int | None = None) -> None:
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise AccumcheckError(f"{WHO}: steps must be a positive integer, got {steps!r}")
        super().__init__()
        self.steps, self.windows = steps, []
        self.reproduce = f"accumcheck.integrations.keras.AccumulationCheck(steps={steps}) among the fit's callbacks"
        self._running, self._ended, self._report = False, None, None

    def __enter__(self) -> "AccumulationCheck":
        return self

    def __exit__(self, *exc: object) -> None:  # a fit that raised ran no on_train_end
        self._finish()

    @property
    def report(self) -> StackReport:
        """The fit's StackReport, judged when first read; NothingJudgedError where nothing was judged."""
        if self._report is None:
            if self._ended is None:
                raise NothingJudgedError(f"{WHO}: no report yet; pass the check to model.fit(..., callbacks=[check]) "
                                         "and read .report after the fit")
            self._report = self._build_report()
        return self._report

    # ------------------------------------------------------------------ the fit's hooks

    def on_train_begin(self, logs: Any = None) -> None:
        model = self.model
        optimizer = getattr(model, "optimizer", None)
        if keras.backend.backend() != "torch":
            raise AccumcheckError(f"{WHO}: Keras runs on its {keras.backend.backend()} backend here; the check runs "
                                  "Keras on PyTorch: set KERAS_BACKEND=torch before keras is imported")
        n = getattr(optimizer, "gradient_accumulation_steps", None)
        if not n or getattr(optimizer, "_accumulated_gradients", None) is None:
            raise AccumcheckError(f"{WHO}: the model's optimizer ({type(optimizer).__name__}) does not accumulate "
                                  "gradients; compile the model with an optimizer built with "
                                  "gradient_accumulation_steps=N (N >= 2), e.g. keras.optimizers.AdamW(..., "
                                  "gradient_accumulation_steps=4)")
        self.optimizer, self.accum_steps = optimizer, int(n)
        self.windows, self._seen, self._window, self._report, self._ended = [], 0, None, None, None
        self._buffer_equal: list[bool] = []
        self._counts = (int(keras.ops.convert_to_numpy(optimizer.iterations)), 0)
        self._saved = (_values(model.variables), _values(optimizer.variables), random.getstate(),
                       np.random.get_state(), torch.get_rng_state(), _keras_seed(), model.stop_training)
        count = int(keras.ops.convert_to_numpy(_counter(optimizer)))
        self._carried = count % self.accum_steps  # micro-batches an earlier fit left in the accumulator
        if self._carried:  # the check's windows start empty (the optimizer is put back after)
            _assign(optimizer._accumulated_gradients + [_counter(optimizer)],
                    [np.zeros(a.shape, a.dtype) for a in optimizer._accumulated_gradients] + [count - self._carried])
        layers = list(model._flatten_layers(include_self=False))
        self._dropouts = [(layer, layer.rate) for layer in layers if isinstance(layer, _DROPOUTS)]
        self._dropouts += [(layer, layer.stddev) for layer in layers if isinstance(layer, keras.layers.GaussianNoise)]
        for layer, _ in self._dropouts:
            setattr(layer, "rate" if hasattr(layer, "rate") else "stddev", 0.0)
        self._batch_level = [layer.path if hasattr(layer, "path") else layer.name for layer in layers
                             if isinstance(layer, keras.layers.BatchNormalization)]
        train_step, apply = model.train_step, optimizer.apply
        object.__setattr__(model, "train_step", lambda data: self._micro_batch(train_step, data))
        object.__setattr__(optimizer, "apply", lambda grads, variables=None: self._apply(apply, grads, variables))
        self._running = True

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.steps is not None and len(self.windows) >= self.steps:
            self.model.stop_training = True  # the fit ends after this batch

    def on_train_end(self, logs: Any = None) -> None:
        self._finish()

    def _finish(self) -> None:
        if not self._running:
            return
        self._running = False
        model, optimizer = self.model, self.optimizer
        model.__dict__.pop("train_step", None)
        optimizer.__dict__.pop("apply", None)
        self._counts = (self._counts[0], int(keras.ops.convert_to_numpy(optimizer.iterations)))
        variables, states, python, numpy_state, torch_state, seed, stop = self._saved
        _assign(model.variables + optimizer.variables, variables + states)
        for layer, value in self._dropouts:
            setattr(layer, "rate" if hasattr(layer, "rate") else "stddev", value)
        random.setstate(python)
        np.random.set_state(numpy_state)
        torch.set_rng_state(torch_state)
        _keras_seed(seed)
        model.stop_training = stop
        self._ended = (len(self._dropouts),)

    # ------------------------------------------------------------------ a micro-batch and an update

    def _micro_batch(self, train_step: Any, data: Any) -> Any:
        """A micro-batch enters: the first of a window takes the window's start; the others see
        whether the parameters moved since it."""
        model = self.model
        if self._window is None:
            self._window = _Window(model, self.optimizer)
        else:
            for v, start in zip(model.trainable_variables, self._window.start):
                if v.path not in self._window.moved and not np.array_equal(_numpy(v), start):
                    self._window.moved.add(v.path)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self._window.batches.append((self._seen, tuple(keras.tree.map_structure(_numpy, part) if part is not None
                                                       else None for part in (x, y, sample_weight))))
        self._seen += 1
        return train_step(data)

    def _apply(self, apply: Any, grads: Any, variables: Any) -> Any:
        """The optimizer's ``apply`` of one micro-batch's gradient: recorded, run, and where it was the
        window's update, judged."""
        optimizer = self.optimizer
        variables = list(variables) if variables is not None else list(optimizer._trainable_variables)
        handed = [_numpy(g) for g in grads]
        accumulators = [_numpy(a) for a in optimizer._accumulated_gradients]
        result = apply(grads, variables)
        window = self._window
        if window is None:  # an apply outside the fit's train_step: not a micro-batch the check saw
            return result
        window.grads.append(handed)
        held = any(a.any() for a in accumulators) or any(g is not None and g.any() for g in handed)
        if held and not any(_numpy(a).any() for a in optimizer._accumulated_gradients):  # reset: the update ran
            self._window = None
            self._judge(window, variables, accumulators)
        return result

    def _judge(self, window: _Window, variables: list[Any], accumulators: list[Any]) -> None:
        """The window's StackWindow: the gradient the update applied against the window as one batch,
        and the update against the optimizer applied once."""
        model, optimizer, n = self.model, self.optimizer, self.accum_steps
        trainable = list(model.trainable_variables)
        names = [v.path for v in trainable]
        scale = optimizer.loss_scale_factor  # Keras divides the handed gradients by it before accumulating
        handed = [{name: None for name in names} for _ in window.grads]
        for found, gs in zip(handed, window.grads):
            found.update({v.path: g / np.float32(scale) if scale else g for v, g in zip(variables, gs)})
        # what Keras applies at its update: (the last gradient + the accumulator) / N, in the accumulator's
        # dtype; beside it the same gradients added into a float32 buffer of the check's own
        applied32, buffer32 = {}, {}
        for v in trainable:
            acc = accumulators[optimizer._get_variable_index(v)]
            last, total = handed[-1][v.path], np.zeros(acc.shape, np.float32)
            applied32[v.path] = (acc if last is None else last.astype(acc.dtype) + acc) / acc.dtype.type(n)
            for g in (found[v.path] for found in handed):
                total = total if g is None else total + g.astype(np.float32)
            buffer32[v.path] = total / np.float32(n)
        self._buffer_equal.append(all(np.array_equal(applied32[k], buffer32[k]) for k in names))
        applied = {k: a.astype(np.float64) for k, a in applied32.items()}
        after, everything = _values(trainable), _values(model.variables)
        batches = [b for _, b in window.batches]
        try:  # at the parameters the window started from: the window as one batch, and each micro-batch
            _assign(trainable, window.start)
            reference = self._window_gradient(batches, trainable)
            each = [self._window_gradient([b], trainable) for b in batches]
        finally:
            _assign(model.variables, everything)
        counts = [len(keras.tree.flatten(b[0])[0]) for b in batches]  # samples: the first input's length
        total = sum(counts) or len(counts)
        absum = {k: sum(c / total * np.abs(g[k]) for c, g in zip(counts, each)) for k in names}
        dtype = keras.backend.standardize_dtype(trainable[0].dtype) if trainable else "float32"
        micro = [{k: np.zeros(v.shape) if g[k] is None else g[k].astype(np.float64) for k, v in zip(names, trainable)}
                 for g in handed]
        hypotheses = Hypotheses(micro_sum={k: sum(g[k] for g in each) for k in names}, micro_batches=each,
                                by_design=list(self._batch_level))
        accumulation = str(next(iter(applied32.values())).dtype) if applied32 else "float32"
        self.windows.append(StackWindow(
            step=len(self.windows), micro_batches=[i for i, _ in window.batches], applied=applied, window=reference,
            item_counts=counts, hypotheses=hypotheses, absum=absum,
            precision=StepPrecision(accumulation=accumulation, reduction="float32", computed=dtype, reference=dtype),
            update=self._update(window, trainable, after, applied, micro, dtype)))

    def _window_gradient(self, batches: list[tuple[Any, Any, Any]], trainable: list[Any]) -> dict[str, np.ndarray]:
        """The gradient of the model's own ``compute_loss`` on the window's micro-batches joined, at
        the parameters it holds now, in its dtype."""
        model = self.model
        joined = [None if parts[0] is None else keras.tree.map_structure(lambda *xs: np.concatenate(xs), *parts)
                  for parts in zip(*batches)]
        x, y, sample_weight = joined
        kept = [v.value.grad for v in trainable]
        for v in trainable:
            v.value.grad = None
        try:
            with torch.enable_grad():
                y_pred = model(x, training=True)
                kwargs = dict(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
                if "training" in inspect.signature(model.compute_loss).parameters:
                    kwargs["training"] = True
                model.compute_loss(**kwargs).backward()
            return {v.path: np.zeros(v.shape) if v.value.grad is None else
                    np.asarray(keras.ops.convert_to_numpy(v.value.grad), dtype=np.float64) for v in trainable}
        finally:
            for v, g in zip(trainable, kept):
                v.value.grad = g

    # ------------------------------------------------------------------ the update, replayed

    def _update(self, window: _Window, trainable: list[Any], after: list[np.ndarray], applied: dict[str, np.ndarray],
                each: list[dict[str, np.ndarray]], dtype: str) -> StepUpdate:
        """The step's update against a float64 replay of the optimizer applied once, and the replays
        with each cause Keras 3.0-3.4 had (keras#19990) taken at every micro-step."""
        optimizer, n = self.optimizer, self.accum_steps
        start = window.start
        update = StepUpdate(optimizer_steps=1, moved=sorted(window.moved), dtype=dtype)
        update.applied = {v.path: a.astype(np.float64) - s.astype(np.float64) for v, a, s in zip(trainable, after, start)}
        done = window.count // n  # optimizer steps before this window
        scheduled = not isinstance(optimizer._learning_rate, keras.Variable)
        update.lr = lr = _lr_at(optimizer, done)
        clips = bool(optimizer.clipnorm or optimizer.global_clipnorm or optimizer.clipvalue)
        causes = [c for c, applies in ((DECAY_EACH, bool(optimizer.weight_decay)), (BIAS_EACH, _bias_corrected(optimizer)),
                                       (CLIP_EACH, clips), (LR_EACH, scheduled)) if applies]
        try:
            expected = self._replay(window, trainable, applied, each, done, set())
            for k in range(1, len(causes) + 1):
                for chosen in combinations(causes, k):
                    update.hypotheses[" and ".join(chosen)] = self._replay(window, trainable, applied, each, done,
                                                                           set(chosen))
        except (RuntimeError, TypeError, ValueError, KeyError, AttributeError) as exc:
            update.replay_note = (f"the {type(optimizer).__name__} could not be replayed in float64 "
                                  f"({str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__})")
            update.hypotheses = {}
            return update
        kappa, update.expected = _conditioning(optimizer, done + 1), expected
        update.scale = {v.path: np.abs(s.astype(np.float64)) + (1 + kappa) * (np.abs(expected[v.path]) + abs(lr))
                        for v, s in zip(trainable, start)}
        return update

    def _replay(self, window: _Window, trainable: list[Any], applied: dict[str, np.ndarray],
                each: list[dict[str, np.ndarray]], done: int, causes: set[str]) -> dict[str, np.ndarray]:
        """A fresh optimizer of the same class, no accumulation, on float64 copies of the window's
        starting parameters and state, applied once to ``applied``; with ``causes``, what Keras 3.0-3.4
        did at every micro-step done the same way."""
        optimizer, n, dtype = self.optimizer, self.accum_steps, np.dtype(trainable[0].dtype)
        count = window.count + n - 1 if BIAS_EACH in causes else done
        lr_step = (lambda i: window.count + i) if LR_EACH in causes else (lambda i: done)
        config = {key: float(np.asarray(value, dtype)) if isinstance(value, float) else value
                  for key, value in optimizer.get_config().items()}
        config.update(gradient_accumulation_steps=None, loss_scale_factor=None,
                      learning_rate=_lr_at(optimizer, lr_step(n - 1)))
        gradient = dict(applied)
        if CLIP_EACH in causes:
            config.update(clipnorm=None, clipvalue=None, global_clipnorm=None)
            clipped = [optimizer._clip_gradients([keras.ops.convert_to_tensor(g[v.path], "float64") for v in trainable])
                       for g in each]
            gradient = {v.path: sum(_numpy(c[i]) for c in clipped) / n for i, v in enumerate(trainable)}
        fresh = type(optimizer).from_config(config)
        twins = []
        for i, (v, s) in enumerate(zip(trainable, window.start)):
            value = s.astype(np.float64)
            if DECAY_EACH in causes and optimizer._use_weight_decay(v):
                for step in range(n - 1):
                    value = value * (1.0 - float(np.asarray(optimizer.weight_decay, dtype)) * _lr_at(optimizer,
                                                                                                    lr_step(step)))
            twins.append(keras.Variable(value, dtype="float64", name=f"twin_{i}"))
        excluded = [t for v, t in zip(trainable, twins) if optimizer.weight_decay and not optimizer._use_weight_decay(v)]
        if excluded:
            fresh.exclude_from_weight_decay(var_list=excluded)
        fresh.build(twins)
        theirs, ours = _state(optimizer), _state(fresh)
        if len(theirs) != len(ours) or any(tuple(a.shape) != tuple(b.shape) for a, b in zip(theirs, ours)):
            raise ValueError("its state does not match a fresh optimizer's of the same config")
        for real, twin in zip(theirs, ours):
            twin.assign(window.state[id(real)].astype(keras.backend.standardize_dtype(twin.dtype)))
        _counter(fresh).assign(count)
        with torch.no_grad():
            fresh.apply([keras.ops.convert_to_tensor(gradient[v.path], "float64") for v in trainable], twins)
        return {v.path: _numpy(t) - s.astype(np.float64) for v, t, s in zip(trainable, twins, window.start)}

    # ------------------------------------------------------------------ the report

    def _build_report(self) -> StackReport:
        optimizer, n = self.optimizer, self.accum_steps
        (dropouts,) = self._ended
        before, after = self._counts
        config = optimizer.get_config()
        settings = ", ".join(f"{key}={config[key]}" for key in ("weight_decay", "clipnorm", "global_clipnorm",
                                                                "clipvalue") if config.get(key))
        notes = [f"Keras's own fit: {type(optimizer).__name__}(gradient_accumulation_steps={n}"
                 f"{', ' + settings if settings else ''}); the gradient is read from the optimizer's accumulator at "
                 "its update, before clipping and weight decay; the model's compute_loss on the window's micro-batches "
                 "joined, at the parameters the window started from, for the reference",
                 f"the update set beside a fresh {type(optimizer).__name__} from the optimizer's config (no "
                 "accumulation) on float64 copies of the parameters and of the optimizer's state before the window, "
                 "applied once to that gradient",
                 f"optimizer.iterations went from {before} to {after} over {len(self.windows)} optimizer step"
                 f"{'s' * (len(self.windows) != 1)}",
                 f"dropout off ({dropouts} rates set to 0); the model's and optimizer's variables and Python's, NumPy's, "
                 "torch's and Keras's random states were put back after the fit"]
        same, updates = sum(self._buffer_equal), len(self._buffer_equal)
        notes += [f"the optimizer's accumulator held {self._carried} micro-batches' gradients from before the fit; the "
                  "check's windows started from an empty one"] * bool(self._carried)
        notes += [f"the optimizer's accumulator held, at {same} of {updates} updates, the float32 sum of the micro-"
                  "batches' gradients it was handed, bit for bit" + " (not at the others)" * (same < updates)] * bool(updates)
        coverage = Coverage(who=WHO, feed="the fit's train_step", fix="train with model.fit(..., callbacks=[check])",
                            idle="the fit", idle_fix="give the fit at least one batch (epochs, steps_per_epoch, data)")
        return stack_report("keras", type(self.model).__name__, n, self.windows, self._seen,
                            {"keras": keras.__version__, "torch": torch.__version__}, notes,
                            reproduce=self.reproduce, precision="float32", coverage=coverage, reference_dtype="float32")


def _bias_corrected(optimizer: Any) -> bool:  # Adam, AdamW, Adamax, Nadam: the step count enters the update
    return all(hasattr(optimizer, b) for b in ("beta_1", "beta_2")) and not isinstance(optimizer, keras.optimizers.Lion)


def _conditioning(optimizer: Any, t: int) -> float:
    """How much Adam's bias corrections 1 - beta^t, which Keras computes in the model's dtype, magnify
    that dtype's round-off (cancellation): beta^t / (1 - beta^t) for each beta; 0 for other optimizers."""
    betas = (float(optimizer.beta_1), float(optimizer.beta_2)) if _bias_corrected(optimizer) else ()
    return sum(b ** t / (1 - b ** t) for b in betas if b < 1)


def _keras_seed(saved: Any = False) -> Any:
    """Keras's global seed generator and its state (None where it has none yet); with ``saved``, put them back."""
    from keras.src.backend.common import global_state

    if saved is False:
        found = global_state.get_global_attribute("global_seed_generator")
        return None if found is None else (found, _numpy(found.state))
    if saved is None:
        global_state.set_global_attribute("global_seed_generator", None)
    else:
        saved[0].state.assign(saved[1])


def check(model: Any, x: Any = None, y: Any = None, *, batch_size: int | None = None, sample_weight: Any = None,
          steps: int | None = None, epochs: int = 1, **fit_kwargs: Any) -> StackReport:
    """Fit the compiled ``model`` on ``x``, ``y`` (as ``model.fit`` takes them) for ``steps``
    optimizer steps (default: all ``epochs``), each judged; the model, its optimizer and the random
    states are put back after. Returns the StackReport; raises NothingJudgedError where the fit ran
    no micro-batch, AccumcheckError where the model's optimizer does not accumulate."""
    if not isinstance(model, keras.Model):
        raise AccumcheckError(f"keras.check: expected a compiled keras.Model, got {type(model).__name__}")
    if getattr(model, "optimizer", None) is None:
        raise AccumcheckError("keras.check: the model is not compiled; call model.compile(optimizer=..., loss=...) "
                              "with an optimizer built with gradient_accumulation_steps=N first")
    monitor = AccumulationCheck(steps)
    monitor.reproduce = f"accumcheck.integrations.keras.check(model, x, y, batch_size={batch_size}, steps={steps})"
    fit_kwargs.setdefault("verbose", 0)
    callbacks = list(fit_kwargs.pop("callbacks", None) or []) + [monitor]
    with monitor:
        model.fit(x, y, batch_size=batch_size, sample_weight=sample_weight, epochs=epochs, callbacks=callbacks,
                  **fit_kwargs)
    return monitor.report

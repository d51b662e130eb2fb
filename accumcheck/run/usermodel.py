"""What ``accumcheck.torch.check`` and ``accumcheck.mxnet.check`` share: reading the user's
batches, the number of micro-steps, and how a batch meets the model and the loss.

A batch is whatever the user's loop hands its model. With a ``loss_fn`` it is ``(inputs,
target)``, or ``(inputs,)``, ``(inputs, None)`` or bare inputs for a loss that needs no target
(then ``loss_fn(output)``). Without one it is the model's inputs and the model computes its own
loss (a Hugging Face style ``output.loss``). Inputs meet the model as the user's code passes them:
a mapping as ``model(**inputs)``, a tuple or list as ``model(*inputs)``, anything else as
``model(inputs)``. With ``step=``, ``step(model, batch)`` does all of it and returns the loss.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Mapping
from itertools import islice
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import USER_EXCEPTIONS, AccumcheckError, UserCodeError, first_line

Batch = Any
MAX_UNCOUNTED_BATCHES = 4096  # an iterable read to its end without accum_steps: at most this many


def batch_source(batches: Any, accum_steps: int | None) -> tuple[Callable[[int], Batch], int]:
    """A function of the micro-step index giving its ``(inputs, target)``, and the number of
    micro-steps. ``batches`` is a sequence, an iterable (read once: both passes need every batch;
    only the first ``accum_steps`` are taken, so an endless one such as ``itertools.cycle`` is
    fine) or a function of the index (then ``accum_steps`` is required). What the user's batches
    raise (an iterable failing midway, a function or ``__getitem__`` raising) is a UserCodeError
    naming the micro-batch."""
    if callable(batches):
        count = None
        read = batches
    else:
        if not isinstance(batches, Sequence):
            _positive(accum_steps)
            batches = _read(batches, accum_steps if accum_steps is not None else MAX_UNCOUNTED_BATCHES + 1)
            if accum_steps is None and len(batches) > MAX_UNCOUNTED_BATCHES:
                raise AccumcheckError(f"check: batches is an iterable of more than {MAX_UNCOUNTED_BATCHES} batches "
                                      "(perhaps endless); pass accum_steps to say how many to take")
        try:
            count = len(batches)
        except USER_EXCEPTIONS as exc:
            raise UserCodeError(f"check: len(batches) raised {type(exc).__name__}: {first_line(exc)}; "
                                "give a sequence, an iterable or a function of the micro-step index") from exc
        if not count:
            raise AccumcheckError("check: batches is empty; give (inputs, target) pairs")
        read = batches.__getitem__
    steps = accum_steps if accum_steps is not None else count
    if steps is None:
        raise AccumcheckError("check: batches is a function; pass accum_steps as well")
    _positive(steps)
    if count is not None and steps > count:
        raise AccumcheckError(f"check: accum_steps={steps} but only {count} batches were given")

    def get(index: int) -> Batch:
        try:
            return read(index)
        except AccumcheckError:
            raise
        except USER_EXCEPTIONS as exc:
            raise UserCodeError(f"check: batches raised {type(exc).__name__} on micro-batch {index}: "
                                f"{first_line(exc)}; check that batches gives a batch for every micro-step "
                                f"0..{steps - 1}") from exc

    return get, steps


def _read(iterable: Any, limit: int) -> list[Batch]:
    """Up to ``limit`` items of the user's iterable; what iterating it raises is a UserCodeError
    naming the micro-batch it was reading."""
    items: list[Batch] = []
    try:
        for item in islice(iterable, limit):
            items.append(item)
    except USER_EXCEPTIONS as exc:
        raise UserCodeError(f"check: iterating batches raised {type(exc).__name__} while reading micro-batch "
                            f"{len(items)}: {first_line(exc)}; fix the generator or data loader, or pass a list "
                            "of batches") from exc
    return items


@contextlib.contextmanager
def host_random_states() -> Iterator[None]:
    """Python's and NumPy's global random states as they were, after the block, also when it
    raises: the user's loss, batches or step may draw from them (a framework's own generator is
    its adapter's to put back)."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def _positive(steps: Any) -> None:
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
        raise AccumcheckError(f"check: accum_steps must be a positive integer, got {steps!r}")


NO_TARGET = object()  # a batch without a target: the loss is ``loss_fn(output)``


def split_batch(batch: Any, loss_fn_given: bool) -> tuple[Any, Any]:
    """``(inputs, target)`` of one micro-batch; the target is NO_TARGET where there is none."""
    if not loss_fn_given:
        return batch, NO_TARGET
    if isinstance(batch, (tuple, list)):
        if len(batch) == 2:
            return batch[0], NO_TARGET if batch[1] is None else batch[1]
        if len(batch) == 1:
            return batch[0], NO_TARGET
        raise AccumcheckError(f"check: with loss_fn a batch is (inputs, target) or (inputs,), got a "
                              f"{type(batch).__name__} of {len(batch)} items; pass step=lambda model, batch: loss "
                              "to say how your batches are used")
    return batch, NO_TARGET


def map_leaves(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` with ``leaf`` applied to everything in it that is not a tuple, list or mapping
    (named tuples keep their type, mappings become dicts with the same keys)."""
    if isinstance(value, Mapping):
        return {key: map_leaves(item, leaf) for key, item in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(map_leaves(item, leaf) for item in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_leaves(item, leaf) for item in value)
    return leaf(value)


def call_model(model: Any, inputs: Any) -> Any:
    """The model applied to ``inputs`` as a training loop passes them."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def apply_loss(loss_fn: Callable[..., Any], output: Any, target: Any) -> Any:
    return loss_fn(output) if target is NO_TARGET else loss_fn(output, target)


def own_loss(output: Any, is_scalar: Callable[[Any], bool]) -> Any:
    """The loss a model computed itself: ``output.loss`` (Hugging Face ``ModelOutput``, also as
    ``output["loss"]``), a scalar output, or the scalar first element of a tuple
    (``return_dict=False``). Raises AccumcheckError naming what the model returned otherwise."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None and is_scalar(output):
        loss = output
    if loss is None and isinstance(output, (tuple, list)) and output and is_scalar(output[0]):
        loss = output[0]
    if loss is None:
        raise AccumcheckError(f"check: the model returned a {type(output).__name__} with no loss (no .loss, not a "
                              "scalar); pass loss_fn=, or step=lambda model, batch: loss")
    return loss


CALLS = "a dict is passed as model(**batch), a tuple as model(*inputs)"  # how call_model meets a model


def model_error(exc: BaseException, index: int | str, what: str, calls: str = CALLS) -> UserCodeError:
    """The one-line error for an exception raised by the user's model, loss or step function on
    micro-batch ``index`` (or on the batch a string names); ``calls`` says how batches meet the
    model in this framework. Raise it ``from exc``."""
    where = f"micro-batch {index}" if isinstance(index, int) else index
    return UserCodeError(f"check: {what} raised {type(exc).__name__} on {where}: {first_line(exc)}; "
                         f"check that the batches fit the model ({calls}), or pass step=lambda model, batch: loss")


def join_batches(batches: list[Any], collate: Callable[[list[Any]], Any] | None, arrays: tuple[type, ...],
                 concat: Callable[[list[Any]], Any], array_word: str) -> Any:
    """N micro-batches as one batch (the full-batch check): ``collate(batches)``, or the arrays in
    them (instances of ``arrays``, ``array_word`` in messages) joined by ``concat`` along the batch
    axis, through tuples, lists and mappings; a value that is the same in every micro-batch stays."""
    if collate is not None:
        try:
            return collate(batches)
        except USER_EXCEPTIONS as exc:
            raise UserCodeError(f"full_batch: collate raised {type(exc).__name__}: {first_line(exc)}") from exc
    return _concatenate(batches, "batch", arrays, concat, array_word)


def _concatenate(parts: list[Any], where: str, arrays: tuple[type, ...], concat: Callable[[list[Any]], Any],
                 array_word: str) -> Any:
    first = parts[0]
    if isinstance(first, arrays):
        if not all(isinstance(p, arrays) for p in parts):
            raise _cannot(where, f"is a {array_word} in some micro-batches only")
        if len(first.shape) == 0 or any(tuple(p.shape[1:]) != tuple(first.shape[1:]) for p in parts):
            shapes = sorted({tuple(p.shape) for p in parts})
            raise _cannot(where, f"has shapes {shapes[0]} and {shapes[-1]}, which do not join along the batch axis "
                                 "(pad every micro-batch to one length)")
        return concat(parts)

    def inner(items: list[Any], at: str) -> Any:
        return _concatenate(items, at, arrays, concat, array_word)

    if isinstance(first, Mapping):
        if any(not isinstance(p, Mapping) or set(p) != set(first) for p in parts):
            raise _cannot(where, "has different keys in different micro-batches")
        return {k: inner([p[k] for p in parts], f"{where}[{k!r}]") for k in first}
    if isinstance(first, (tuple, list)):
        if any(not isinstance(p, (tuple, list)) or len(p) != len(first) for p in parts):
            raise _cannot(where, "has different lengths in different micro-batches")
        items = [inner([p[i] for p in parts], f"{where}[{i}]") for i in range(len(first))]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    if all(p is None for p in parts):
        return None
    if all(type(p) is type(first) and p == first for p in parts):
        return first  # the same setting in every micro-batch
    raise _cannot(where, f"is a {type(first).__name__} that differs between micro-batches")


def _cannot(where: str, why: str) -> AccumcheckError:
    return AccumcheckError(f"full_batch: cannot join the micro-batches into one: {where} {why}; "
                           "pass collate=lambda batches: one_batch")

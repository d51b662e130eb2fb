"""What a Gluon ``Trainer.step`` does with the gradient, for the Gluon stack check: how many steps
a window took (a window is what the gradient holds, from where every gradient was zero), whether
the parameters moved between its micro-batches, and its update against the Trainer's optimizer
applied once, from its states before the window, to the gradient the step was handed.

The optimizer and its states are taken at the window's start the way MXNet saves them itself
(``Updater.get_states(dump_optimizer=True)``: a pickle of the states and of the optimizer without
its parameter dictionary), and the replay runs a fresh updater of that copy on a float64 copy of
each parameter. A Trainer that updates on its kvstore keeps its states there: counted and
compared, not replayed (the report says so).
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from ..run.results import StepUpdate
from .library import mx


class GluonStepWatch:
    """``micro_batch()`` as each micro-batch is recorded, ``handed(batch_size)`` just before
    ``trainer.step`` runs, ``stepped()`` just after it: the step's ``StepUpdate``."""

    def __init__(self, trainer: Any, params: list[Any]) -> None:
        self.trainer, self.params = trainer, params  # the trained parameters, in the Trainer's order
        self._index = {id(p): i for i, p in enumerate(trainer._params)}
        self._start: tuple[dict[str, np.ndarray], bytes | None] | None = None
        self._moved: set[str] = set()
        self._steps = 0  # steps since every gradient was last zero
        self._held = 0  # micro-batches since then
        self._grads: dict[str, Any] | None = None
        self._rescale = 1.0

    def micro_batch(self) -> None:
        if all(not g.asnumpy().any() for p in self.params for g in p.list_grad()):
            self._steps, self._held = 0, 0
        self._held += 1
        if self._start is None:
            values = {p.name: p.data(p.list_ctx()[0]).asnumpy().astype(np.float64) for p in self.params}
            blob = None if self.trainer._update_on_kvstore or not self.trainer._updaters else \
                self.trainer._updaters[0].get_states(dump_optimizer=True)
            self._start = (values, blob)
            return
        for p in self.params:
            if p.name not in self._moved and not np.array_equal(p.data(p.list_ctx()[0]).asnumpy(),
                                                                self._start[0][p.name]):
                self._moved.add(p.name)

    def handed(self, batch_size: int) -> None:
        """The gradient the step is handed (every context's summed, as the kvstore sums them)."""
        self._grads = {p.name: sum(g.copyto(p.list_ctx()[0]) for g in p.list_grad()) for p in self.params}
        self._rescale = self.trainer._scale / batch_size

    def stepped(self) -> StepUpdate:
        self._steps += 1
        update = StepUpdate(optimizer_steps=self._steps, moved=sorted(self._moved),
                            lr=float(self.trainer.learning_rate), gradient_micro_batches=self._held)
        start, grads = self._start, self._grads
        if start is None or grads is None:
            update.replay_note = "no micro-batch was recorded before this step"
        elif start[1] is None:
            update.replay_note = "the Trainer updates on its kvstore, which keeps the optimizer's states: not replayed"
        else:
            values, blob = start
            update.applied = {p.name: p.data(p.list_ctx()[0]).asnumpy().astype(np.float64) - values[p.name]
                              for p in self.params}
            update.expected = self._replayed(values, blob, grads)
            update.scale = {name: np.abs(values[name]) + np.abs(want) + float(self.trainer.learning_rate)
                            for name, want in update.expected.items()}
            update.dtype = str(np.dtype(self.params[0].dtype)) if self.params else "float64"
        self._start, self._moved, self._grads = None, set(), None
        return update

    def _replayed(self, values: dict[str, np.ndarray], blob: bytes, grads: dict[str, Any]) -> dict[str, np.ndarray]:
        states, optimizer = pickle.loads(blob)
        optimizer.param_dict = self.trainer._optimizer.param_dict  # lr_mult and wd_mult, not pickled
        optimizer.rescale_grad = self._rescale
        updater = mx.optimizer.get_updater(optimizer)
        updater.states, updater.states_synced = states, dict.fromkeys(states, False)
        found = {}
        for p in self.params:
            ctx = p.list_ctx()[0]
            weight = mx.nd.array(values[p.name], ctx=ctx, dtype="float64")
            updater(self._index[id(p)], grads[p.name].astype("float64"), weight)
            found[p.name] = weight.asnumpy() - values[p.name]
        return found

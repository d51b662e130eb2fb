"""A Gluon net and its Trainer in float64 for a check, and put back as found: the parameters on
every context (the very arrays), the optimizer's attributes, update counts, learning-rate schedule
and states, and the Trainer's kvstore, which the float64 run replaces by one of its own."""

from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np

from ..errors import AccumcheckError
from .blockstate import AuxState, clear_cached_ops, layers_for_check, unique_params
from .library import mx

DTYPE = "float64"


class Float64Run:
    """The net and the Trainer in float64 between ``enter`` and ``exit``, and put back as found."""

    def __init__(self, net: Any, trainer: Any) -> None:
        params, _ = unique_params(net)
        deferred = [name for name, p in params.items() if p._data is None]
        if deferred:
            raise AccumcheckError(f"AccumulationCheck: parameter {deferred[0]!r} is not initialised yet (deferred "
                                  "initialisation); call net.initialize() and run one forward pass before the check")
        contexts = [str(c) for c in trainer._contexts]
        for name, p in params.items():
            if sorted(str(c) for c in p.list_ctx()) != sorted(contexts):
                raise AccumcheckError(f"AccumulationCheck: parameter {name!r} lives on {', '.join(map(str, p.list_ctx()))} "
                                      f"but the trainer on {', '.join(contexts)}; initialise the net on the trainer's "
                                      "contexts")
        kind = _kvstore_kind(trainer)
        if kind is not None and "dist" in kind:
            raise AccumcheckError(f"AccumulationCheck: a distributed KVStore ({kind!r}) cannot be set aside for the "
                                  "check; check the loop in one process with kvstore='local' on several contexts "
                                  "(mx.cpu(0), mx.cpu(1), ...), which sums the gradients the same way")
        if trainer._contains_sparse_weight or trainer._contains_sparse_grad:
            raise AccumcheckError("AccumulationCheck: the trainer holds row_sparse weights or gradients; the check "
                                  "supports dense ones")
        ours = {id(p) for p in params.values()}
        strangers = [p.name for p in trainer._params if id(p) not in ours]
        if strangers:
            raise AccumcheckError(f"AccumulationCheck: the trainer updates {strangers[0]!r}, which is not a parameter "
                                  "of net; pass the net whose parameters the trainer holds")
        self.net, self.trainer, self.params = net, trainer, list(params.values())
        self.contexts = list(trainer._contexts)
        self.ctx = self.contexts[0]  # where recorded micro-batches and the reference pass run
        self.kvstore = kind
        self.trained = [p for p in trainer._params if p.grad_req != "null"]
        self.with_grad = [p for p in self.params if p.grad_req != "null"]

    def layout(self) -> str | None:
        """The report's note on the contexts and the kvstore; None for one context and no kvstore."""
        if len(self.contexts) == 1 and self.kvstore is None:
            return None
        names = [str(c) for c in self.contexts]
        return (f"{len(names)} context{'s' * (len(names) != 1)} ({', '.join(names)})"
                + (f", kvstore {self.kvstore!r}" if self.kvstore else "") + ": the applied gradient is every "
                f"context's gradient summed, as the kvstore sums them; the reference runs the window on {names[0]}")

    def enter(self) -> None:
        self.random_states = random.getstate(), np.random.get_state()  # the loop's draws are undone on exit
        self.saved = [(p, p._data, p._grad, p._dtype) for p in self.params]
        self.optimizer = OptimizerState(self.trainer, self.params)
        self.layers = layers_for_check(self.net, train_mode=False)
        self.layers.__enter__()
        try:
            self.net.cast(DTYPE)
            for p in self.params:  # a Parameter outside the net's children is cast too (shared ones)
                if np.dtype(p.dtype) != np.float64:
                    p.cast(DTYPE)
            self.optimizer.widen()
            self.optimizer.fresh_kvstore()
        except BaseException:
            self.exit()
            raise

    def exit(self) -> None:
        try:
            for p, data, grad, dtype in self.saved:
                p._data, p._grad, p._dtype = data, grad, dtype
                if grad is not None:
                    mx.autograd.mark_variables(data, grad, p.grad_req)
            self.optimizer.restore()
        finally:
            self.layers.__exit__(None, None, None)
            clear_cached_ops(self.net)
            random.setstate(self.random_states[0])
            np.random.set_state(self.random_states[1])

    def loop_kept(self) -> LoopKept:
        """Around the reference pass: the loop's gradients, fresh-gradient flags and auxiliary
        states as they were."""
        return LoopKept(self.params)


class LoopKept:
    def __init__(self, params: list[Any]) -> None:
        self.params = params

    def __enter__(self) -> None:
        self.grads = [(p, [g.copy() for g in p.list_grad()]) for p in self.params if p.grad_req != "null"]
        self.aux = AuxState({p.name: p for p in self.params if p.grad_req == "null"})
        self.fresh = [(d, d._fresh_grad) for p in self.params if p.grad_req != "null" for d in p.list_data()]

    def __exit__(self, *exc: object) -> None:
        for p, values in self.grads:
            for target, value in zip(p.list_grad(), values):
                target[:] = value
        self.aux.restore()
        for data, fresh in self.fresh:
            data._fresh_grad = fresh


class OptimizerState:
    """The Trainer's optimizer as found: its attributes, update counts, learning-rate schedule,
    each updater's states (float64 copies during the run) and the Trainer's kvstore bookkeeping."""

    TRAINER_FIELDS = ("_kv_initialized", "_kvstore", "_update_on_kvstore", "_distributed", "_params_to_init",
                      "_kvstore_params")

    def __init__(self, trainer: Any, params: list[Any]) -> None:
        self.trainer = trainer
        self.opt = opt = trainer._optimizer
        self.fields = dict(vars(opt))
        self.counts = {device: dict(counts) for device, counts in opt._all_index_update_counts.items()}
        self.schedule = copy.deepcopy(vars(opt.lr_scheduler)) if opt.lr_scheduler is not None else None
        self.updaters = [(u, u.states, u.states_synced) for u in trainer._updaters]
        # The lists and dicts copied; the kvstore itself kept by reference (a copy would share its handle).
        self.trainer_fields = {f: copy.copy(v) if isinstance(v, (list, dict)) else v
                               for f, v in ((f, getattr(trainer, f)) for f in self.TRAINER_FIELDS)}
        self.half = {i for i, p in enumerate(trainer._params) if np.dtype(p.dtype) == np.float16}

    def widen(self) -> None:
        """Each updater gets float64 copies of its states (the originals stay untouched)."""
        for updater, states, synced in self.updaters:
            master = self.opt.multi_precision
            updater.states = {i: _wide_state(s[1] if master and i in self.half and isinstance(s, tuple) else s)
                              for i, s in states.items()}
            updater.states_synced = dict(synced)

    def fresh_kvstore(self) -> None:
        """A new kvstore of the trainer's kind for the float64 run, initialised from the float64
        parameters as Trainer.step would initialise it; the trainer's own (holding the float32
        weights and, with update_on_kvstore, the optimizer's states) is set aside untouched and
        comes back on ``restore``. With update_on_kvstore the new one's updater starts from
        float64 copies of the old one's states. None (one context, no kvstore): nothing to do."""
        trainer = self.trainer
        old = trainer._kvstore if trainer._kv_initialized and trainer._update_on_kvstore else None
        config = trainer._kvstore_params
        if not isinstance(config["kvstore"], (str, type(None))):  # a KVStore object: a new one of its type
            trainer._kvstore_params = dict(config, kvstore=config["kvstore"].type)
        trainer._kv_initialized, trainer._kvstore, trainer._distributed, trainer._update_on_kvstore = False, None, None, None
        trainer._params_to_init = list(trainer._params)
        trainer._init_kvstore()
        trainer._init_params()
        updater = getattr(trainer._kvstore, "_updater", None) if trainer._update_on_kvstore else None
        before = getattr(old, "_updater", None)
        if updater is not None and before is not None:
            updater.states = {i: _wide_state(s) for i, s in before.states.items()}
            updater.states_synced = dict.fromkeys(updater.states, False)

    def restore(self) -> None:
        opt = self.opt
        vars(opt).clear()
        vars(opt).update(self.fields)
        every = opt._all_index_update_counts  # device -> {index: count}; _index_update_count is one of them
        for device in [d for d in every if d not in self.counts]:
            del every[device]
        for device, saved in self.counts.items():
            every[device].clear()
            every[device].update(saved)
        if self.schedule is not None:
            vars(opt.lr_scheduler).clear()
            vars(opt.lr_scheduler).update(self.schedule)
        for updater, states, synced in self.updaters:
            updater.states, updater.states_synced = states, synced
        for name, value in self.trainer_fields.items():
            setattr(self.trainer, name, value)


def _kvstore_kind(trainer: Any) -> str | None:
    """The type of the kvstore the trainer sums gradients with ('local', 'device', 'dist_sync',
    ...), or None where it uses none (one context and a kvstore given by name)."""
    if trainer._kv_initialized:
        return trainer._kvstore.type if trainer._kvstore is not None else None
    kind = trainer._kvstore_params["kvstore"]
    if kind is None or (isinstance(kind, str) and len(trainer._contexts) == 1 and "dist" not in kind):
        return None
    return kind if isinstance(kind, str) else kind.type


def _wide_state(state: Any) -> Any:
    if isinstance(state, mx.nd.NDArray):
        return state.astype(DTYPE) if np.issubdtype(state.dtype, np.floating) else state.copy()
    if isinstance(state, (tuple, list)):
        return type(state)(_wide_state(s) for s in state)
    return state

"""The Keras 3 stack check (accumcheck.integrations.keras): ``model.fit`` with an optimizer built
with ``gradient_accumulation_steps=N``, every optimizer step's gradient judged against its window
as one batch and its update against the optimizer applied once, the model and optimizer put back.

The faults of keras#19990 (Keras 3.0-3.4: weight decay, clipping and Adam's step count taken at
every micro-step) are emulated on the installed release by subclasses of its optimizers; ci/keras.sh
runs Keras 3.4.1 itself."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
# Keras runs on its PyTorch backend here (the one accumcheck.integrations.keras checks), chosen before keras is
# first imported; not in a conftest.py of this folder, whose module name would shadow tests/conftest.py's
os.environ.setdefault("KERAS_BACKEND", "torch")
try:
    import keras
except ImportError as exc:  # not installed, or its backend (KERAS_BACKEND) does not import
    pytest.skip(f"Keras does not import here ({exc}); pip install 'accumcheck[keras]'", allow_module_level=True)
if keras.backend.backend() != "torch":
    pytest.skip("Keras runs on another backend here (KERAS_BACKEND)", allow_module_level=True)

from accumcheck.errors import AccumcheckError, NothingJudgedError  # noqa: E402
from accumcheck.integrations.keras import BIAS_EACH, CLIP_EACH, DECAY_EACH, LR_EACH, AccumulationCheck, check  # noqa: E402

N = 4
RNG = np.random.default_rng(0)
X = RNG.normal(size=(64, 6)).astype("float32")
Y = (X @ np.linspace(-1.0, 1.0, 18).reshape(6, 3)).astype("float32")


def fitted(optimizer, dropout=0.0):
    keras.backend.clear_session()  # layer names from 0 again
    keras.utils.set_random_seed(0)
    layers = [keras.Input((6,)), keras.layers.Dense(16, activation="tanh")]
    layers += [keras.layers.Dropout(dropout)] if dropout else []
    model = keras.Sequential(layers + [keras.layers.Dense(3)])
    model.compile(optimizer=optimizer, loss="mse")
    return model


def run(optimizer, n=64, steps=2, **kwargs):
    optimizer = optimizer if isinstance(optimizer, keras.optimizers.Optimizer) else optimizer()
    return check(fitted(optimizer), X[:n], Y[:n], batch_size=8, steps=steps, shuffle=False, **kwargs)


class DecayEachMicroStep(keras.optimizers.AdamW):
    """Keras 3.0-3.4's weight decay: applied at every apply(), not once per update."""

    def _backend_apply_gradients(self, grads, trainable_variables):
        if self.gradient_accumulation_steps and int(self._iterations.numpy() + 1) % self.gradient_accumulation_steps:
            self._apply_weight_decay(trainable_variables)
        super()._backend_apply_gradients(grads, trainable_variables)


class CountEachMicroStep(keras.optimizers.AdamW):
    """Keras 3.0-3.4's step count: micro-steps, so Adam's bias correction counts them."""

    @property
    def iterations(self):
        return self._iterations


class Keras19990(DecayEachMicroStep, CountEachMicroStep):
    """Both, as Keras 3.4.1 does with AdamW."""


class ClipEachMicroStep(keras.optimizers.Adam):
    """Keras 3.0-3.4's clipping: each micro-batch's gradient, before it is accumulated."""

    def _backend_apply_gradients(self, grads, trainable_variables):
        super()._backend_apply_gradients(self._clip_gradients(grads), trainable_variables)


def adamw(cls=keras.optimizers.AdamW, **kwargs):
    return cls(**{"learning_rate": 1e-2, "weight_decay": 0.1, "gradient_accumulation_steps": N, **kwargs})


def test_current_keras_adamw_is_faithful_gradient_and_update():
    report = run(adamw())
    assert report.exit_code == 0, report.summary()
    assert [s.verdict for s in report.steps] == ["faithful", "faithful"]
    for step in report.steps:
        assert step.update.one_update and step.update.error is not None and step.update.error < 1
        assert step.precision.error <= step.precision.float32_bound
    assert "optimizer.iterations went from 0 to 2 over 2 optimizer steps" in report.notes
    assert any("at 2 of 2 updates, the float32 sum" in note for note in report.notes)
    from accumcheck.render.stackwords import stack_header_lines  # the header says the reference's real dtype

    assert "against the window's gradient in float32" in stack_header_lines(report)[0]


@pytest.mark.parametrize("optimizer", [
    lambda: keras.optimizers.SGD(learning_rate=0.1, momentum=0.9, gradient_accumulation_steps=N),
    lambda: adamw(clipnorm=0.05),  # clipping that bites, once on the window's mean
    lambda: keras.optimizers.Adam(learning_rate=1e-2, global_clipnorm=0.05, gradient_accumulation_steps=N)],
    ids=["sgd-momentum", "adamw-clipnorm", "adam-global-clipnorm"])
def test_current_keras_other_optimizers_are_faithful(optimizer):
    report = run(optimizer())
    assert report.exit_code == 0, report.summary()


@pytest.mark.parametrize("cls, named", [(DecayEachMicroStep, DECAY_EACH), (CountEachMicroStep, BIAS_EACH),
                                        (Keras19990, f"{DECAY_EACH} and {BIAS_EACH}")],
                         ids=["weight-decay", "bias-correction", "both"])
def test_keras_19990_emulated_is_flagged_and_its_cause_named(cls, named):
    report = run(adamw(cls))
    assert report.exit_code == 1
    for step in report.steps:
        assert step.verdict != "faithful"
        assert step.update.matches == named, step.update.findings
    if cls is not CountEachMicroStep:  # the decay moves the kernels between the micro-batches
        assert report.steps[0].update.moved == ["sequential/dense/kernel", "sequential/dense_1/kernel"]
    assert named in report.summary()


def test_clipping_each_micro_batch_is_named():
    report = run(adamw(ClipEachMicroStep, weight_decay=None, clipnorm=0.05))
    assert report.exit_code == 1
    assert report.steps[0].update.matches == CLIP_EACH, report.steps[0].update.findings


def test_a_learning_rate_schedule_counted_in_micro_steps_is_named():
    """Keras evaluates a schedule at its count of apply() calls, N per optimizer step."""
    schedule = keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=1, decay_rate=0.5)
    report = run(adamw(learning_rate=schedule, weight_decay=0.01))
    first = report.steps[0].update
    if first.one_update:
        pytest.skip(f"Keras {keras.__version__} evaluates the schedule at the optimizer's steps")
    assert report.exit_code == 1 and first.matches == LR_EACH


def test_a_short_last_micro_batch_is_weighted_like_the_others():
    """60 samples in micro-batches of 8: the window 4-7 ends with 4 samples, which Keras averages
    like the others (each micro-batch's mean divided by N), unlike one batch of 28."""
    report = run(adamw(), n=60, steps=None)
    assert [s.verdict for s in report.steps] == ["faithful", "mismatch"]
    assert "each micro-batch's own mean loss, summed over the window x 0.250" in report.steps[1].explanation


def test_micro_batches_with_no_update_after_them_fail():
    report = run(adamw(), n=24, steps=None)
    assert report.exit_code == 1 and report.steps == [] and report.unstepped == [0, 1, 2]


def test_the_model_optimizer_and_random_states_are_put_back():
    model = fitted(adamw(), dropout=0.2)
    model.fit(X[:16], Y[:16], batch_size=8, verbose=0, shuffle=False)  # a trained model, a built optimizer
    weights = [v.numpy().copy() for v in model.variables]
    states = [np.array(v.numpy()).copy() for v in model.optimizer.variables]
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    states_before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone())
    report = check(model, X, Y, batch_size=8, steps=2, shuffle=False)
    assert report.exit_code == 0, report.summary()
    assert all(np.array_equal(v.numpy(), w) for v, w in zip(model.variables, weights))
    assert all(np.array_equal(np.array(v.numpy()), s) for v, s in zip(model.optimizer.variables, states))
    assert int(model.optimizer.iterations.numpy()) == int(states[0]) // (N if keras.__version__ < "3.5" else 1)
    assert model.layers[1].rate == 0.2 and not hasattr(model, "__dict__") or "train_step" not in model.__dict__
    assert "apply" not in model.optimizer.__dict__
    assert random.getstate() == states_before[0] and np.array_equal(np.random.get_state()[1], states_before[1])
    assert torch.equal(torch.get_rng_state(), states_before[2])


class Failing(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 5:
            raise RuntimeError("the user's callback broke")


def test_a_fit_that_raises_puts_everything_back():
    model = fitted(adamw())
    weights = [v.numpy().copy() for v in model.variables]
    with pytest.raises(RuntimeError, match="callback broke"):
        check(model, X, Y, batch_size=8, callbacks=[Failing()], shuffle=False)
    assert all(np.array_equal(v.numpy(), w) for v, w in zip(model.variables, weights))
    assert int(model.optimizer.iterations.numpy()) == 0 and "apply" not in model.optimizer.__dict__


def test_nothing_judged_never_passes():
    with pytest.raises(NothingJudgedError, match="the fit ran no optimizer step"):
        run(adamw(), steps=None, epochs=0)
    with pytest.raises(NothingJudgedError, match="no report yet"):
        AccumulationCheck().report


def test_user_errors_are_one_line():
    with pytest.raises(AccumcheckError, match="does not accumulate gradients; compile the model with"):
        run(keras.optimizers.Adam())
    with pytest.raises(AccumcheckError, match="steps must be a positive integer"):
        AccumulationCheck(steps=0)
    with pytest.raises(AccumcheckError, match="the model is not compiled"):
        check(keras.Sequential([keras.layers.Dense(1)]), X, Y)

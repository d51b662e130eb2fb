"""``accumcheck.torch.check`` and the user's own code: what it raises is a UserCodeError naming the
micro-batch, with the original chained; what it changes is put back, also when it raises:
Python's, NumPy's and PyTorch's random states, a buffer the forward rebinds, weights a ``step``
edits in place, ``.grad``, flags and grad mode. The copy that puts the model back is counted in
the check's memory estimate and budget."""

from __future__ import annotations

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import accumcheck.torch  # noqa: E402
from accumcheck.errors import AccumcheckError, UserCodeError  # noqa: E402
from accumcheck.torch.modelstate import snapshot_bytes  # noqa: E402

N = 8


class Net(torch.nn.Module):
    """A linear layer and a counter the forward rebinds (``self.seen = self.seen + 1`` puts a new
    tensor into ``_buffers``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 3)
        self.norm = torch.nn.BatchNorm1d(3)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen = self.seen + 1
        return self.norm(self.fc(x))


def batches(n=N):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(2, 4, generator=g), torch.randn(2, 3, generator=g)) for _ in range(n)]


def mse(output, target):
    return ((output - target) ** 2).mean()


def raising_at(index, loss=mse):
    """``loss`` that raises on micro-batch ``index`` of the first pass."""
    calls = []

    def wrapped(output, target):
        calls.append(1)
        if len(calls) == index + 1:
            raise RuntimeError(f"the loss failed on call {len(calls)}")
        return loss(output, target)
    return wrapped


def drawing(output, target):
    """A loss that draws from Python's, NumPy's and PyTorch's global generators."""
    noise = random.random() + np.random.rand() + float(torch.rand(()))
    return mse(output, target) * (1.0 + 0.0 * noise)


def states():
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def assert_same_states(before, after):
    assert before[0] == after[0]  # Python's: a tuple of ints
    assert before[1][0] == after[1][0] and all(np.array_equal(a, b) for a, b in zip(before[1][1:], after[1][1:]))
    assert torch.equal(before[2], after[2])


def bits(tensor):
    return tensor.detach().reshape(-1).view(torch.uint8).clone()


def found(model):
    """Every parameter and buffer entry of every module: the tensor, its bits, its .grad, its flag,
    its version counter, its memory."""
    return [(m, kind, name, t, bits(t), t.grad, t.requires_grad, t._version, t.data_ptr())
            for m in model.modules() for kind in ("_parameters", "_buffers")
            for name, t in getattr(m, kind).items() if t is not None]


def assert_as_found(model, before, versions=False):
    after = found(model)
    assert [(m, kind, name) for m, kind, name, *_ in before] == [(m, kind, name) for m, kind, name, *_ in after]
    for (_, _, name, t, value, grad, flag, version, memory), (_, _, _, now, *_) in zip(before, after):
        assert now is t and now.data_ptr() == memory, f"{name}: another tensor, or other memory"
        assert torch.equal(bits(now), value), f"{name}: other values"
        assert now.grad is grad and now.requires_grad == flag, name
        if versions:
            assert now._version == version, f"{name}: written to"


@pytest.mark.parametrize("raises", [True, False], ids=["raising-at-5", "succeeding"])
def test_random_states_are_bit_identical_after_a_check_whose_loss_draws_from_them(raises):
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    before = states()
    model = Net()
    torch.set_rng_state(before[2])
    loss = raising_at(5, drawing) if raises else drawing
    if raises:
        with pytest.raises(UserCodeError, match="raised RuntimeError on micro-batch 5") as error:
            accumcheck.torch.check(model, loss, batches(), train_mode=True)
        assert isinstance(error.value.__cause__, RuntimeError)  # the user's own, chained
    else:
        accumcheck.torch.check(model, loss, batches(), train_mode=True)
    assert_same_states(before, states())


@pytest.mark.parametrize("raises", [True, False], ids=["raising-at-5", "succeeding"])
def test_a_buffer_the_forward_rebinds_is_the_same_tensor_with_its_value_after_the_check(raises):
    model = Net()
    model.norm.running_mean.fill_(0.25)
    model.train()
    model.fc.weight.grad = torch.ones_like(model.fc.weight)
    before = found(model)
    seen = model.seen
    if raises:
        with pytest.raises(UserCodeError, match="micro-batch 5"):
            accumcheck.torch.check(model, raising_at(5), batches(), train_mode=True)
    else:
        report = accumcheck.torch.check(model, mse, batches(), train_mode=True, inject="scale")
        assert report.flagged
    assert model._buffers["seen"] is seen and float(seen) == 0.0
    assert model.training and model.norm.training
    assert_as_found(model, before)


def edit_in_place(model, batch):
    """A step that edits weights in place under no_grad, as an optimizer would, and through
    ``.data`` (which no version counter sees), and turns a -0.0 into 0.0 (which torch.equal misses)."""
    with torch.no_grad():
        model.fc.weight[0, 0] = 0.0  # the test makes it -0.0
        model.fc.bias.data.add_(1.0)
        model.norm.weight.mul_(1.5)
    return mse(model(batch[0]), batch[1])


def rebinding(model, batch):
    """A step that gives a parameter new storage and a module a new parameter."""
    model.fc.weight.data = model.fc.weight.data * 2
    model.norm.bias = torch.nn.Parameter(torch.ones(3))
    return mse(model(batch[0]), batch[1])


@pytest.mark.parametrize("step", [edit_in_place, rebinding])
@pytest.mark.parametrize("raises", [True, False], ids=["raising-at-5", "succeeding"])
def test_weights_a_step_edits_are_the_same_tensors_with_their_values_after_the_check(step, raises):
    model = Net()
    with torch.no_grad():
        model.fc.weight[0, 0] = -0.0
    before = found(model)
    calls = []

    def counted(m, batch):
        calls.append(1)
        if raises and len(calls) == 6:
            raise KeyError("micro-batch 5's column")
        return step(m, batch)

    if raises:
        with pytest.raises(UserCodeError, match="step raised KeyError on micro-batch 5") as error:
            accumcheck.torch.check(model, batches=batches(), step=counted)
        assert isinstance(error.value.__cause__, KeyError)
    else:
        accumcheck.torch.check(model, batches=batches(), step=counted, inject="scale")
    assert_as_found(model, before)


def test_a_check_that_edits_nothing_writes_to_nothing():
    """Putting the model back writes only what differs: a tensor nothing touched keeps its version
    counter, so an autograd graph the caller holds stays valid."""
    model = Net()
    held = mse(model(torch.ones(2, 4)), torch.zeros(2, 3))  # a graph over the parameters, kept by the caller
    before = found(model)
    accumcheck.torch.check(model, mse, batches(), inject="scale")
    assert_as_found(model, before, versions=True)
    held.backward()  # the parameters it saved are as they were


def test_grad_mode_is_as_found_after_a_step_that_switches_it_off():
    def step(model, batch):
        loss = mse(model(batch[0]), batch[1])
        torch.set_grad_enabled(False)
        return loss

    with pytest.raises(AccumcheckError, match="the loss of micro-batch 1 does not depend on any parameter"):
        accumcheck.torch.check(Net(), batches=batches(), step=step)
    assert torch.is_grad_enabled()


def test_what_the_users_code_raises_is_a_user_code_error_with_the_original_chained():
    model = Net()

    def hook(grad):
        raise ValueError("hook says no")

    handle = model.fc.weight.register_hook(hook)
    with pytest.raises(UserCodeError, match="the backward pass raised ValueError on micro-batch 0: hook says no") \
            as error:
        accumcheck.torch.check(model, mse, batches())
    assert isinstance(error.value.__cause__, ValueError)
    handle.remove()

    def exits(model, batch):
        raise SystemExit(4)

    with pytest.raises(UserCodeError, match="step raised SystemExit on micro-batch 0: exit code 4") as error:
        accumcheck.torch.check(model, batches=batches(), step=exits)
    assert isinstance(error.value.__cause__, SystemExit)

    def interrupted(model, batch):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # an interrupt stays one
        accumcheck.torch.check(model, batches=batches(), step=interrupted)


def test_a_loss_that_backward_was_called_on_is_refused_before_judging():
    def step(model, batch):
        loss = mse(model(batch[0]), batch[1])
        loss.backward(retain_graph=True)
        return loss

    with pytest.raises(AccumcheckError, match=r"step changed the parameters' \.grad on micro-batch 0 .*return the "
                                              "loss: accumcheck calls backward"):
        accumcheck.torch.check(Net(), batches=batches(), step=step)


def test_the_copy_that_puts_the_model_back_is_in_the_memory_estimate_and_budget(monkeypatch):
    import accumcheck.run.resources
    from accumcheck.run.budget import minimum
    from accumcheck.torch.needs import model_needs

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))
    data = [(torch.randn(2, 64), torch.randn(2, 4)) for _ in range(4)]
    kept = snapshot_bytes(model)
    assert kept == sum(p.numel() * 4 for p in model.parameters())
    without = accumcheck.run.resources.estimate_model(sum(p.numel() for p in model.parameters()), False).bytes
    monkeypatch.setattr(accumcheck.run.resources, "available_memory", lambda: without + kept // 2)
    with pytest.raises(AccumcheckError, match="needs about"):
        accumcheck.torch.check(model, mse, data)
    monkeypatch.undo()
    least = minimum(model_needs(dict(model.named_parameters()), torch.float32, "native", None,
                                torch.device("cpu"))) + kept
    with pytest.raises(AccumcheckError, match=rf"the copy of the parameters and buffers kept to put them back .* "
                                              rf"give at least {least} "):
        accumcheck.torch.check(model, mse, data, memory_budget=least - 1)
    assert accumcheck.torch.check(model, mse, data, memory_budget=least).groups > 1

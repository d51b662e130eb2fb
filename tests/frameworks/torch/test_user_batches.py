"""accumcheck.torch.check takes batches as a training loop has them, a GradScaler, parameters
that get no gradient and models of mixed dtypes; bad input is one line naming the argument."""

from collections import namedtuple

import pytest

import accumcheck

torch = pytest.importorskip("torch")
from test_user_models import assert_same_state, state  # noqa: E402

import accumcheck.torch  # noqa: E402

F = torch.nn.functional
N = 8


class TwoInputs(torch.nn.Module):
    """forward(x, scale) with an optional unused and an optional conditional layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(6, 4)
        self.unused = torch.nn.Linear(6, 4)
        self.sometimes = torch.nn.Linear(4, 4)

    def forward(self, x, scale=None, labels=None):
        h = self.fc(x) * (1.0 if scale is None else scale)
        if x[0, 0] > 0:  # taken by some micro-batches only
            h = self.sometimes(h)
        if labels is None:
            return h
        return {"loss": F.cross_entropy(h, labels), "logits": h}


def data(n=N, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 6, generator=gen), torch.randint(0, 4, (5,), generator=gen)) for _ in range(n)]


def ce(output, target):
    return F.cross_entropy(output, target)


def test_every_batch_form_gives_the_same_gradient():
    model, pairs = TwoInputs(), data()
    forms = {
        "pair": dict(loss_fn=ce, batches=pairs),
        "tuple inputs": dict(loss_fn=ce, batches=[((x, 1.0), y) for x, y in pairs]),
        "dict, own loss": dict(batches=[{"x": x, "labels": y} for x, y in pairs]),
        "step": dict(batches=pairs, step=lambda m, b: ce(m(b[0]), b[1])),
        "named tuple": dict(batches=[namedtuple("B", "x y")(x, y) for x, y in pairs],
                            step=lambda m, b: ce(m(b.x), b.y)),
        "function": dict(loss_fn=ce, batches=lambda i: pairs[i]),
    }
    grads = {}
    for form, kwargs in forms.items():
        report = accumcheck.torch.check(model, accum_steps=N, **kwargs)
        accumcheck.assert_faithful(report)
        grads[form] = {t.name: t.max_abs_grad for t in report.tensors}
    assert all(g == grads["pair"] for g in grads.values()), grads


def test_a_batch_without_target_calls_the_loss_with_the_output_only():
    model, pairs = TwoInputs(), data()
    seen = []

    def loss(output, *rest):
        seen.append(rest)
        return output.square().mean()

    for batches in ([x for x, _ in pairs], [(x, None) for x, _ in pairs], [(x,) for x, _ in pairs]):
        seen.clear()
        accumcheck.assert_faithful(accumcheck.torch.check(model, loss, batches, accum_steps=N))
        assert seen == [()] * N


def test_a_tuple_output_with_the_loss_first_is_the_model_own_loss():
    class ReturnTuple(torch.nn.Module):  # Hugging Face with return_dict=False
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(6, 4)

        def forward(self, x, labels):
            h = self.fc(x)
            return F.cross_entropy(h, labels), h

    report = accumcheck.torch.check(ReturnTuple(), batches=[{"x": x, "labels": y} for x, y in data()], accum_steps=N)
    accumcheck.assert_faithful(report)


def test_unused_and_conditional_parameters_are_reported_not_crashed_on():
    model, pairs = TwoInputs(), data()
    taken = sum(bool(x[0, 0] > 0) for x, _ in pairs)
    assert 0 < taken < N
    report = accumcheck.torch.check(model, ce, pairs, accum_steps=N)
    verdicts = {t.name: t for t in report.tensors}
    assert verdicts["unused.weight"].verdict == "no-gradient" and verdicts["unused.bias"].verdict == "no-gradient"
    assert verdicts["sometimes.weight"].steps_with_grad == taken and verdicts["fc.weight"].steps_with_grad is None
    assert report.exit_code == 0 and "2 no gradient" in accumcheck.render.wording.summary_line(report)
    faulty = accumcheck.torch.check(model, ce, pairs, accum_steps=N, inject="drop-step:sometimes.weight")
    assert [t.name for t in faulty.flagged] in ([], ["sometimes.weight"])  # flagged when step N/2 had a gradient
    assert bool([t.name for t in faulty.flagged]) == bool(pairs[N // 2][0][0, 0] > 0)


def test_a_grad_scaler_is_read_not_changed_and_the_gradients_are_judged_unscaled():
    model, pairs = TwoInputs(), data()
    plain = accumcheck.torch.check(model, ce, pairs, accum_steps=N)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    scaled = accumcheck.torch.check(model, ce, pairs, accum_steps=N, grad_scaler=scaler)
    accumcheck.assert_faithful(scaled)
    assert scaler._scale is None  # never initialised by the check
    assert [t.max_abs_grad for t in scaled.tensors] == [t.max_abs_grad for t in plain.tensors]
    assert scaled.losses == plain.losses and "losses scaled by 4096 (GradScaler)" in " ".join(scaled.notes)
    faulty = accumcheck.torch.check(model, ce, pairs, accum_steps=N, grad_scaler=scaler, inject="scale:fc.weight")
    assert [t.name for t in faulty.flagged] == ["fc.weight"]


def test_an_overflowing_scaled_step_is_a_skipped_step_not_a_divergence():
    model, pairs = TwoInputs(), data()
    huge = torch.amp.GradScaler("cpu", init_scale=2.0 ** 130)  # the scaled loss overflows float32
    report = accumcheck.torch.check(model, ce, pairs, accum_steps=N, grad_scaler=huge)
    overflowed = [t.name for t in report.tensors if t.verdict == "overflow"]
    assert overflowed and report.exit_code == 0 and not report.flagged
    line = accumcheck.render.wording.summary_line(report)
    assert line.startswith("SKIPPED STEP") and "GradScaler skips this optimizer step" in line
    # Without a scaler the same infinities are a finding.
    class Blowup(TwoInputs):
        def forward(self, x, scale=None, labels=None):
            return super().forward(x, 2.0 ** 130)
    assert accumcheck.torch.check(Blowup(), ce, pairs, accum_steps=N).exit_code == 1


def test_a_model_of_mixed_dtypes_judges_each_tensor_by_its_own():
    model, pairs = TwoInputs(), data()
    model.sometimes.to(torch.bfloat16)

    class Cast(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            h = self.inner.fc(x)
            return self.inner.sometimes(h.to(torch.bfloat16)).float()

    report = accumcheck.torch.check(Cast(model), ce, pairs, accum_steps=N)
    verdicts = {t.name: t.verdict for t in report.tensors if t.verdict != "no-gradient"}
    assert verdicts["inner.fc.weight"] in ("identical", "round-off")
    assert verdicts["inner.sometimes.weight"] == "precision-loss"
    assert any("mixed parameter dtypes (2 bfloat16, 4 float32)" in n for n in report.notes)


@pytest.mark.parametrize("kwargs, message", [
    (dict(loss_fn=ce, step=lambda m, b: 0), "pass loss_fn or step, not both"),
    (dict(step=lambda m, b: m(b[0]).sum(-1)), r"step must return a scalar loss tensor, got a tensor of shape \(5,\)"),
    (dict(step=lambda m, b: 1.0), "step must return a scalar loss tensor, got float"),
    (dict(step=lambda m, b: torch.tensor(1.0)), "does not depend on any parameter"),
    (dict(batches=[x for x, _ in data()]), "the model returned a Tensor with no loss"),
    (dict(loss_fn=ce, batches=[("not", "tensors")] * N), "the model or loss_fn raised TypeError on micro-batch 0"),
    (dict(loss_fn=ce, batches=[(1, 2, 3)] * N), r"a batch is \(inputs, target\) or \(inputs,\)"),
    (dict(loss_fn=ce, batches=None), "batches is missing"),
    (dict(loss_fn=ce, device="cuda"), "the model is on cpu, not cuda"),
    (dict(loss_fn=ce, device="tpu:x"), "is not a device name"),
    (dict(loss_fn=ce, autocast=torch.float64), "autocast must be torch.bfloat16 or torch.float16"),
    (dict(loss_fn=ce, grad_scaler=object()), "grad_scaler must be a torch.amp.GradScaler"),
    (dict(loss_fn=ce, mode="fast"), "mode must be one of native, accumulator, compensated"),
    (dict(loss_fn=ce, full_batch=True, loss_reduction="avg"), "loss_reduction must be one of mean, sum, token_count"),
    (dict(loss_fn=ce, collate="cat"), "collate must be a function"),
    (dict(loss_fn=ce, inject="scale:nope"), "no parameter named 'nope'"),
])
def test_bad_input_is_one_line_and_leaves_the_model_as_found(kwargs, message):
    model, pairs = TwoInputs(), data()
    kwargs.setdefault("batches", pairs)
    before = state(model)
    with pytest.raises(accumcheck.AccumcheckError, match=message) as info:
        accumcheck.torch.check(model, accum_steps=N, **kwargs)
    assert "\n" not in str(info.value)
    assert_same_state(before, state(model))


def test_a_model_that_is_not_a_module_is_refused():
    with pytest.raises(accumcheck.AccumcheckError, match="model must be a torch.nn.Module, got function"):
        accumcheck.torch.check(lambda x: x, ce, data(), accum_steps=N)


def test_a_check_that_cannot_fit_is_refused_before_it_runs_unless_forced(monkeypatch):
    from accumcheck.run import resources

    model, pairs = TwoInputs(), data()
    monkeypatch.setattr(resources, "available_memory", lambda: 1000)
    before = state(model)
    with pytest.raises(accumcheck.AccumcheckError,
                       match=r"check: needs about .* beside the model \(76 parameters\), but 1000 bytes of memory .* force=True"):
        accumcheck.torch.check(model, ce, pairs, accum_steps=N)
    assert_same_state(before, state(model))
    assert accumcheck.torch.check(model, ce, pairs, accum_steps=N, force=True).exit_code == 0


def test_train_mode_switches_dropout_off():
    class Dropping(TwoInputs):
        def __init__(self):
            super().__init__()
            self.drop = torch.nn.Dropout(0.5)

        def forward(self, x, scale=None, labels=None):
            return self.fc(self.drop(x))

    model, pairs = Dropping(), data()
    report = accumcheck.torch.check(model, ce, pairs, accum_steps=N, train_mode=True, full_batch=True)
    assert report.full_batch.equivalent  # the joined batch would draw other masks, were dropout on
    accumcheck.assert_faithful(report)
    assert model.drop.training  # and back on afterwards


def test_a_model_may_use_operations_without_a_deterministic_kernel():
    """Deterministic algorithms are on, warning (not raising) where an operation has none, such
    as some CUDA scatter kernels: native and manual share each backward pass anyway."""
    model, pairs = TwoInputs(), data()
    seen = []

    def step(m, batch):
        seen.append((torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()))
        return ce(m(batch[0]), batch[1])

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    accumcheck.assert_faithful(accumcheck.torch.check(model, batches=pairs, accum_steps=N, step=step))
    assert set(seen) == {(True, True)}
    assert (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) == before


def test_floating_inputs_reach_the_model_in_its_dtype_through_every_nesting():
    model, pairs = TwoInputs(), data()
    model.to(torch.bfloat16)  # the batches stay float32: the check casts them, however nested
    forms = [dict(batches=[{"x": x, "labels": y} for x, y in pairs]),
             dict(loss_fn=ce, batches=[((x, torch.tensor(1.0)), y) for x, y in pairs]),
             dict(batches=[{"pair": [x, y]} for x, y in pairs], step=lambda m, b: ce(m(b["pair"][0]).float(),
                                                                                    b["pair"][1]))]
    for kwargs in forms:
        report = accumcheck.torch.check(model, accum_steps=N, mode="accumulator", **kwargs)
        accumcheck.assert_faithful(report)

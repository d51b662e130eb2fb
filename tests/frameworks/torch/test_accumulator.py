"""accumcheck.torch.GradAccumulator: float32 main-grad buffers, plain or compensated."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import accumcheck
from accumcheck.case.reading import builtin_case_names

torch = pytest.importorskip("torch")
from accumcheck.torch import GradAccumulator  # noqa: E402

F32 = np.float32


@pytest.mark.parametrize("steps", [16, 32, pytest.param(256, marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", builtin_case_names())
def test_compensated_mode_is_within_half_a_float32_ulp_of_e(case, steps):
    """docs/precision.md: within 0.5 float32 ulp of E, as a correctly rounded sum would be."""
    report = accumcheck.compare(case, accum_steps=steps, mode="compensated")
    assert report.exit_code == 0 and report.config["mode"] == "compensated"
    assert max(t.err_ulps_native for t in report.tensors) <= 0.5


def test_plain_accumulator_is_round_off_but_drifts_with_n():
    small = accumcheck.compare("transformer-small", accum_steps=16, mode="accumulator")
    large = accumcheck.compare("transformer-small", accum_steps=256, mode="accumulator")
    assert small.exit_code == large.exit_code == 0
    assert max(t.err_ulps_native for t in large.tensors) > max(t.err_ulps_native for t in small.tensors) > 1


def test_it_fixes_bfloat16_accumulation():
    native = accumcheck.compare("shared-weight", accum_steps=32, dtype="bfloat16")
    fixed = accumcheck.compare("shared-weight", accum_steps=32, dtype="bfloat16", mode="compensated")
    assert native.exit_code == 1 and fixed.exit_code == 0
    assert max(t.err_ulps_native for t in fixed.tensors) <= 0.5  # bfloat16 parameters included


def test_apply_and_zero():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    acc = GradAccumulator(model, compensated=True)
    x = torch.randn(5, 4, dtype=torch.bfloat16)
    expected = torch.zeros(3, 4, dtype=torch.float64)
    for _ in range(3):
        model(x).float().pow(2).sum().backward()
        expected += model.weight.grad.double()
        acc.add()
        assert model.weight.grad is None
    acc.apply()
    assert model.weight.grad.dtype == torch.bfloat16
    assert torch.allclose(acc.totals()[0].double(), expected, rtol=1e-6, atol=0)
    acc.zero()
    assert all(not t.any() for t in acc.totals())


@given(st.integers(1, 512).flatmap(lambda n: arrays(F32, (n, 8), elements=st.floats(-1e3, 1e3, width=32))),
       st.integers(-30, 30))
def test_compensated_sum_is_within_one_ulp_where_the_theory_promises_it(base, exponent):
    micro = (base.astype(np.float64) * 10.0**exponent).astype(F32)
    param = torch.nn.Parameter(torch.zeros(8))
    acc = GradAccumulator([param], compensated=True)
    for g in micro:
        param.grad = torch.from_numpy(g.copy())
        acc.add()
    total = acc.totals()[0].numpy().astype(np.float64)
    exact = micro.astype(np.float64).sum(0)
    absum = np.abs(micro.astype(np.float64)).sum(0)
    ulp = np.spacing(np.abs(exact).astype(F32)).astype(np.float64)
    # Neumaier: |sum - E| <= u|E| + 2 N u^2 S (+ E's own float64 error): one ulp while N u S/|E| is small.
    u = 2.0**-24
    promised = (exact != 0) & (2 * len(micro) * u * absum <= 0.25 * np.abs(exact)) & (np.abs(exact) > 1e-37)
    assert np.all(np.abs(total - exact)[promised] <= ulp[promised])


def _accumulate(grads, param_dtype=torch.float32, **kw):
    """A GradAccumulator over one parameter fed ``grads`` (lists of floats), one micro-step each."""
    param = torch.nn.Parameter(torch.zeros(len(grads[0]), dtype=param_dtype))
    acc = GradAccumulator([param], **kw)
    for g in grads:
        param.grad = torch.tensor(g, dtype=param_dtype)
        acc.add()
    return acc, param


def test_plain_mode_is_a_float32_running_sum_by_default():
    # 1 + 2^-24 is a tie in float32 and rounds to the even 1.0, twice: the plain sum loses both.
    acc, _ = _accumulate([[1.0], [2.0**-24], [2.0**-24]])
    assert acc.compensated is False and acc.carries is None
    assert acc.totals()[0].tolist() == [1.0] and acc.totals()[0].dtype == torch.float32


def test_compensated_mode_keeps_what_each_addition_rounds_away():
    acc, _ = _accumulate([[1.0], [2.0**-24], [2.0**-24]], compensated=True)
    assert acc.compensated is True
    assert acc.totals()[0].tolist() == [1.0 + 2.0**-23]  # the exact sum
    assert acc.sums[0].tolist() == [1.0] and acc.carries[0].tolist() == [2.0**-23]
    # Equal magnitudes add exactly: nothing is carried, whichever way the carry is taken.
    acc, _ = _accumulate([[3.0, -3.0], [3.0, 3.0]], compensated=True)
    assert acc.totals()[0].tolist() == [6.0, 0.0] and acc.carries[0].tolist() == [0.0, 0.0]


def test_bfloat16_parameters_carry_in_float32():
    # The carry 2^-24 + 2^-33 needs 10 significant bits (bfloat16 has 8); kept whole, it lifts the
    # float32 total above the tie at 1 + 2^-24, to the exact sum's nearest float32.
    acc, param = _accumulate([[1.0], [2.0**-24], [2.0**-33]], param_dtype=torch.bfloat16, compensated=True)
    assert acc.sums[0].dtype == acc.carries[0].dtype == torch.float32
    assert acc.carries[0].tolist() == [2.0**-24 + 2.0**-33]
    assert acc.totals()[0].tolist() == [1.0 + 2.0**-23]
    acc.apply()
    assert param.grad.dtype == torch.bfloat16 and param.grad.tolist() == [1.0]  # 1 + 2^-23 in bfloat16
    acc.zero()
    assert acc.sums[0].tolist() == acc.carries[0].tolist() == acc.totals()[0].tolist() == [0.0]


def test_a_buffer_dtype_rounds_each_micro_gradient_to_it_first():
    # A bfloat16 buffer: 2^-8 + 2^-20 becomes 2^-8 before it is added, and 1 + 2^-8 ties to 1.0.
    acc, _ = _accumulate([[1.0], [2.0**-8 + 2.0**-20]], dtype=torch.bfloat16)
    assert acc.sums[0].dtype == torch.bfloat16 and acc.totals()[0].tolist() == [1.0]
    acc, _ = _accumulate([[1.0], [2.0**-30]], dtype=torch.float64)
    assert acc.totals()[0].dtype == torch.float64 and acc.totals()[0].tolist() == [1.0 + 2.0**-30]


def test_parameters_without_a_gradient_or_frozen_are_left_alone():
    first, second = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    acc = GradAccumulator([first, frozen, second])
    assert acc.params == [first, second]
    second.grad = torch.tensor([1.0, 2.0])
    acc.add()  # first has no .grad this micro-step
    assert second.grad is None
    assert [t.tolist() for t in acc.totals()] == [[0.0, 0.0], [1.0, 2.0]]
    acc.apply()
    assert first.grad.tolist() == [0.0, 0.0] and second.grad.tolist() == [1.0, 2.0]
    acc.zero()
    assert [t.tolist() for t in acc.totals()] == [[0.0, 0.0], [0.0, 0.0]]


def test_a_module_gives_its_parameters():
    model = torch.nn.Linear(3, 2)
    acc = GradAccumulator(model)
    assert [tuple(s.shape) for s in acc.sums] == [(2, 3), (2,)]


@pytest.mark.parametrize("mode, dtype", [("accumulator", "bfloat16"),
                                         pytest.param("accumulator", "float32", marks=pytest.mark.slow),
                                         pytest.param("compensated", "bfloat16", marks=pytest.mark.slow)])
@pytest.mark.parametrize("fault", ["drop-step", "double-step", "scale", "bf16"])
def test_every_fault_reaches_the_accumulator_buffer(mode, dtype, fault):
    """In these modes the native slot is the GradAccumulator: each fault acts on its buffer
    (a double-step adds its running total again; bf16 rounds its total), on bfloat16 parameters
    too, where the same fault applied to a bfloat16 .grad would round away."""
    report = accumcheck.compare("padded-tokens", accum_steps=4, mode=mode, dtype=dtype, inject=f"{fault}:fc1.weight")
    assert [t.name for t in report.flagged] == ["fc1.weight"], (dtype, fault)
    control = accumcheck.compare("padded-tokens", accum_steps=4, mode=mode, dtype=dtype, inject="roundoff:fc1.weight")
    assert control.exit_code == 0


def test_add_to_and_replace_reach_one_buffer():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    acc = GradAccumulator(params, compensated=True)
    acc.add_to(1, torch.tensor([1.0, 2.0], dtype=torch.bfloat16))
    acc.add_to(1, torch.tensor([1e-8, 0.0]))
    assert acc.sums[1].tolist() == [1.0, 2.0] and acc.total(0).tolist() == [0, 0, 0]
    assert acc.carries[1].tolist() == pytest.approx([1e-8, 0.0], rel=1e-6)  # what float32 rounded away
    acc.replace(1, torch.tensor([5.0, 6.0]))
    assert acc.total(1).tolist() == [5.0, 6.0] and acc.carries[1].tolist() == [0.0, 0.0]

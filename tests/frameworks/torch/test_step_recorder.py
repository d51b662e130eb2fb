"""The StepRecorder's manual buffer, E and S: every element takes every micro-step's addition in
step order, whichever path adds them (eight steps at a time, held as references or as copies on
the ring, or step by step)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from accumcheck.torch.passes import HELD_STEPS, StepRecorder  # noqa: E402


def _micro_gradients(shapes: dict, steps: int, seed: int) -> list[dict]:
    """Values spread over sixteen orders of magnitude and both signs: summed in another order (or
    rounded to float32 once instead of per step), the sums come out different."""
    rng = np.random.default_rng(seed)
    values = lambda shape: rng.standard_normal(shape) * 10.0 ** rng.integers(-8, 8, shape)  # noqa: E731
    grads = [{name: torch.from_numpy(values(shape).astype(np.float32)) for name, shape in shapes.items()}
             for _ in range(steps)]
    for step in grads:  # a 2-D gradient as autograd may hand it out: transposed, not contiguous
        step.update({name: g.t().contiguous().t() for name, g in step.items() if g.dim() == 2})
    return grads


def _expected(grads: list[dict], name: str, accum: np.dtype) -> tuple:
    manual = np.zeros(grads[0][name].numel(), accum)
    exact = np.zeros(manual.size)
    absum = np.zeros(manual.size)
    for step in grads:
        g = step[name].numpy().reshape(-1)
        manual = (manual + g.astype(accum)).astype(accum)  # one rounding per step, in the buffer's dtype
        exact = exact + g.astype(np.float64)
        absum = absum + np.abs(g.astype(np.float64))
    return manual, exact, absum


@pytest.mark.parametrize("steps", [1, 3, HELD_STEPS, 13, 2 * HELD_STEPS])
@pytest.mark.parametrize("accum", [torch.float32, torch.float64])
def test_every_step_is_added_in_order_on_every_path(steps, accum):
    shapes = {"weight": (37, 11), "bias": (300,), "scale": (1,)}
    params = {name: torch.zeros(shape, requires_grad=True) for name, shape in shapes.items()}
    grads = _micro_gradients(shapes, steps, seed=steps)
    ring = StepRecorder(params, accum)
    refs = StepRecorder(params, accum, hold_refs=True)
    per_step = StepRecorder(params, accum, hold_steps=False)
    assert ring.ring is not None and refs.ring is None and refs.holds and not per_step.holds
    for recorder in (ring, refs, per_step):
        for index, step in enumerate(grads):
            # "bias" gets no gradient in micro-step 1: the recorder adds zeros and counts it
            for name, g in step.items():
                if not (index == 1 and name == "bias"):
                    recorder.hook(name)(g)
            recorder.flush()
    if steps > 1:
        grads[1]["bias"] = torch.zeros(300)
    for recorder in (ring, refs, per_step):
        assert recorder.missing == ({"bias": 1} if steps > 1 else {})
        for name in shapes:
            got = [t.reshape(-1).numpy() for t in recorder.buffers()[name]]
            for have, want in zip(got, _expected(grads, name, np.dtype(str(accum).removeprefix("torch.")))):
                assert have.dtype == want.dtype and np.array_equal(have, want), name


def test_a_model_too_large_for_the_ring_adds_step_by_step():
    from accumcheck.torch.passes import HELD_BYTES

    big = {"weight": torch.zeros(HELD_BYTES // (4 * HELD_STEPS) + 1, requires_grad=True)}
    small = {"weight": torch.zeros(HELD_BYTES // (4 * HELD_STEPS), requires_grad=True)}
    assert StepRecorder(big).ring is None and StepRecorder(small).ring is not None


@pytest.mark.parametrize("hold_refs", [True, False])
def test_held_micro_gradients_are_the_ones_autograd_handed_out(hold_refs):
    """Real backward passes, .grad accumulating: a held micro-gradient stays as it was while the
    later steps run (AccumulateGrad must not adopt it as .grad and add into it)."""
    from accumcheck.torch.passes import accumulate

    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 9, generator=gen, requires_grad=True)
    inputs = [torch.randn(5, 40, generator=gen) * 10.0 ** k for k in range(-6, 7)]
    result = accumulate({"weight": weight}, lambda k: (inputs[k] @ weight).pow(2).sum(), len(inputs), None, None,
                        "test", hold_refs=hold_refs)
    micro = [{"weight": torch.autograd.grad((x @ weight).pow(2).sum(), weight)[0]} for x in inputs]
    got = [t.reshape(-1).numpy() for t in result["buffers"]["weight"]]
    for have, want in zip(got, _expected(micro, "weight", np.dtype("float32"))):
        assert np.array_equal(have, want)
    assert weight.grad is not None and np.array_equal(weight.grad.reshape(-1).numpy(), got[0])


@pytest.mark.parametrize("given", [False, True])
@pytest.mark.parametrize("accum", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hold_steps", [True, False])
def test_a_step_handed_on_stays_as_it_is_for_the_next_steps(hold_steps, accum, given):
    """Data parallel: each step is handed on as one flat tensor (a row of the ring, or a step
    buffer used in turn), which the data-parallel reference keeps without a copy while it sends
    or adds it: it must hold that step, in parameter order, for as many further steps as the
    reference keeps in flight; the sums are the same as without a receiver (a bfloat16 manual
    buffer adds off the compiled host path). Given rows and sums (memory rank 0 reads), the steps
    handed on are rows of them, and E and S are summed there, from zero whatever they held."""
    from accumcheck.torch.dpreference import _IN_FLIGHT
    from accumcheck.torch.passes import ROWS, STEP_ROWS

    shapes = {"weight": (37, 11), "bias": (300,)}
    params = {name: torch.zeros(shape, requires_grad=True) for name, shape in shapes.items()}
    total = sum(int(np.prod(shape)) for shape in shapes.values())
    steps = 2 * HELD_STEPS + 3
    grads = _micro_gradients(shapes, steps, seed=7)
    handed: list = []
    rows = torch.full((ROWS, total), float("nan")) if given else None
    sums = (torch.full((total,), 5.0, dtype=torch.float64), torch.full((total,), 7.0, dtype=torch.float64))
    recorder = StepRecorder(params, accum, on_step=handed.append, hold_steps=hold_steps, rows=rows,
                            sums=sums if given else None)
    if given:
        assert recorder.exact is sums[0] and recorder.absum is sums[1]
        with pytest.raises(ValueError):
            StepRecorder(params, accum, on_step=handed.append, rows=torch.empty(STEP_ROWS, total))
    plain = StepRecorder(params, accum, hold_steps=hold_steps)
    assert (recorder.ring is not None) == (hold_steps and accum == torch.float32)
    flat = [torch.cat([step[name].reshape(-1) for name in shapes]) for step in grads]
    for index, step in enumerate(grads):
        for rec in (recorder, plain):
            for name, g in step.items():
                rec.hook(name)(g)
            rec.flush()
        assert len(handed) == index + 1
        if given:
            assert any(handed[-1].data_ptr() == row.data_ptr() for row in rows)
        for kept in range(max(0, index - _IN_FLIGHT), index + 1):
            assert torch.equal(handed[kept], flat[kept]), (index, kept)
    for name in shapes:
        for have, want in zip(recorder.buffers()[name], plain.buffers()[name]):
            assert torch.equal(have, want), name

"""Judging on the device where the gradients live (torch operations), on CPU tensors: the same figures
as the compiled host kernel, on random arrays and on every built-in case with every fault."""

import dataclasses
import math

import numpy as np
import pytest
from conftest import needs_torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_reference import BOUNDS, assert_same, tensors

from accumcheck.case.reading import builtin_case_names, resolve_case
from accumcheck.judge import build_report
from accumcheck.judge.kernel import reduce_on_host
from accumcheck.options.choices import FAULT_KINDS
from accumcheck.run.validation import configure

pytestmark = needs_torch
torch = pytest.importorskip("torch")

# The figures that come from sums: torch adds in its own order, so these agree to the sums' last bits.
SUMMED = {"condition", "rel_err_native", "rel_err_manual", "grad_sum_sq", "spread_predicted", "spread_native",
          "spread_manual", "norm_share"}


@settings(max_examples=150, deadline=None)
@given(tensors(), BOUNDS, st.sampled_from([(1.3e-6, 1e-5), (0.0, 0.0)]), st.sampled_from([7, 256, 1 << 24]))
def test_the_device_reduction_is_the_host_kernel(arrays, bounds, tolerances, slice_size):
    from accumcheck.torch import judging

    a, b, e, s = arrays
    args = (*bounds, *tolerances)
    judging.SLICE, saved = slice_size, judging.SLICE  # several slices: indices offset, first maxima kept
    try:
        got = judging.reduce_tensors(*(torch.from_numpy(x) for x in (a, b, e, s)), *args)
    finally:
        judging.SLICE = saved
    assert_same(got, reduce_on_host(a, b, e, s, *args))


def test_narrow_dtypes_are_judged_as_float32_like_on_the_host():
    from accumcheck.torch.judging import reduce_tensors

    rng = np.random.default_rng(0)
    e = rng.standard_normal(3000)
    a = torch.from_numpy(e).to(torch.bfloat16)
    b = torch.from_numpy(e * (1 + 1e-3)).to(torch.float16)
    args = (1e-3, 0.0, 1e-3, 0.0, 1.3e-6, 1e-5)
    host = reduce_on_host(a.float().numpy(), b.float().numpy(), e, np.abs(e), *args)
    assert_same(reduce_tensors(a, b, torch.from_numpy(e), torch.from_numpy(np.abs(e)), *args), host)
    assert host.mismatched > 0 and host.max_ulps > 0


def _differences(a, b, where=""):
    if where in (".created", ".seconds"):
        return []
    if isinstance(a, dict):
        return [d for key in sorted(set(a) | set(b)) for d in _differences(a.get(key), b.get(key), f"{where}.{key}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    if where.rsplit(".", 1)[-1] in SUMMED and isinstance(a, float) and isinstance(b, float):
        return [] if math.isclose(a, b, rel_tol=1e-12) or a == b else [f"{where}: {a!r} / {b!r}"]
    return [] if a == b or (a != a and b != b) else [f"{where}: {a!r} / {b!r}"]


@pytest.mark.parametrize("fault", [None, *FAULT_KINDS])
@pytest.mark.parametrize("case", builtin_case_names())
def test_every_case_and_fault_judged_on_the_device_gives_the_host_report(case, fault, monkeypatch):
    from accumcheck.torch import engine
    from accumcheck.torch.backend import TorchBackend
    from accumcheck.torch.judging import HostCopy

    monkeypatch.setattr(engine, "judged_on_device", lambda device: True)
    config = configure({"case": case, "framework": "torch", "accum_steps": 16, "inject": fault})
    run = TorchBackend().run(config)
    assert all(p.reducer is not None and isinstance(p.native, HostCopy) for p in run.params)
    on_device = build_report(resolve_case(case), run, 16, config.fault, False, 0.0).to_dict()
    # Only the tensors drawn as ratio maps (the flagged ones, and the three nearest their bound)
    # were copied to the host; every other tensor sent back a few scalars.
    copied = {p.name for p in run.params if p.exact._host is not None}
    assert copied <= {t["name"] for t in on_device["tensors"] if t.get("ratio_map") is not None}
    assert len(copied) <= 3 + sum(t["verdict"] in ("diverged", "non-finite") for t in on_device["tensors"])
    on_host = build_report(resolve_case(case), dataclasses.replace(run, params=[
        dataclasses.replace(p, reducer=None) for p in run.params]), 16, config.fault, False, 0.0).to_dict()
    assert _differences(on_device, on_host) == []
    assert fault is None or fault == "roundoff" or any(t["verdict"] == "diverged" for t in on_device["tensors"])



@pytest.mark.parametrize("inject", [None, "scale", "drop-step"])
def test_your_own_model_judged_on_the_device_gives_the_host_report(inject, monkeypatch):
    import accumcheck.torch
    from accumcheck.torch import engine

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(50, 32), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                   torch.nn.Linear(32, 50))

    def batches():
        g = torch.Generator().manual_seed(1)
        return [(torch.randint(0, 50, (4, 6), generator=g), torch.randint(0, 50, (4, 6), generator=g))
                for _ in range(8)]

    def loss_fn(out, target):
        return torch.nn.functional.cross_entropy(out.reshape(-1, 50), target.reshape(-1))

    on_host = accumcheck.torch.check(model(), loss_fn, batches(), accum_steps=8, inject=inject).to_dict()
    made = []
    monkeypatch.setattr(engine, "judged_on_device", lambda device: made.append(device) or True)
    on_device = accumcheck.torch.check(model(), loss_fn, batches(), accum_steps=8, inject=inject).to_dict()
    assert made and _differences(on_device, on_host) == []
    assert (inject is None) == all(t["verdict"] != "diverged" for t in on_device["tensors"])

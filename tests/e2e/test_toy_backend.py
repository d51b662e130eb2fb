"""A third framework, defined in this file: a linear model in pure numpy with a hand-written
gradient. It is registered through the ``accumcheck.backends`` entry-point group (a dist-info
folder on PYTHONPATH, as an installed package would have) or ``register_backend``, and runs
through the command line, the pytest plugin and ``accumcheck.compare`` without any file of
accumcheck knowing it exists."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import installed_backend, linear_case, unwrapped

import accumcheck
from accumcheck.errors import AccumcheckError
from accumcheck.run.backend import Backend, Capabilities
from accumcheck.run.faults import FaultInjector, round_to_bfloat16
from accumcheck.run.results import ParamAccumulation, RunResult

CASE = linear_case("toy-linear", seed=3, accum_steps=8)


def gradients(weight: np.ndarray, bias: np.ndarray, x: np.ndarray, labels: np.ndarray) -> tuple[dict, float]:
    """Softmax cross-entropy (mean over the batch) of x @ W.T + b, and its gradient, in float32."""
    logits = x @ weight.T + bias
    shifted = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    loss = float(-np.log(p[np.arange(len(labels)), labels]).mean())
    d = p.copy()
    d[np.arange(len(labels)), labels] -= 1
    d /= np.float32(len(labels))
    return {"linear.weight": (d.T @ x).astype(np.float32), "linear.bias": d.sum(axis=0).astype(np.float32)}, loss


class ToyBackend(Backend):
    """Native accumulation: a float32 ``grad`` array each step's gradient is added into."""

    name = "toy"
    install = "it ships with its tests"
    capabilities = Capabilities(accum_dtypes=("float32",), layer_types=("dense",),
                                why_not={"world_size": "it runs in one process"})

    def has_device(self, kind: str) -> bool:
        return kind == "cpu"

    def versions(self) -> dict[str, str]:
        return {"numpy": np.__version__}

    def run(self, config, progress=None, weights=None) -> RunResult:
        if config.device != "cpu":
            raise AccumcheckError(f"--device {config.device}: the toy backend runs on the cpu only")
        case, steps, fault = config.case, config.accum_steps, config.fault
        weights = case.weights() if weights is None else weights
        specs = case.parameters()
        native = {p.name: np.zeros(p.shape, np.float32) for p in specs}
        manual = {p.name: np.zeros(p.shape, np.float32) for p in specs}
        exact = {p.name: np.zeros(p.shape) for p in specs}
        absum = {p.name: np.zeros(p.shape) for p in specs}
        injector = FaultInjector(fault, steps, round_to_bfloat16) if fault else None
        losses = []
        for step in range(steps):
            batch = case.batch(step)
            grads, loss = gradients(weights["linear.weight"], weights["linear.bias"], batch.inputs, batch.labels)
            losses.append(loss)
            for name, g in grads.items():
                if injector is not None and fault.param == name:
                    native[name] = native[name] + injector.contribution(step, g, native[name])
                    replaced = injector.after_add(step, native[name])
                    native[name] = native[name] if replaced is None else replaced
                else:
                    native[name] += g
                manual[name] += g
                exact[name] += g.astype(np.float64)
                absum[name] += np.abs(g.astype(np.float64))
        params = [ParamAccumulation(p.name, p.kind, native[p.name], manual[p.name], exact[p.name], absum[p.name])
                  for p in specs]
        return RunResult(params=params, framework="toy", versions=self.versions(), device="cpu", param_dtype="float32",
                         accum_dtype="float32", losses={"mean_loss": float(np.mean(losses))})


@pytest.fixture
def toy(tmp_path: Path) -> dict:
    """The case file, and an environment where the toy backend is an installed entry point."""
    return installed_backend(tmp_path, "toy", "test_toy_backend:ToyBackend", CASE)


def test_the_command_line_runs_it_and_its_faults_are_caught(toy, cli):
    clean = cli("compare", "--framework", "toy", "--case", toy["case"], env=toy["env"])
    assert clean.returncode == 0, clean.stderr
    assert "toy on cpu" in clean.stdout and "OK: all 2 tensors faithful" in clean.stdout
    assert f"reproduce: accumcheck compare --framework toy --device cpu --case {toy['case']}" in unwrapped(clean.stdout)
    faulty = cli("compare", "--framework", "toy", "--case", toy["case"], "--inject", "double-step", env=toy["env"])
    assert faulty.returncode == 1 and "FLAGGED 1 of 2 tensors: linear.weight (weight, diverged" in faulty.stdout
    roundoff = cli("compare", "--framework", "toy", "--case", toy["case"], "--inject", "roundoff", env=toy["env"])
    assert roundoff.returncode == 0, roundoff.stdout


def test_it_refuses_a_data_parallel_run_centrally(toy, cli):
    result = cli("compare", "--framework", "toy", "--case", toy["case"], "--world-size", "2", env=toy["env"])
    assert result.returncode == 2
    assert result.stderr.strip() == ("accumcheck: error: --world-size 2: not available with the toy backend "
                                     "(it runs in one process); use --framework torch")
    dtype = cli("compare", "--framework", "toy", "--case", toy["case"], "--dtype", "bfloat16", env=toy["env"])
    # the backends that do run bfloat16 are named (jax too, where installed)
    assert dtype.returncode == 2 and "--dtype bfloat16: not available with the toy backend; use --framework " \
        in dtype.stderr and "torch" in dtype.stderr.splitlines()[-1]


def test_the_pytest_plugin_runs_it(toy, pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", toy["env"]["PYTHONPATH"])
    pytester.makepyfile(f"""
        def test_toy(accum_compare, accum_framework, accum_steps):
            report = accum_compare({toy['case']!r})
            assert (report.framework, report.accum_steps, report.exit_code) == ("toy", accum_steps, 0)
            assert accum_compare({toy['case']!r}, inject="scale").exit_code == 1
    """)
    result = pytester.runpytest_subprocess("--accum-framework", "toy", "--accum-steps", "4,8", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*--accum-framework toy*", "*test_toy?N4-toy?*PASSED*"])


def test_the_python_api_runs_it(toy, monkeypatch):
    from accumcheck.run import registry

    monkeypatch.setattr(registry, "_registered", {})
    monkeypatch.setattr(registry, "_instances", {})
    accumcheck.register_backend(ToyBackend)
    report = accumcheck.compare(toy["case"], framework="toy", accum_steps=16)
    assert report.framework == "toy" and report.exit_code == 0 and [t.verdict for t in report.tensors] == [
        "identical", "identical"]
    faulty = accumcheck.compare(toy["case"], framework="toy", inject="drop-step:linear.bias")
    assert [t.name for t in faulty.flagged] == ["linear.bias"]
    with pytest.raises(AccumcheckError, match="--world-size 2: not available with the toy backend"):
        accumcheck.compare(toy["case"], framework="toy", world_size=2)
    with pytest.raises(AccumcheckError, match=r"^--memory-budget 1073741824: not available with the toy backend; "
                                              r"use --framework \S+"):
        accumcheck.compare(toy["case"], framework="toy", memory_budget="1G")  # it declares no groups
    with pytest.raises(AccumcheckError, match=r"--case tiny-grads: the toy backend builds no activation layers \(it "
                                              r"builds dense\); use a case without them or another --framework"):
        accumcheck.compare("tiny-grads", framework="toy")


def test_the_hand_written_gradient_is_right():
    rng = np.random.default_rng(0)
    weight, bias = rng.standard_normal((3, 5)).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    x, labels = rng.standard_normal((4, 5)).astype(np.float32), np.array([0, 2, 1, 2])
    grads, loss = gradients(weight, bias, x, labels)
    step = 1e-3
    for name, value in (("linear.weight", weight), ("linear.bias", bias)):
        numeric = np.zeros_like(value, np.float64)
        for index in np.ndindex(value.shape):
            for sign in (1, -1):
                moved = value.astype(np.float64).copy()
                moved[index] += sign * step
                w, b = (moved, bias) if name == "linear.weight" else (weight, moved)
                numeric[index] += sign * gradients(w.astype(np.float64), b.astype(np.float64), x.astype(np.float64),
                                                   labels)[1] / (2 * step)
        assert np.allclose(grads[name], numeric, atol=1e-4), name


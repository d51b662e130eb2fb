"""The bound's size, pinned end to end: micro-gradients chosen by hand, a perturbation of a known
multiple of the hand-computed bound, through the command line and the pytest plugin.

The ``handmade`` backend (defined here, installed as an entry point the way a package would be)
ignores the model: each micro-step it hands every element of ``linear.weight`` the gradient
(-1)^k and every element of ``linear.bias`` 0.25. Their sums are exact: E = 0 and S = N for the
weight, E = S = N/4 for the bias. Its native total of the weight's element (0, 0) is then moved
by ``HANDMADE_PERTURBATION`` times that element's bound. The bound, from the theory the
documentation states (Higham, eq. 4.4, for float32 and for E's float64, plus the flush-to-zero
allowance), is computed here by hand:

    bound = (gamma_{N-1}(2^-24) + gamma_{N-1}(2^-53)) * S + (N - 1) * 2^-126

Since E = 0, the perturbed float32 value carries the perturbation to a relative 2^-24, so the
reported ratio is the chosen multiple: 2 and 1.1 must be flagged, 0.9 and 0.5 must not. A bound
that is 10 % looser or tighter fails one of them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import installed_backend, linear_case

from accumcheck.run.backend import Backend, Capabilities
from accumcheck.run.results import ParamAccumulation, RunResult

CASE = linear_case("handmade", seed=0, accum_steps=16)


def hand_bound(steps: int, absum: float) -> float:
    k = steps - 1
    gamma32 = k * 2.0**-24 / (1 - k * 2.0**-24)
    gamma64 = k * 2.0**-53 / (1 - k * 2.0**-53)
    return (gamma32 + gamma64) * absum + k * 2.0**-126


class HandmadeBackend(Backend):
    name = "handmade"
    install = "it ships with its tests"
    capabilities = Capabilities(accum_dtypes=("float32",), layer_types=("dense",))

    def has_device(self, kind: str) -> bool:
        return kind == "cpu"

    def versions(self) -> dict[str, str]:
        return {"numpy": np.__version__}

    def run(self, config, progress=None, weights=None) -> RunResult:
        steps = config.accum_steps
        params = []
        for spec in config.case.parameters():
            native = np.zeros(spec.shape, np.float32)
            exact, absum = np.zeros(spec.shape), np.zeros(spec.shape)
            for k in range(steps):
                g = np.full(spec.shape, (-1.0) ** k if spec.kind == "weight" else 0.25, np.float32)
                native += g
                exact += g
                absum += np.abs(g)
            manual = native.copy()
            if spec.kind == "weight":
                index = (0,) * len(spec.shape)
                native[index] += np.float32(float(os.environ["HANDMADE_PERTURBATION"]) * hand_bound(steps, steps))
            params.append(ParamAccumulation(spec.name, spec.kind, native, manual, exact, absum))
        return RunResult(params=params, framework="handmade", versions=self.versions(), device="cpu",
                         param_dtype="float32", accum_dtype="float32")


@pytest.fixture
def handmade(tmp_path: Path) -> dict:
    return installed_backend(tmp_path, "handmade", "test_bound_tightness:HandmadeBackend", CASE)


MULTIPLES = {0.5: 0, 0.9: 0, 1.1: 1, 2.0: 1}  # perturbation in bounds: exit code


@pytest.mark.parametrize("steps", [16, 32])
def test_the_command_line_flags_past_the_bound_and_not_inside_it(handmade, cli, steps):
    for multiple, code in MULTIPLES.items():
        out = handmade["dir"] / f"{multiple}.json"
        result = cli("compare", "--framework", "handmade", "--case", handmade["case"], "--accum-steps", str(steps),
                     "--output", str(out), "--format", "json", env={**handmade["env"],
                                                                     "HANDMADE_PERTURBATION": str(multiple)})
        assert result.returncode == code, (multiple, result.stdout, result.stderr)
        tensors = {t["name"]: t for t in json.loads(out.read_text())["tensors"]}
        weight, bias = tensors["linear.weight"], tensors["linear.bias"]
        assert weight["ratio"] == pytest.approx(multiple, rel=1e-6)
        assert weight["verdict"] == ("diverged" if code else "round-off")
        assert weight["worst_index"] == [0, 0] and weight["worst_mode"] == "native"
        assert bias["verdict"] == "identical" and bias["ratio"] == 0.0


def test_the_plugin_flags_past_the_bound_and_not_inside_it(handmade, pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", handmade["env"]["PYTHONPATH"])
    pytester.makepyfile(f"""
        import os
        import pytest

        @pytest.mark.parametrize("multiple, flagged", {sorted(MULTIPLES.items())!r})
        def test_handmade(accum_compare, accum_steps, multiple, flagged, monkeypatch):
            monkeypatch.setenv("HANDMADE_PERTURBATION", str(multiple))
            report = accum_compare({handmade['case']!r})
            assert report.exit_code == flagged
            weight = report.tensors[0]
            assert weight.name == "linear.weight" and abs(weight.ratio - multiple) < 1e-6 * multiple
    """)
    result = pytester.runpytest_subprocess("--accum-framework", "handmade", "--accum-steps", "16,32")
    result.assert_outcomes(passed=8)

"""GradMonitor on sharded gradients (accumcheck.torch.shards): two ranks under torchrun (gloo on the
CPU), each running sharded_monitor_worker.py, an FSDP2 model and DeepSpeed ZeRO-1/2 engines (the
monitor clipping, or observing an engine that clips). Against an unsharded float64 copy of the model
holding the same weights, on the same global batch: per-parameter norms, total, clipped gradients and
the per-layer norm/min/max that rank 0's TensorBoard events hold; a gradient multiplied by 1e4 named
as dominating; event files under rank 0's log directory only, each logged step once; one collective
per monitored step (FSDP2: as many as torch's own clip_grad_norm_ on the DTensors) and no host read
at a normal step. The DeepSpeed cases skip where DeepSpeed does not import (they run in
ci/deepspeed.sh's environment); each torchrun job takes about 25 s on two cores.

Round-off bound: the model computes in float32, the reference in float64, so each figure differs by
the float32 round-off of the forward and backward passes (a few units of 2^-24 per operation through
five layers; about 1e-7 measured). ``BOUND`` = 1e-5, relative to the figure (norms, totals) or to
the layer's largest |gradient| (min, max, clipped gradients). A collective left out or reduced
wrongly is off by tens of percent (a rank's shards missing).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tensorboard")

WORKER = Path(__file__).with_name("sharded_monitor_worker.py")
BOUND = 1e-5
SCENARIOS = {"fsdp2": ("fsdp2",), "zero": ("zero1", "zero2", "zero1:observe", "zero2:observe")}
ALL = [*SCENARIOS["fsdp2"], *SCENARIOS["zero"]]
LOG_EVERY = 2  # the worker's
REPORTS = {"fsdp2": 5}  # the step whose gradient is spiked: the last one (6 steps; DeepSpeed: 4 boundaries)


def torchrun(out: Path, *scenarios: str) -> list[dict]:
    """The worker on two ranks; what each rank wrote, by rank."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
               str(out), *scenarios]
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                  "MASTER_PORT")}
    environment.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment, check=False)
    ranks = [json.loads(path.read_text()) if path.exists() else {} for path in (out / "rank-0.json",
                                                                                 out / "rank-1.json")]
    assert done.returncode == 0 and all(set(r) == set(scenarios) for r in ranks), done.stderr[-4000:]
    return ranks


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory):
    if not torch.distributed.is_available():
        pytest.skip("this torch has no torch.distributed")
    out = tmp_path_factory.mktemp("fsdp2")
    return out, torchrun(out, *SCENARIOS["fsdp2"])


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - not installed, or it fails to load: the ZeRO cases cannot run here
        pytest.skip(f"DeepSpeed does not import ({type(exc).__name__}: {exc}); these run where it is installed "
                    "(the environment ci/deepspeed.sh builds)")
    out = tmp_path_factory.mktemp("zero")
    return out, torchrun(out, *SCENARIOS["zero"])


@pytest.fixture(params=ALL)
def run(request):
    """(scenario, its log directories' parent, what rank 0 and rank 1 found)."""
    scenario = request.param
    out, ranks = request.getfixturevalue("fsdp2_runs" if scenario == "fsdp2" else "zero_runs")
    return scenario, out / scenario.replace(":", "-"), [r[scenario] for r in ranks]


def spiked(scenario: str) -> int:
    return REPORTS.get(scenario, 3)


def close(value: float, reference: float, scale: float | None = None) -> bool:
    return abs(value - reference) <= BOUND * (abs(reference) if scale is None else scale)


def test_per_layer_norm_min_max_in_rank_0s_tensorboard_equal_the_float64_reference(run):
    scenario, _, (first, _) = run
    scalars = first["scalars"]
    layers = first["steps"][0]["layers"]
    assert sorted(layers) == ["head", "layers.0", "layers.1", "layers.2", "proj"]
    logged = list(range(0, len(first["steps"]), LOG_EVERY))
    for layer in layers:
        for k, kind in enumerate(("grad_norm", "grad_min", "grad_max")):
            values = scalars[f"{kind}/{layer}"]
            assert [step for step, _ in values] == logged, (kind, layer)  # each logged step, written once
            for step, value in values:
                norm, low, high = first["steps"][step]["layers"][layer]
                reference = (norm, low, high)[k]
                assert close(value, reference, None if k == 0 else max(abs(low), abs(high))), \
                    (scenario, kind, layer, step, value, reference)
        for step, value in scalars[f"grad_absmax/{layer}"]:
            _, low, high = first["steps"][step]["layers"][layer]
            assert close(value, max(abs(low), abs(high))), (layer, step)


def test_every_rank_holds_each_parameters_global_norm_the_total_and_the_clipped_gradient(run):
    scenario, _, ranks = run
    for found in ranks:
        assert found["names"][:2] == ["layers.0.weight", "layers.0.bias"]  # the model's own names
        for step, entry in enumerate(found["steps"]):
            for name, norm, reference in zip(found["names"], entry["norms"], entry["ref_norms"]):
                assert close(norm, reference), (scenario, step, name, norm, reference)
            assert close(entry["total"], entry["ref_total"]), (scenario, step)
            expected = min(1.0, 1.0 / (entry["ref_total"] + 1e-6))  # max_norm 1, or the engine's gradient_clipping 1
            assert close(entry["coef"], expected), (scenario, step)
            if scenario.endswith("observe"):  # the engine clipped by the norm it computed: the monitor's
                assert close(entry["engine_total"], entry["total"]), (scenario, step)
            else:  # the monitor clipped the shards the optimizer then reads
                assert entry["clipped_error"] <= BOUND, (scenario, step, entry["clipped_error"])
    first, second = ([(s["norms"], s["total"], s["coef"]) for s in found["steps"]] for found in ranks)
    assert first == second  # the ranks agree exactly: each reduced the same gathered figures


def test_a_gradient_multiplied_by_1e4_is_named_as_dominating_on_every_rank(run):
    scenario, _, ranks = run
    step = spiked(scenario)
    for found in ranks:
        entry = found["steps"][step]
        names, reference = found["names"], entry["ref_norms"]
        assert names[reference.index(max(reference))] == "layers.1.weight"  # the spike took, in the reference too
        assert [report["step"] for report in found["reports"]] == [step]  # and no other step reported
        report = found["reports"][0]
        name, share, norm = report["entries"][0]
        assert name == "layers.1.weight" and share > 0.999
        assert close(norm, reference[names.index(name)]) and close(report["total"], entry["ref_total"])
        assert close(report["coef"], 1.0 / (entry["ref_total"] + 1e-6))


def test_event_files_exist_only_under_rank_0s_log_directory(run):
    _, folder, (first, second) = run
    assert len(first["files"]) == 1 and second["files"] == []
    assert (folder / "rank0").is_dir() and not (folder / "rank1").exists()


def test_a_writer_given_to_rank_0_alone_is_enough_and_one_given_elsewhere_alone_is_refused(fsdp2_runs):
    first, second = (found["fsdp2"]["writers"] for found in fsdp2_runs[1])
    assert first["kind"] == "Recorder" and first["tags"] == 3 * 5  # the default layers (the 3 blocks), 5 figures each
    assert second["kind"] == "_Discard"  # rank 1 logs the same step (the same collective) and writes nothing
    assert first["refused"] == second["refused"] == ("GradMonitor: sharded gradients are logged by rank 0; give "
                                                     "rank 0 the writer")


def test_one_collective_per_monitored_step_and_no_host_read_at_a_normal_step(run):
    scenario, _, ranks = run
    for found in ranks:
        for step, entry in enumerate(found["steps"]):
            logged = step % LOG_EVERY == 0
            assert entry["collectives"] == 1, (scenario, step, entry["ops"])
            assert entry["ops"] == ({"c10d._allgather_base_": 1} if logged else {"c10d.allreduce_": 1}), (step, entry)
            if not logged and step != spiked(scenario):
                assert entry["host_reads"] == 0, (scenario, step)
            if scenario != "fsdp2":  # a micro-step off the accumulation boundary: nothing at all
                assert entry["off_boundary"] == {"collectives": 0, "ops": {}, "host_reads": 0}
        if scenario == "fsdp2":  # torch's own clip_grad_norm_ on the DTensor gradients spends the same one
            assert found["torch_clip"]["collectives"] == 1
        elif not scenario.endswith("observe"):
            assert all(entry["engine_total"] is None for entry in found["steps"])  # the engine computed no norm


def test_the_round_off_bound_is_far_from_a_missing_rank():
    """Negative control for BOUND: one rank's half of a 16 x 16 gradient is ~30% of its norm."""
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(16, 16, generator=gen, dtype=torch.float64)
    assert not close(float(grad[:8].norm()), float(grad.norm()))
    assert math.isclose(float(grad.float().norm()), float(grad.norm()), rel_tol=BOUND)

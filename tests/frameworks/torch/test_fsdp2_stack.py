"""FSDP2 under accumcheck (accumcheck.torch.stacks.sharded): two ranks under torchrun (gloo on the CPU),
each running fsdp2_worker.py. A sharded gradient gathered whole; the float64 replica a sharded model is
judged against, computing as the unsharded model does and leaving the model as it was; refresh; the
MixedPrecisionPolicy read back; and the built-in case through ``accumcheck stack --stack fsdp2``:
faithful, a loss divided by N once more named as 1/N, a bfloat16 reduction as precision lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401
except ImportError:
    pytest.skip(f"torch {torch.__version__} has no FSDP2 (torch.distributed.fsdp.fully_shard)", allow_module_level=True)

from accumcheck.case.reading import resolve_case  # noqa: E402
from accumcheck.torch.casemodel import build_model  # noqa: E402

WORKER = Path(__file__).with_name("fsdp2_worker.py")
CASES = ["case", "case:loss-over-n", "case:bfloat16-reduce"]
SCENARIOS = ["sharded", "policy", *CASES]
TIMEOUT_S = 300


def _case_model_misses_swapped_parameters() -> bool:
    """Whether the built-in case's model keeps references to its parameters (CaseModel.canonical)
    that a parameter set on it, as fully_shard sets its sharded and unsharded ones, does not reach:
    such a model never uses FSDP2's parameters, and the built-in case through FSDP2 judges zeros."""
    case = resolve_case("padded-tokens")
    model = build_model(case, case.weights(), torch.float32, torch.device("cpu"))
    swapped = torch.nn.Parameter(model.p0.detach().clone())
    model.p0 = swapped
    return not any(p is swapped for p in model.canonical.values())


# fix pending in accumcheck/torch/casemodel.py: CaseModel.canonical read from the module at call time
case_model_stale = pytest.mark.xfail(_case_model_misses_swapped_parameters(), strict=True,
                                     reason="CaseModel.canonical holds the parameters fully_shard replaces")


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return env


CLI = ["stack", "--stack", "fsdp2", "--world-size", "2", "--accum-steps", "2", "--batches", "8",
       "--fault", "loss-over-n", "--format", "json"]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every scenario on two ranks in one torchrun job, beside ``accumcheck`` with ``CLI`` (its own
    torchrun job, run at the same time: both mostly wait on process start-up): what each rank found,
    by rank, and the CLI's finished process."""
    out = tmp_path_factory.mktemp("fsdp2")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
               str(out), *SCENARIOS]
    cli = subprocess.Popen([str(Path(sys.executable).with_name("accumcheck")), *CLI], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=environment())
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=environment())
        stdout, stderr = cli.communicate(timeout=TIMEOUT_S)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((out / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    for found in ranks:
        assert list(found) == SCENARIOS, done.stderr[-3000:]
    return ranks, subprocess.CompletedProcess(cli.args, cli.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def runs(jobs):
    return jobs[0]


def on_every_rank(runs, scenario):
    """The scenario's findings on both ranks, neither of which raised."""
    for found in runs:
        assert "error" not in found[scenario], found[scenario].get("traceback")
    return [found[scenario] for found in runs]


def test_a_sharded_gradient_is_gathered_whole(runs):
    for found in on_every_rank(runs, "sharded"):
        # the reduce-scattered shards, gathered: the unsharded model's gradient on both ranks' batches
        assert found["gradient_types"] == ["Tensor"]
        assert found["gradient_error"] < 1e-5  # float32 against float64
        assert found["plain_gradient_as_is"]


def test_the_replica_is_a_plain_float64_module_with_the_models_names_and_weights(runs):
    for found in on_every_rank(runs, "sharded"):
        assert found["names"] and found["plain_parameters"] and found["grads_none"] and found["classes"]
        assert found["fsdp_remains"] is False
        assert found["dtypes"] == ["torch.float64", "torch.int64"]  # the integer buffer stays an integer
        assert found["training"] and found["dropout"] == 0.25
        assert found["weights_error"] == 0 and found["buffers_error"] == 0  # float32 weights, exactly


def test_the_replica_computes_as_the_unsharded_model_in_one_process(runs):
    first, second = on_every_rank(runs, "sharded")
    assert first["replica_error"] <= 1e-12 and second["replica_error"] <= 1e-12
    # rank 0 ran it twice, rank 1 once: no collective in it
    assert (first["replica_forwards"], second["replica_forwards"]) == (18, 9)


def test_making_the_replica_leaves_the_model_as_it_was(runs):
    for found in on_every_rank(runs, "sharded"):
        assert found["model_as_found"]  # parameters, shards, gradients, classes, flags, FSDP states, hooks
        assert found["model_trains_on"]


def test_refresh_brings_the_replica_to_the_models_weights_now(runs):
    for found in on_every_rank(runs, "sharded"):
        assert found["refreshed_error"] == 0 and found["refreshed_dtypes"] == ["torch.float64"]
        assert found["refreshed_forward_error"] <= 1e-12


def test_the_mixed_precision_policy_is_read_back_where_set(runs):
    for found in on_every_rank(runs, "policy"):
        assert found == {"default": {}, "reduce-bf16": {"reduce_dtype": "bfloat16"},
                         "param-bf16-reduce-fp32": {"param_dtype": "bfloat16", "reduce_dtype": "float32"},
                         "submodule-fp16": {"param_dtype": "float16"}, "unsharded": {}}


def agreed(runs, scenario):
    first, second = on_every_rank(runs, scenario)
    assert first == second
    return first


@case_model_stale
def test_the_built_in_case_through_fsdp2_is_faithful(runs):
    found = agreed(runs, "case")
    assert found["exit"] == 0 and found["verdicts"] == ["faithful", "faithful"]
    assert found["windows"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # float32 shards against the float64 replica: round-off, not zero (zero: nothing was compared)
    assert all(0 < difference < 1e-5 for difference in found["differences"])


@case_model_stale
def test_a_loss_divided_by_n_once_more_is_the_factor_1_over_n(runs):
    found = agreed(runs, "case:loss-over-n")
    assert found["exit"] == 1 and found["verdicts"] == ["constant-factor", "constant-factor"]
    assert "applied = 0.500 x the window's gradient" in found["summary"] and "1/N (N = 2)" in found["summary"]


@case_model_stale
def test_a_bfloat16_reduce_dtype_is_precision_lost_in_the_reduction(runs):
    found = agreed(runs, "case:bfloat16-reduce")
    assert found["exit"] == 1 and found["verdicts"] == ["precision-loss", "precision-loss"]
    assert "precision lost in the reduction" in found["summary"] and "reduced in bfloat16" in found["summary"]


@case_model_stale
def test_the_cli_launches_fsdp2_on_two_ranks_and_names_the_factor(jobs):
    done = jobs[1]
    assert done.returncode == 1, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["stack"] == "fsdp2" and report["world_size"] == 2
    explanations = [step["result"]["explanation"] for step in report["steps"]]
    assert len(explanations) == 2 and all("1/N (N = 2)" in e for e in explanations), explanations

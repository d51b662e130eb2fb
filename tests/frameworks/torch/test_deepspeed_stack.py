"""The DeepSpeed stack check (accumcheck.integrations.deepspeed): two ranks under torchrun (gloo on
the CPU), each running deepspeed_worker.py; a loop over a DeepSpeed engine judged at every
accumulation boundary against its global window as one batch, every rank with the same verdicts,
the engine left as found. The ranks' ground truth (safe_get_full_grad against the float64 window,
no accumcheck code) is ci/ground_truth_deepspeed.py: 1e-7 of the gradient with factor 1 under ZeRO-1
and ZeRO-2 in float32. Run by ci/deepspeed.sh in a virtual environment of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from accumcheck.errors import AccumcheckError  # noqa: E402
from accumcheck.integrations import deepspeed as integration  # noqa: E402

WORKER = Path(__file__).with_name("deepspeed_worker.py")
SCENARIOS = ["user:1", "user:2", "user:2:variable", "user:1:bf16", "user:2:bf16", "user:1:raises", "user:2:raises",
             "case:1", "case:2", "case:1:rank-drops-micro-batch", "case:2:rank-drops-micro-batch",
             "case:1:rank-loss-scaled", "case:2:rank-loss-scaled", "case:2:loss-over-n", "case:2:micro-batch-mean",
             "case:2:bfloat16-reduce", "zero3"]


def torchrun(out: Path, *scenarios: str, **env: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """The worker on two ranks; what each rank wrote, by rank."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
               str(out), *scenarios]
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                  "MASTER_PORT")}
    environment.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **env})
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment)
    ranks = [json.loads(path.read_text()) if path.exists() else {} for path in (out / "rank-0.json", out / "rank-1.json")]
    return done, ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every scenario on two ranks, in one torchrun job (ZeRO-3's refusal last: it exits 2)."""
    done, ranks = torchrun(tmp_path_factory.mktemp("deepspeed"), *SCENARIOS)
    assert set(ranks[0]) == set(SCENARIOS), done.stderr[-3000:]
    return ranks


def on_every_rank(runs, scenario):
    """The scenario's result, which both ranks must hold alike (verdicts, windows, exit code)."""
    first, second = runs[0][scenario], runs[1][scenario]
    for key in ("exit", "verdicts", "windows", "summary", "error", "seen"):
        assert first.get(key) == second.get(key), (scenario, key)
    return first


@pytest.mark.parametrize("stage", [1, 2])
def test_a_users_loop_with_equal_micro_batches_is_faithful_and_the_engine_is_left_as_found(runs, stage):
    found = on_every_rank(runs, f"user:{stage}")
    assert found["exit"] == 0 and found["verdicts"] == ["faithful", "faithful"]
    assert found["windows"] == [list(range(8)), list(range(8, 16))]  # every rank's micro-batches, i x 2 + r
    assert max(found["largest"]) < 1e-6  # float32 against float64: ~1e-7, as the ground truth measures
    assert all(error <= bound for error, bound, _ in found["precision"])
    assert found["as_found"] and found["step"]  # weights, master weights, optimizer state, counters, lr, rng
    assert found["trained_after"] == 1  # the engine trains on from its first step
    assert any(f"ZeRO stage {stage}, gradient_accumulation_steps=4" in note for note in found["notes"])
    assert any("2 ranks (gloo)" in note for note in found["notes"])


@pytest.mark.parametrize("stage", [1, 2])
def test_the_built_in_case_through_deepspeed_is_faithful(runs, stage):
    found = on_every_rank(runs, f"case:{stage}")
    assert found["exit"] == 0 and found["verdicts"] == ["faithful", "faithful"]
    assert found["seen"] == 8 and found["windows"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_per_micro_batch_mean_over_different_lengths_is_a_mismatch(runs):
    found = on_every_rank(runs, "user:2:variable")
    assert found["exit"] == 1 and found["verdicts"] == ["mismatch", "mismatch"]
    assert "each micro-batch's mean loss is divided by N" in found["summary"]
    assert found["as_found"]


@pytest.mark.parametrize("stage", [1, 2])
def test_a_rank_that_drops_a_micro_batch_is_flagged(runs, stage):
    # ZeRO-1 never backwards it; ZeRO-2 reduces at every backward, so the rank backwards it times 0
    found = on_every_rank(runs, f"case:{stage}:rank-drops-micro-batch")
    assert found["exit"] == 1 and found["verdicts"] == ["mismatch", "mismatch"]


@pytest.mark.parametrize("stage", [1, 2])
def test_a_rank_whose_loss_is_doubled_is_named(runs, stage):
    found = on_every_rank(runs, f"case:{stage}:rank-loss-scaled")
    assert found["exit"] == 1 and found["verdicts"] == ["mismatch", "mismatch"]
    assert "the ranks do not scale their losses alike" in found["summary"] and "rank 1 2.00 x" in found["summary"]


def test_a_loss_divided_by_n_before_engine_backward_is_the_factor_1_over_n(runs):
    found = on_every_rank(runs, "case:2:loss-over-n")
    assert found["verdicts"] == ["constant-factor", "constant-factor"]
    assert "applied = 0.500 x the window's gradient" in found["summary"] and "1/N (N = 2)" in found["summary"]


def test_a_model_that_ignores_the_windows_item_count_is_a_mismatch(runs):
    found = on_every_rank(runs, "case:2:micro-batch-mean")
    assert found["exit"] == 1 and found["verdicts"] == ["mismatch", "mismatch"]


def test_a_bf16_reduction_is_precision_loss_in_the_reduction(runs):
    found = on_every_rank(runs, "case:2:bfloat16-reduce")
    assert found["verdicts"] == ["precision-loss", "precision-loss"] and found["exit"] == 1
    assert "precision lost in the reduction" in found["summary"]
    for error, float32_bound, bound in found["precision"]:
        assert float32_bound < error <= bound


@pytest.mark.parametrize("stage", [1, 2])
def test_a_bf16_engine_is_judged_against_its_dtypes_round_off(runs, stage):
    found = on_every_rank(runs, f"user:{stage}:bf16")
    assert found["verdicts"] == ["precision-loss", "precision-loss"]
    assert "summed in bfloat16, reduced in bfloat16, computed in bfloat16" in found["summary"]
    assert found["as_found"]


@pytest.mark.parametrize("stage", [1, 2])
def test_a_loop_that_raises_mid_window_leaves_the_engine_as_found(runs, stage):
    found = on_every_rank(runs, f"user:{stage}:raises")
    assert found["as_found"] and found["step"]
    # the unfinished window's gradient was discarded: a check from there is faithful
    assert found["verdicts"] == ["faithful"] and found["windows"] == [list(range(8))]


def test_zero_stage_3_is_refused_in_one_line(runs):
    found = on_every_rank(runs, "zero3")
    assert found["exit"] == 2 and found["error"].startswith("deepspeed.AccumulationCheck: ZeRO stage 3 partitions")


def test_a_rank_without_the_check_is_named(tmp_path):
    done, ranks = torchrun(tmp_path, "without-check", AGREE_TIMEOUT_S="5")
    assert done.returncode != 0
    error = ranks[0]["without-check"]["error"]
    assert ranks[0]["without-check"]["exit"] == 2
    assert error.startswith("deepspeed.AccumulationCheck: not every rank entered the check within 5 s")
    assert "Ranks 1 failed" in error


def test_what_is_not_an_engine_is_refused():
    with pytest.raises(AccumcheckError, match="expected the engine deepspeed.initialize returns, got Linear"):
        integration.AccumulationCheck(torch.nn.Linear(2, 2))


def test_a_fault_of_another_stack_is_refused():
    with pytest.raises(AccumcheckError, match="--fault step-per-micro-batch: not a fault the deepspeed stack runs"):
        integration.run_case("padded-tokens", 2, fault="step-per-micro-batch")
    with pytest.raises(AccumcheckError, match="--fault rank-loss-scaled: a fault of a data-parallel run"):
        integration.run_case("padded-tokens", 2, fault="rank-loss-scaled")

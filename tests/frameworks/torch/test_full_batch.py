"""Full-batch equivalence: the accumulated gradient against one backward over the whole batch."""

import pytest
from conftest import needs_torch, run_cli

import accumcheck
from accumcheck.case.definition import IGNORE_LABEL
from accumcheck.case.reading import builtin_case

pytestmark = needs_torch


def test_the_padded_case_pads_and_ignores():
    case = builtin_case("padded-tokens")
    counts = [int((case.batch(k).labels != IGNORE_LABEL).sum()) for k in range(8)]
    assert len(set(counts)) > 1  # micro-batches hold different numbers of tokens
    assert case.token_count(8) == sum(counts)


def test_a_per_micro_batch_mean_is_caught_as_semantic():
    report = accumcheck.compare("padded-tokens", full_batch=True, loss_reduction="mean")
    check = report.full_batch
    assert report.exit_code == 1 and report.semantic_mismatch
    assert report.flagged == []  # numerically every tensor is faithful: the mismatch is the loss's
    assert not check.equivalent and check.max_relative_difference > 1e-3
    case = builtin_case("padded-tokens")
    assert check.item_counts == [int((case.batch(k).labels != IGNORE_LABEL).sum()) for k in range(8)]
    # the factors of a weighting: each tensor its own, and no constant leaves a small residual
    assert not check.constant and check.matches is None and check.spread > 1e-3 and check.residual > 1e-2
    assert check.explanation.startswith("not a constant factor: per-tensor factors ")
    assert check.explanation.endswith(f"items per micro-batch: {min(check.item_counts)} to {max(check.item_counts)}")


def test_a_loss_summed_over_tokens_where_the_mean_is_meant_is_the_token_count_times_the_gradient():
    # No public option puts a built-in case off by a constant ("sum", "token_count" and a mean over equal
    # lengths agree; a mean over unequal lengths is a weighting): two real runs make the bug.
    import torch

    from accumcheck.judge import full_batch_verdict
    from accumcheck.run.results import FullBatchGap
    from accumcheck.torch import engine
    from accumcheck.torch.builtin import CaseSubject

    def full_batch_gap(case):
        subject = CaseSubject(case, case.weights(), torch.float32, torch.device("cpu"), 4)
        return engine.float64_pass(subject, *subject.float64_twin(), True, None).full_batch

    case = builtin_case("padded-tokens")
    summed = full_batch_gap(case.with_reduction("sum"))  # sums over tokens
    mean = full_batch_gap(case.with_reduction("token_count"))  # its full batch: the mean
    check = full_batch_verdict(FullBatchGap("mean", "1", summed.accumulated, mean.full, summed.item_counts), 4)
    assert check.constant and check.matches == "T" and check.spread < 1e-12 and check.residual < 1e-12
    assert check.factor == pytest.approx(case.token_count(4), rel=1e-12)
    assert f"matches T (T = {case.token_count(4)} items in the window)" in check.explanation


@pytest.mark.parametrize("reduction", ["token_count", "sum"])
def test_token_normalised_and_summed_losses_pass(reduction):
    report = accumcheck.compare("padded-tokens", full_batch=True, loss_reduction=reduction)
    assert report.exit_code == 0
    assert report.full_batch.max_relative_difference < 1e-12


def test_equal_lengths_make_the_mean_equivalent():
    report = accumcheck.compare("transformer-small", full_batch=True, accum_steps=4)
    assert report.exit_code == 0 and report.full_batch.equivalent


def test_cli_says_which_normalisation_and_that_it_is_semantic():
    result = run_cli("compare", "--case", "padded-tokens", "--full-batch")
    assert result.returncode == 1
    assert "full batch: loss 'mean'" in result.stdout and "SEMANTIC MISMATCH" in result.stdout
    assert "the accumulated gradient is not the full batch's" in result.stdout
    assert "numerically faithful): not a constant factor" in result.stdout
    assert "--full-batch --loss-reduction mean" in result.stdout  # the reproduce line


def test_mxnet_ignores_padding_the_same_way():
    pytest.importorskip("mxnet")
    cross = accumcheck.compare_frameworks("padded-tokens", accum_steps=4)
    assert all(not a.flagged for a in cross.agreement)

"""--full-batch on MXNet: the accumulated gradient against the whole window's, both in float64 on
MXNet, judged as PyTorch's are."""

import pytest
from conftest import run_cli

import accumcheck
from accumcheck.case.definition import IGNORE_LABEL
from accumcheck.case.reading import builtin_case
from accumcheck.judge import FACTOR_TOLERANCE, full_batch_verdict
from accumcheck.run.results import FullBatchGap

mx = pytest.importorskip("mxnet", reason="mxnet is not installed (pip install 'accumcheck[mxnet]')")
from accumcheck.mxnet import fullbatch  # noqa: E402

VERDICT = ("equivalent", "constant", "matches", "item_counts", "normalisation", "accumulated_scaled_by")


@pytest.mark.parametrize("reduction", ["mean", "token_count", "sum"])
def test_padded_tokens_gets_the_same_full_batch_verdict_in_both_frameworks(reduction):
    pytest.importorskip("torch")
    ours = accumcheck.compare("padded-tokens", framework="mxnet", full_batch=True, loss_reduction=reduction)
    theirs = accumcheck.compare("padded-tokens", framework="torch", full_batch=True, loss_reduction=reduction)
    assert ours.exit_code == theirs.exit_code == (1 if reduction == "mean" else 0)
    assert ours.semantic_mismatch == theirs.semantic_mismatch == (reduction == "mean")
    assert ours.flagged == []  # numerically faithful either way
    for field in VERDICT:
        assert getattr(ours.full_batch, field) == getattr(theirs.full_batch, field), field
    # The same gradients in float64 up to the kernels: MXNet's float64 GELU uses a float32-accurate erf
    # (docs/frameworks.md), which moves the factors by ~1e-9, far below any semantic difference.
    assert ours.full_batch.tensor_factors == pytest.approx(theirs.full_batch.tensor_factors, rel=FACTOR_TOLERANCE)
    assert ours.full_batch.explanation.split(":")[0] == theirs.full_batch.explanation.split(":")[0]
    assert "full batch mxnet float64" in ours.notes


def test_a_per_micro_batch_mean_over_unequal_lengths_is_caught_as_a_weighting():
    report = accumcheck.compare("padded-tokens", framework="mxnet", full_batch=True, loss_reduction="mean")
    check = report.full_batch
    assert not check.equivalent and check.max_relative_difference > 1e-3
    case = builtin_case("padded-tokens")
    assert check.item_counts == [int((case.batch(k).labels != IGNORE_LABEL).sum()) for k in range(8)]
    assert not check.constant and check.matches is None and check.spread > 1e-3
    assert check.explanation.startswith("not a constant factor: per-tensor factors ")


def test_a_loss_summed_over_tokens_where_the_mean_is_meant_is_caught_as_the_token_count():
    """Negative control with one constant: the accumulated gradient of a summed loss against the
    full batch of the token mean is T times it, and the check names T."""
    case, ctx = builtin_case("padded-tokens"), mx.cpu()
    summed, where = fullbatch.case_full_batch(case.with_reduction("sum"), case.weights(), 4, ctx, True, "cpu")
    mean, _ = fullbatch.case_full_batch(case.with_reduction("token_count"), case.weights(), 4, ctx, True, "cpu")
    assert where == "mxnet float64"
    check = full_batch_verdict(FullBatchGap("mean", "1", summed.accumulated, mean.full, summed.item_counts), 4)
    assert check.constant and check.matches == "T" and check.spread < 1e-12 and check.residual < 1e-12
    assert check.factor == pytest.approx(case.token_count(4), rel=1e-12)


@pytest.mark.parametrize("case, steps", [("transformer-small", 4), ("embed-attention", 4), ("tiny-grads", 8),
                                         ("shared-weight", 8)])
def test_clean_cases_are_equivalent(case, steps):
    """Positive control: equal lengths (or no padding) make every normalisation the full batch's."""
    report = accumcheck.compare(case, framework="mxnet", full_batch=True, accum_steps=steps)
    assert report.exit_code == 0 and report.full_batch.equivalent
    assert report.full_batch.max_relative_difference < 1e-12


def test_without_a_float64_kernel_pytorch_computes_it_and_the_report_says_so(monkeypatch):
    pytest.importorskip("torch")

    def no_kernel(*args, **kwargs):
        raise mx.base.MXNetError("Operator FullyConnected has no float64 kernel here\nmore")

    monkeypatch.setattr(fullbatch, "_on_mxnet", no_kernel)
    report = accumcheck.compare("padded-tokens", framework="mxnet", full_batch=True, loss_reduction="token_count")
    assert report.exit_code == 0 and report.full_batch.equivalent
    note = "full batch torch float64 (MXNet float64 failed: Operator FullyConnected has no float64 kernel here)"
    assert note in report.notes


def test_cli_judges_mxnet_full_batch_and_refuses_a_conditional_case():
    result = run_cli("compare", "--framework", "mxnet", "--case", "padded-tokens", "--full-batch",
                     "--accum-steps", "4")
    assert result.returncode == 1
    assert "full batch: loss 'mean'" in result.stdout and "SEMANTIC MISMATCH" in result.stdout
    assert "--framework mxnet" in result.stdout and "--full-batch --loss-reduction mean" in result.stdout
    refused = run_cli("compare", "--framework", "mxnet", "--case", "conditional-branch", "--full-batch")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1


def test_without_a_float64_kernel_the_oracle_is_pytorch_s_and_the_report_says_so(monkeypatch):
    pytest.importorskip("torch")
    from accumcheck.mxnet import builtin

    on_mxnet = accumcheck.compare("embed-attention", framework="mxnet", oracle=True, accum_steps=8)
    made = builtin.case_model

    def no_float64(case, weights, dtype, *args, **kwargs):
        if dtype == "float64":
            raise mx.base.MXNetError("Operator Embedding has no float64 kernel here\nmore")
        return made(case, weights, dtype, *args, **kwargs)

    monkeypatch.setattr(builtin, "case_model", no_float64)
    on_torch = accumcheck.compare("embed-attention", framework="mxnet", oracle=True, accum_steps=8)
    assert "oracle torch float64 (MXNet float64 failed: Operator Embedding has no float64 kernel here)" in on_torch.notes
    assert on_torch.exit_code == 0 and "oracle mxnet float64" in on_mxnet.notes
    # The same float64 model in the other framework: the oracle's errors agree far below float32's.
    for a, b in zip(on_mxnet.tensors, on_torch.tensors):
        assert b.oracle_err_native == pytest.approx(a.oracle_err_native, rel=1e-3)


def batch_norm_net():
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(8, in_units=6), mx.gluon.nn.BatchNorm(in_channels=8), mx.gluon.nn.Activation("relu"),
            mx.gluon.nn.Dense(3, in_units=8))
    net.initialize(mx.init.Xavier(), ctx=mx.cpu())
    return net


def batch_norm_batches():
    rng = __import__("numpy").random.default_rng(4)
    return [(mx.nd.array(rng.standard_normal((4, 6))), mx.nd.array(rng.integers(0, 3, 4))) for _ in range(4)]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_batch_norm_in_train_mode_is_named_and_the_rest_judged_on_running_statistics(reduction):
    """Train mode: each micro-batch normalised by its own statistics, the window by its own: the
    BatchNorm is named and, on its running statistics, the rest is equivalent (a mean loss divided
    by N: faithful, exit 0) or N x the window's (the loop said "sum": flagged, exit 1)."""
    loss = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    report = accumcheck.mxnet.check(batch_norm_net(), lambda out, y: loss(out, y).mean(), batch_norm_batches(), 4,
                                    full_batch=True, train_mode=True, loss_reduction=reduction)
    f = report.full_batch
    assert not f.equivalent and len(f.by_design) == 1 and f.by_design[0].startswith("BatchNorm '")
    assert f.rest is not None and f.rest.equivalent == (reduction == "mean")
    assert report.exit_code == (0 if reduction == "mean" else 1) and f.faithful == (reduction == "mean")
    if reduction == "sum":
        assert f.rest.matches == "N" and "still not" in f.explanation
    eval_mode = accumcheck.mxnet.check(batch_norm_net(), lambda out, y: loss(out, y).mean(), batch_norm_batches(), 4,
                                       full_batch=True, loss_reduction="mean")
    assert eval_mode.full_batch.equivalent and eval_mode.full_batch.by_design == []

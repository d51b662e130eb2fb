"""Modules that compute over the batch: a small CNN with BatchNorm, full_batch=True. In train mode
each micro-batch is normalised by its own statistics, so the window differs from one batch by
design: the check names the BatchNorm modules and judges the rest with them in eval mode.

Positive controls: train mode with the right normalisation (different by design, the rest
faithful, exit 0) and eval mode (equivalent). Negative control: train mode with the loop's loss
declared a sum while it is a mean (the rest is N x the window's: flagged, exit 1)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import accumcheck.torch  # noqa: E402
from accumcheck.render.wording import full_batch_line  # noqa: E402
from accumcheck.torch.bydesign import batch_level_modules, batch_statistics_off  # noqa: E402

N = 4


def cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 5),
                               torch.nn.BatchNorm1d(5, track_running_stats=True))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 5, (4,), generator=gen)) for _ in range(N)]


def cross_entropy(out, y):
    return torch.nn.functional.cross_entropy(out, y)


def test_batch_norm_in_train_mode_is_named_and_the_rest_is_faithful():
    report = accumcheck.torch.check(cnn(), cross_entropy, batches(), N, full_batch=True, train_mode=True)
    f = report.full_batch
    assert not f.equivalent and f.max_relative_difference > 1e-3  # the batch statistics differ, by design
    assert f.by_design == ["BatchNorm2d '1'", "BatchNorm1d '6'"] and f.rest is not None and f.rest.equivalent
    assert f.faithful and not report.semantic_mismatch and report.exit_code == 0
    assert "DIFFERENT BY DESIGN" in full_batch_line(report) and "with them in eval mode, equivalent" in f.explanation
    assert "loss normalisation" not in full_batch_line(report)


def test_batch_norm_in_eval_mode_is_equivalent():
    report = accumcheck.torch.check(cnn(), cross_entropy, batches(), N, full_batch=True)
    assert report.full_batch.equivalent and report.full_batch.by_design == [] and report.exit_code == 0


def test_a_wrong_normalisation_under_batch_norm_is_still_flagged_and_named():
    report = accumcheck.torch.check(cnn(), cross_entropy, batches(), N, full_batch=True, train_mode=True,
                                    loss_reduction="sum")
    f = report.full_batch
    assert f.by_design and not f.faithful and report.semantic_mismatch and report.exit_code == 1
    assert f.rest.constant and f.rest.matches == "N"
    assert "still not" in f.explanation and "matches N" in f.explanation


def test_the_modules_found_and_their_modes_put_back():
    model = cnn().train()
    model[6].track_running_stats = False  # normalises by the batch in eval mode too
    assert batch_level_modules(model) == ["BatchNorm2d '1'", "BatchNorm1d '6'"]
    with batch_statistics_off(model) as removed:
        assert not removed and batch_level_modules(model) == ["BatchNorm1d '6'"]
    assert model[1].training and model[6].training
    assert batch_level_modules(model.eval()) == ["BatchNorm1d '6'"]


class Classifier(torch.nn.Module):
    """The CNN as a Trainer meets a model: pixel values and labels in, a dict with the loss out."""

    def __init__(self, batch_norm: bool):
        super().__init__()
        self.net = cnn()
        if not batch_norm:  # the same network with its BatchNorm layers as identities
            self.net[1], self.net[6] = torch.nn.Identity(), torch.nn.Identity()

    def forward(self, pixel_values, labels=None):
        logits = self.net(pixel_values)
        return {"loss": cross_entropy(logits, labels), "logits": logits}


@pytest.mark.parametrize("batch_norm", [True, False])
def test_a_stack_step_that_differs_under_batch_norm_names_it_not_the_normalisation(tmp_path, batch_norm):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from accumcheck.integrations.transformers import check

    examples = [{"pixel_values": x[i], "labels": y[i]} for x, y in batches() for i in range(len(y))]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4,
                                          gradient_accumulation_steps=N, report_to="none", save_strategy="no",
                                          logging_strategy="no", use_cpu=True, disable_tqdm=True, num_train_epochs=1)
    report = check(transformers.Trainer(model=Classifier(batch_norm), args=args, train_dataset=examples))
    (step,) = report.steps
    if batch_norm:  # each micro-batch normalised by its own statistics: not judged, and said why
        assert step.verdict == "mismatch" and step.result.by_design == ["BatchNorm2d 'net.1'", "BatchNorm1d 'net.6'"]
        assert "by design" in step.result.explanation and "eval mode" in step.result.explanation
        assert "weighted unlike" not in step.result.explanation
    else:  # positive control: without BatchNorm the same Trainer is faithful
        assert step.verdict == "faithful" and step.result.by_design == []

"""The stack check's reference computed micro-batch by micro-batch (accumcheck.torch.stacks.reference):
each micro-batch's own mean loss weighted by its share of the window's items, summed in float64,
so that the reference never holds more than one micro-batch's activations.

Positive controls: a correct loop and a correct Trainer are faithful with it, and it is the joined
window's gradient to the tolerance the judge uses. Negative controls: the known faults are still
flagged with it (the loss not divided by N, each micro-batch's own mean over unequal lengths, a
head that ignores num_items_in_batch). What must not be split is not: BatchNorm, a summed loss, a
mixture of experts' router loss keep the window as one batch, and splitting them anyway gives a
wrong verdict. The memory claim: no forward of the reference sees more rows than a micro-batch.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from accumcheck.errors import AccumcheckError  # noqa: E402
from accumcheck.judge.fullbatch import FACTOR_TOLERANCE, SEMANTIC_TOLERANCE, largest_difference  # noqa: E402
from accumcheck.render.stackwords import stack_header_lines  # noqa: E402
from accumcheck.report import StackReport  # noqa: E402
from accumcheck.report.stack import JOINED, SPLIT  # noqa: E402
from accumcheck.torch import AccumulationCheck  # noqa: E402
from accumcheck.torch.stacks import recorder as recorder_module  # noqa: E402
from accumcheck.torch.stacks.reference import ReferencePlan  # noqa: E402

N = 4
ROWS = 3  # rows a micro-batch: more than the two a probe joins, fewer than a window's
VOCAB = 11


class TokenLM(torch.nn.Module):
    """Embedding and a linear head; its loss is the token mean over the labelled positions of the
    batch it is given, or the token sum over ``num_items_in_batch``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 6)
        self.head = torch.nn.Linear(6, VOCAB)
        self.rows_seen: list[int] = []
        self.register_forward_pre_hook(lambda m, args, kwargs: self.rows_seen.append(kwargs["input_ids"].shape[0]),
                                       with_kwargs=True)

    def forward(self, input_ids, labels=None, num_items_in_batch=None):
        logits = self.head(torch.tanh(self.emb(input_ids)))
        total = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100,
                                                  reduction="sum")
        return {"loss": total / (num_items_in_batch if num_items_in_batch is not None else (labels != -100).sum())}


def token_batches(count: int, variable: bool = True, seed: int = 1) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (ROWS, 8), generator=gen)
        labels = ids.clone()
        if variable:  # each row's own length: micro-batches hold different numbers of labelled tokens
            labels[torch.arange(8) >= torch.randint(1, 9, (ROWS, 1), generator=gen)] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def run_loop(fault=None, reference="auto", variable=True, windows=3, data=None):
    """A loop over N-micro-batch windows (of ``data`` where given). Correct: each micro-batch's token
    sum over its window's labelled tokens. "micro-batch-mean": each micro-batch's own mean / N;
    "not-divided": each micro-batch's own mean, not divided by N."""
    model = TokenLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = data or token_batches(N * windows, variable)
    windows = len(data) // N
    items = [sum(int((b["labels"] != -100).sum()) for b in data[w * N:(w + 1) * N]) for w in range(windows)]
    check = AccumulationCheck(model, opt, reference=reference)
    with check:
        for i, batch in enumerate(check.batches(data)):
            if fault is None:
                loss = model(**batch, num_items_in_batch=items[i // N])["loss"]
            else:
                loss = model(**batch)["loss"] / (N if fault == "micro-batch-mean" else 1)
            loss.backward()
            if (i + 1) % N == 0:
                opt.step()
                opt.zero_grad()
    return check, model


def windows(check):
    """The windows' reference gradients of a check (or of a recorder)."""
    return [w.window for w in getattr(check, "recorder", check).windows]


# ----------------------------------------------------------------- positive controls


def test_a_correct_loop_is_faithful_with_the_micro_batch_reference_equal_to_the_joined_one():
    split, _ = run_loop(reference="micro-batches")
    joined, _ = run_loop(reference="joined")
    auto, _ = run_loop()
    for check, reference in ((split, SPLIT), (joined, JOINED), (auto, SPLIT)):
        report = check.report
        assert [s.verdict for s in report.steps] == ["faithful"] * 3 and report.exit_code == 0
        assert {s.reference for s in report.steps} == {reference}
    assert split.report.steps[0].reference_note == ("each micro-batch's own loss weighted by its share of the "
                                                    "window's labelled items, summed in float64")
    for a, b in zip(windows(split), windows(joined)):  # float64: two summation orders of one sum
        assert largest_difference(a, b)[0] <= SEMANTIC_TOLERANCE
    assert joined.report.steps[0].reference_note == "reference='joined' asked"


def test_the_micro_batch_reference_sees_one_micro_batch_at_a_time():
    """The memory claim, counted: the largest batch any forward saw while the check ran (the loop's
    own forwards are micro-batches too) is one micro-batch's with the micro-batch reference, the
    window's with the joined one."""
    _, model = run_loop(reference="micro-batches")
    assert max(model.rows_seen) == ROWS
    _, model = run_loop(reference="joined")
    assert max(model.rows_seen) == N * ROWS


def test_the_report_says_which_reference_and_keeps_it_in_its_json():
    check, _ = run_loop(reference="auto")
    report = check.report
    lines = stack_header_lines(report)
    assert ("reference: micro-batch by micro-batch, the window's normalisation (each micro-batch's own loss weighted "
            "by its share of the window's labelled items, summed in float64) at every step") in lines
    again = StackReport.from_dict(report.to_dict())
    assert [(s.reference, s.reference_note) for s in again.steps] == [(s.reference, s.reference_note)
                                                                      for s in report.steps]
    # a report saved before the reference was said: every window was joined
    older = report.to_dict()
    for step in older["steps"]:
        del step["reference"], step["reference_note"]
    assert {s.reference for s in StackReport.from_dict(older).steps} == {JOINED}
    assert not any(line.startswith("reference:") for line in stack_header_lines(StackReport.from_dict(older)))


def test_a_reference_word_it_does_not_know_is_refused_when_loaded():
    from accumcheck.report import report_from_data

    data = run_loop(windows=1)[0].report.to_dict()
    data["steps"][0]["reference"] = "guessed"
    with pytest.raises(Exception, match="reference"):
        report_from_data(data)


def test_a_bad_reference_keyword_is_one_line():
    with pytest.raises(AccumcheckError, match="reference must be one of 'auto', 'joined', 'micro-batches'"):
        AccumulationCheck(TokenLM(), torch.optim.SGD(TokenLM().parameters(), lr=0.1), reference="split")


# ----------------------------------------------------------------- negative controls


def test_each_micro_batchs_own_mean_over_unequal_lengths_is_flagged_with_the_micro_batch_reference():
    report = run_loop("micro-batch-mean", reference="micro-batches")[0].report
    assert {s.reference for s in report.steps} == {SPLIT}
    assert {s.verdict for s in report.steps} == {"mismatch"} and report.exit_code == 1


def test_a_loss_not_divided_by_n_is_flagged_as_n_with_the_micro_batch_reference():
    report = run_loop("not-divided", reference="micro-batches", variable=False)[0].report
    assert {s.reference for s in report.steps} == {SPLIT}
    assert {s.verdict for s in report.steps} == {"constant-factor"}
    assert all(s.result.factor == pytest.approx(N, rel=FACTOR_TOLERANCE) for s in report.steps)


def probes_counted(monkeypatch) -> list[int]:
    """Each probe of two rows, counted (by the first row's micro-batch in its window)."""
    from accumcheck.torch.stacks import reference as reference_module

    calls, probe = [], reference_module._probe
    monkeypatch.setattr(reference_module, "_probe", lambda a, *rest: calls.append(a[0]) or probe(a, *rest))
    return calls


def test_once_a_window_shows_the_loss_a_mean_later_windows_are_split_on_that_finding(monkeypatch):
    """The probe runs on windows until one shows the loss to be a mean over labelled items; later
    windows are split on that finding without a probe of their own, to the joined reference's
    verdicts: a correct loop faithful at every step, a fault flagged at every step."""
    calls = probes_counted(monkeypatch)
    run_loop(windows=1)
    first = len(calls)  # the probes of the first window alone (the same micro-batches begin every run here)
    calls.clear()
    report = run_loop()[0].report
    assert [s.reference for s in report.steps] == [SPLIT] * 3 and report.exit_code == 0
    assert len(calls) == first >= 1  # only the first window was probed
    assert len({s.reference_note for s in report.steps}) == 1
    calls.clear()
    faulty = run_loop("micro-batch-mean")[0].report
    assert len(calls) == first
    assert [s.reference for s in faulty.steps] == [SPLIT] * 3
    assert [s.verdict for s in faulty.steps] == ["mismatch"] * 3 and faulty.exit_code == 1
    joined = run_loop("micro-batch-mean", reference="joined")[0].report
    assert [s.verdict for s in joined.steps] == ["mismatch"] * 3


def test_a_loss_that_is_no_mean_is_probed_at_every_window(monkeypatch):
    """No finding carries over where the probe found none: a summed loss is probed again at every
    window, and every window stays one batch."""
    calls = probes_counted(monkeypatch)
    net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    report = run_classifier(net, summed, divide=False).report
    assert {s.reference for s in report.steps} == {JOINED} and len(report.steps) == 2
    assert len(calls) == 2


# ----------------------------------------------------------------- what must not be split


def forced_split(monkeypatch):
    """The reference split whatever the window holds, each micro-batch's mean weighted by its rows'
    share (equal here): what the rules keep from happening."""
    def plan(choice, module, batches, *args, **kwargs):
        return ReferencePlan(True, "forced", tuple(1 / len(batches) for _ in batches))
    monkeypatch.setattr(recorder_module, "plan_reference", plan)


def run_classifier(model, loss_fn, divide, reference="auto"):
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(5)
    data = [(torch.randn(4, 5, generator=gen), torch.randint(0, 3, (4,), generator=gen)) for _ in range(2 * N)]
    check = AccumulationCheck(model, opt, loss_fn=loss_fn, reference=reference)
    with check:
        for i, (x, y) in enumerate(check.batches(data)):
            (loss_fn(model(x), y) / (N if divide else 1)).backward()
            if (i + 1) % N == 0:
                opt.step()
                opt.zero_grad()
    return check


def batch_norm_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def test_batch_norm_keeps_the_window_as_one_batch_and_splitting_it_would_misjudge(monkeypatch):
    mean = torch.nn.functional.cross_entropy
    check = run_classifier(batch_norm_net(), mean, divide=True)
    report = check.report
    assert {s.reference for s in report.steps} == {JOINED}
    assert report.steps[0].reference_note == "BatchNorm1d '1' computes over the batch"
    # the window's statistics are not its micro-batches': said as a difference by design
    assert {s.verdict for s in report.steps} == {"mismatch"}
    assert report.steps[0].result.by_design == ["BatchNorm1d '1'"] and "by design" in report.summary()
    with pytest.raises(AccumcheckError, match="reference='micro-batches'.*BatchNorm1d '1' computes over the batch"):
        run_classifier(batch_norm_net(), mean, divide=True, reference="micro-batches")
    forced_split(monkeypatch)
    split = run_classifier(batch_norm_net(), mean, divide=True)
    # split, the reference is the micro-batches' statistics, not the window's: the verdict would say
    # the step applied the window's gradient as one batch, and nothing of BatchNorm
    assert largest_difference(windows(split)[0], windows(check)[0])[0] > FACTOR_TOLERANCE
    assert {s.verdict for s in split.report.steps} == {"faithful"}


def summed(out, y):
    return torch.nn.functional.cross_entropy(out, y, reduction="sum")


def test_a_summed_loss_keeps_the_window_as_one_batch_and_splitting_it_would_flag_a_correct_loop(monkeypatch):
    """A loss summed over the window's items is accumulated right by summing the micro-batches'
    sums (no 1/N); as a mean over items it would be a factor N off."""
    net = lambda: torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))  # noqa: E731
    report = run_classifier(net(), summed, divide=False).report
    assert {s.reference for s in report.steps} == {JOINED} and report.exit_code == 0
    assert report.steps[0].reference_note.startswith("the loss of two rows together is not their losses weighted")
    forced_split(monkeypatch)
    report = run_classifier(net(), summed, divide=False).report
    assert {s.verdict for s in report.steps} == {"constant-factor"} and report.exit_code == 1


# ----------------------------------------------------------------- the Hugging Face Trainer


@pytest.fixture
def hf():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import test_transformers_models as models  # the models and data of the Trainer's model tests
    import test_transformers_stack as stack

    return models, stack


@pytest.fixture
def recorded(monkeypatch):
    """The recorders transformers.check makes, kept for their windows."""
    from accumcheck.integrations import transformers as integration

    made = []

    class Kept(integration.StackRecorder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(integration, "StackRecorder", Kept)
    return made


def test_a_correct_trainer_is_faithful_with_the_micro_batch_reference(tmp_path, hf, recorded):
    """Llama's RMSNorm computes in float32 whatever the model's dtype: the two references agree to
    the judge's FACTOR_TOLERANCE, not to float64's."""
    from accumcheck.integrations.transformers import check

    _, stack = hf
    split = check(stack.trainer_for(tmp_path / "a"), steps=3, reference="micro-batches")
    joined = check(stack.trainer_for(tmp_path / "b"), steps=3, reference="joined")
    assert [s.verdict for s in split.steps] == ["faithful"] * 3 and split.exit_code == 0
    assert {s.reference for s in split.steps} == {SPLIT} and {s.reference for s in joined.steps} == {JOINED}
    for a, b in zip(*(windows(r) for r in recorded)):
        assert largest_difference(a, b)[0] <= FACTOR_TOLERANCE


def test_labels_counted_before_the_shift_are_weighted_by_the_tokens_the_model_predicts(tmp_path, hf):
    """labels = input_ids: the model's own mean is over the labels after its shift, which the probe
    finds; transformers 4.57's count before the shift is still the factor it was."""
    from accumcheck.integrations.transformers import check

    _, stack = hf
    report = check(stack.trainer_for(tmp_path, data=stack.examples(first_label_masked=False)), steps=3,
                   reference="micro-batches")
    assert {s.reference_note for s in report.steps} == {"each micro-batch's own loss weighted by its share of the "
                                                        "window's predicted labels, summed in float64"}
    if stack.transformers.__version__ == "4.57.6":
        assert [s.result.matches for s in report.steps] == ["predicted/labelled"] * 3


def test_a_head_that_ignores_num_items_in_batch_is_flagged_with_the_micro_batch_reference(tmp_path, hf):
    """The reference is each micro-batch's own mean weighted by the window, never the head's
    handling of num_items_in_batch: the head that ignores it stays flagged."""
    from accumcheck.integrations.transformers import check

    models, _ = hf
    torch.manual_seed(0)
    trainer = models.trainer_for(tmp_path, models.KwargsBert(models.bert_config(num_labels=3)),
                                 models.sentences(14, label=True))
    report = check(trainer, reference="micro-batches")
    assert {s.reference for s in report.steps} == {SPLIT}
    assert [(s.verdict, s.result.matches) for s in report.steps] == [("constant-factor", "N"), ("constant-factor", "k")]


def test_a_router_loss_keeps_the_window_as_one_batch(tmp_path, hf):
    """A mixture of experts' load-balancing loss is computed over the batch: no split in auto, and
    a split asked for is refused, naming the term."""
    from accumcheck.integrations.transformers import check

    models, _ = hf
    report = check(models.trainer_for(tmp_path, models.tiny_mixtral(), models.causal(16), kind=models.RouterAveraged),
                   steps=2)
    assert {s.reference for s in report.steps} == {JOINED}
    assert report.steps[0].reference_note.startswith("the loss has additive terms of its own (router load-balancing")
    assert [s.verdict for s in report.steps] == ["batch-level", "batch-level"]
    with pytest.raises(AccumcheckError, match="reference='micro-batches'.*router load-balancing"):
        check(models.trainer_for(tmp_path, models.tiny_mixtral(), models.causal(16)), steps=1,
              reference="micro-batches")

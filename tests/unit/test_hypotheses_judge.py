"""What explains an applied gradient where its window's does not (accumcheck.judge.hypotheses and
the sentences of accumcheck.judge.fullbatch), from plain arrays with known answers: round-off
tensors left out of the factor, a model that ignores the window's item count, each micro-batch's
own mean accumulated, a loss's additive term added once per micro-batch or averaged, and modules
that compute over the batch. Each detection has its fault present (named) and absent (not)."""

from __future__ import annotations

import numpy as np
import pytest

from accumcheck.judge import FACTOR_TOLERANCE, full_batch_verdict
from accumcheck.judge.fullbatch import SIGNAL_FLOOR
from accumcheck.judge.hypotheses import combination
from accumcheck.judge.stack import judge_window, stack_report
from accumcheck.report import StackReport, load_report
from accumcheck.report.values import decode, encode
from accumcheck.run.results import FullBatchGap, Hypotheses, StackWindow, TermGradients

RNG = np.random.default_rng(11)


def gradients(scale=1.0):
    return {"embed.weight": scale * RNG.standard_normal((6, 4)), "attn.key.bias": scale * RNG.standard_normal(4),
            "head.weight": scale * RNG.standard_normal((4, 4))}


def plus(*parts, factors):
    return {name: sum(f * p[name] for f, p in zip(factors, parts)) for name in parts[0]}


def step(applied, window, micro_batches=4, hypotheses=None, counts=None):
    return judge_window(StackWindow(0, list(range(micro_batches)), applied, window, counts,
                                    hypotheses=hypotheses or Hypotheses()), 4)


# -- round-off tensors ------------------------------------------------------------------------------


def with_noise_key_bias(window, factor):
    """BERT's key bias: zero in exact arithmetic, float64 noise 1e-21 of the largest element."""
    window = dict(window, **{"attn.key.bias": 1e-21 * RNG.standard_normal(4)})
    applied = {name: factor * g for name, g in window.items()}
    applied["attn.key.bias"] = 1e-21 * RNG.standard_normal(4)  # its own noise: no factor at all
    return applied, window


def test_a_round_off_tensor_is_left_out_of_the_factor_and_named():
    applied, window = with_noise_key_bias(gradients(), 4.0)
    result = step(applied, window).result
    assert result.constant and result.matches == "N" and result.silent_tensors == ["attn.key.bias"]
    assert "attn.key.bias" not in result.tensor_factors and result.factor_worst_tensor != "attn.key.bias"
    assert "on all 2 tensors with signal (1 more is round-off, no factor: attn.key.bias)" in result.explanation


def test_a_small_tensor_with_signal_keeps_its_factor():
    """Negative control: a tensor 1e-5 of the largest is small, not round-off: its own factor is a finding."""
    window = dict(gradients(), **{"attn.key.bias": 1e-5 * RNG.standard_normal(4)})
    applied = {name: 4.0 * g for name, g in window.items()}
    applied["attn.key.bias"] = 3.0 * window["attn.key.bias"]
    result = step(applied, window).result
    assert not result.constant and result.silent_tensors == [] and result.factor_worst_tensor == "attn.key.bias"


def test_round_off_in_the_window_but_a_gradient_applied_is_a_finding():
    window = dict(gradients(), **{"attn.key.bias": 1e-21 * RNG.standard_normal(4)})
    applied = {name: 4.0 * g for name, g in window.items()}
    applied["attn.key.bias"] = np.full(4, 0.5)
    result = step(applied, window).result
    assert result.silent_tensors == [] and not result.constant and result.factor_worst_tensor == "attn.key.bias"


def test_the_signal_floor_lies_between_float64_noise_and_a_small_gradient():
    """Above what float64 leaves of a zero gradient (1e-13 of the scale after long sums) by the factor
    tolerance, so a factor is known where a tensor stands above it; below a small real gradient."""
    assert SIGNAL_FLOOR == pytest.approx(1e-13 / FACTOR_TOLERANCE) and SIGNAL_FLOOR < 1e-5


# -- a model that takes the window's item count but ignores it (transformers#47688) -----------------


def test_n_times_where_the_model_takes_the_item_count_is_the_ignored_item_count():
    window = gradients()
    told = step(plus(window, factors=[4.0]), window, hypotheses=Hypotheses(takes_item_count=True)).result
    assert told.matches == "N" and "transformers#47688" in told.explanation
    assert "model_accepts_loss_kwargs = False" in told.explanation
    short = step(plus(window, factors=[3.0]), window, micro_batches=3,
                 hypotheses=Hypotheses(takes_item_count=True)).result
    assert short.matches == "k" and "transformers#47688" in short.explanation
    # Negative controls: the same factor where the model does not take the count, and 1/N where it does.
    assert "#47688" not in step(plus(window, factors=[4.0]), window).result.explanation
    assert "#47688" not in step(plus(window, factors=[0.25]), window,
                                hypotheses=Hypotheses(takes_item_count=True)).result.explanation


def test_each_micro_batch_mean_summed_is_named_from_the_micro_batch_sum():
    """Masked LM: micro-batches with different numbers of masked tokens; applied = the sum of each
    micro-batch's own mean-loss gradient, which no constant times the window's explains."""
    window, micro_sum = gradients(), gradients()
    summed = step(dict(micro_sum), window, hypotheses=Hypotheses(micro_sum=micro_sum, takes_item_count=True)).result
    assert summed.micro_sum_factor == pytest.approx(1.0) and summed.micro_sum_residual < 1e-12
    assert "each micro-batch's own mean loss, summed over the window x 1.00" in summed.explanation
    assert "transformers#47688" in summed.explanation
    averaged = step(plus(micro_sum, factors=[0.25]), window,
                    hypotheses=Hypotheses(micro_sum=micro_sum, takes_item_count=False)).result
    assert "transformers#34191" in averaged.explanation and "does not accept num_items_in_batch" in averaged.explanation
    # Negative control: applied is neither; the micro-batch sum does not explain it and is not claimed.
    other = step(gradients(), window, hypotheses=Hypotheses(micro_sum=micro_sum)).result
    assert other.micro_sum_residual > 0.1 and "each micro-batch's own" not in other.explanation


# -- additive terms (a router load-balancing loss) ---------------------------------------------------


def router(main, term_window, term_sum, factors):
    """An applied gradient of main x a + term summed x b, with the hypotheses a check computed."""
    window = plus(main, term_window, factors=[1.0, 1.0])
    h = Hypotheses(main=main, terms={"router load-balancing loss": TermGradients(term_sum, term_window)})
    return plus(main, term_sum, factors=factors), window, h


def test_a_term_added_once_per_micro_batch_is_named_and_the_rest_judged_on_its_own():
    main, term_sum = gradients(), gradients(0.1)
    term_window = plus(term_sum, gradients(0.01), factors=[0.25, 1.0])  # batch-level: not the micro-batches' mean
    applied, window, h = router(main, term_window, term_sum, [1.0, 1.0])
    s = step(applied, window, hypotheses=h)
    assert s.verdict == "mismatch" and not s.result.batch_level
    assert s.result.main_factor == pytest.approx(1.0) and s.result.terms[0].factor == pytest.approx(1.0)
    assert s.result.terms[0].batch_level and s.result.terms_residual < 1e-12
    text = s.result.explanation
    assert "the rest of the loss is the window's" in text
    assert "router load-balancing loss is added once per micro-batch, not divided by the 4 micro-batches (4x" in text
    assert "computed over the batch by design" in text


def test_a_term_averaged_over_the_micro_batches_is_all_accumulation_can_do():
    """Positive control: the rest the window's, the batch-level term the micro-batches' mean."""
    main, term_sum = gradients(), gradients(0.1)
    term_window = plus(term_sum, gradients(0.01), factors=[0.25, 1.0])
    applied, window, h = router(main, term_window, term_sum, [1.0, 0.25])
    s = step(applied, window, hypotheses=h)
    assert s.verdict == "batch-level" and s.result.batch_level and s.result.faithful and not s.result.equivalent
    assert s.result.explanation.startswith("the window's gradient but for batch-level terms: the rest of the loss "
                                           "is the window's; the router load-balancing loss is the mean of the 4 ")
    report = stack_report("transformers", "Mixtral", 4, [StackWindow(0, [0, 1, 2, 3], applied, window,
                                                                     hypotheses=h)], 4, {})
    assert report.exit_code == 0 and report.flagged == []


def test_the_rest_scaled_and_a_term_matched_with_the_runs_numbers():
    main, term_sum = gradients(), gradients(0.1)
    term_window = plus(term_sum, gradients(0.01), factors=[0.25, 1.0])
    applied, window, h = router(main, term_window, term_sum, [0.25, 1.0])
    text = step(applied, window, hypotheses=h).result.explanation
    assert "the rest of the loss is 0.250 x the window's (matches 1/N" in text


def test_terms_that_explain_nothing_are_not_claimed():
    main, term_sum = gradients(), gradients(0.1)
    applied, window, h = router(main, term_sum, term_sum, [1.0, 1.0])
    s = step(gradients(), window, hypotheses=h)
    assert s.verdict == "mismatch" and s.result.terms_residual > 0.1
    assert "nor its rest of the loss plus its terms" in s.result.explanation


def test_combination_recovers_known_factors():
    a, b = gradients(), gradients()
    fit = combination(plus(a, b, factors=[0.7, -2.0]), [a, b])
    assert fit.factors == pytest.approx([0.7, -2.0]) and fit.residual < 1e-12
    assert combination(plus(a, b, factors=[1.0, 1.0]), [a, b], ["head.weight"]).residual < 1e-12


# -- modules that compute over the batch --------------------------------------------------------------


def gap(accumulated, full, hypotheses=None):
    return FullBatchGap("mean", "1/N", accumulated, full, hypotheses=hypotheses or Hypotheses())


def test_batch_norm_is_named_and_the_rest_judged_with_it_in_eval_mode():
    full, other = gradients(), gradients()
    rest_ok = gap(dict(full), full)
    result = full_batch_verdict(gap(other, full, Hypotheses(by_design=["BatchNorm2d 'bn1'"], rest=rest_ok)), 4)
    assert not result.equivalent and result.faithful and result.rest.equivalent
    assert result.explanation.startswith("by design: BatchNorm2d 'bn1' normalises each micro-batch by its own "
                                         "statistics") and "with it in eval mode, equivalent" in result.explanation
    # Negative control: with BatchNorm in eval mode the accumulated gradient is N x: a fault, named.
    rest_bad = gap(plus(full, factors=[4.0]), full)
    flagged = full_batch_verdict(gap(other, full, Hypotheses(by_design=["BatchNorm2d 'bn1'"], rest=rest_bad)), 4)
    assert not flagged.faithful and "still not" in flagged.explanation and "matches N" in flagged.explanation
    # Without a rest (a stack cannot rerun its step), the cause is said and nothing is passed.
    unjudged = step(other, full, hypotheses=Hypotheses(by_design=["BatchNorm1d 'norm'"]))
    assert unjudged.verdict == "mismatch" and "eval mode for the check" in unjudged.result.explanation


def test_the_new_fields_round_trip_and_a_report_reads_back(tmp_path):
    main, term_sum = gradients(), gradients(0.1)
    term_window = plus(term_sum, gradients(0.01), factors=[0.25, 1.0])
    applied, window, h = router(main, term_window, term_sum, [1.0, 0.25])
    report = stack_report("transformers", "Mixtral", 4, [StackWindow(0, [0, 1, 2, 3], applied, window,
                                                                     hypotheses=h)], 4, {})
    assert decode(StackReport, encode(report)) == report
    path = tmp_path / "r.json"
    path.write_text(report.to_json())
    assert load_report(str(path)).steps[0].verdict == "batch-level"
    full = gradients()
    result = full_batch_verdict(gap(gradients(), full, Hypotheses(by_design=["BatchNorm2d 'bn'"],
                                                                  rest=gap(dict(full), full))), 4)
    assert decode(type(result), encode(result)) == result

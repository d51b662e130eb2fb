"""A training stack's steps judged (accumcheck.judge.stack) and reported (StackReport), from
plain arrays: each verdict, the counts a run owes the user, and the lines that say them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from accumcheck.errors import AccumcheckError, NothingJudgedError
from accumcheck.judge.fullbatch import SEMANTIC_TOLERANCE
from accumcheck.judge.stack import Coverage, judge_window, stack_report
from accumcheck.render import render
from accumcheck.report import load_report, report_from_data
from accumcheck.run.results import StackWindow

RNG = np.random.default_rng(3)
F = {"embed.weight": RNG.standard_normal((6, 4)), "head.weight": RNG.standard_normal((4, 4)),
     "head.bias": RNG.standard_normal(4)}


def window(step, micro_batches, applied, counts=None):
    return StackWindow(step, list(micro_batches), applied, F, counts)


def times(c):
    return {name: c * f for name, f in F.items()}


def test_each_verdict_of_a_step():
    noise = {name: f * (1 + 1e-15 * RNG.standard_normal(f.shape)) for name, f in F.items()}
    assert judge_window(window(0, range(4), noise), 4).verdict == "faithful"
    assert judge_window(window(0, range(4), times(0.25)), 4).verdict == "constant-factor"
    weighted = {name: f * (1 + 0.1 * RNG.standard_normal(f.shape)) for name, f in F.items()}
    assert judge_window(window(0, range(4), weighted), 4).verdict == "mismatch"
    broken = {**F, "head.bias": np.full(4, np.nan)}
    assert judge_window(window(0, range(4), broken), 4).verdict == "non-finite"


def test_a_difference_past_the_tolerances_is_not_faithful():
    top = max(float(np.abs(f).max()) for f in F.values())
    inside = {**F, "head.bias": F["head.bias"] + np.array([0.5 * SEMANTIC_TOLERANCE * top, 0, 0, 0])}
    step = judge_window(window(0, range(4), inside), 4)
    assert step.verdict == "faithful" and step.result.explanation.endswith("within 1e-9")
    # Past 1e-9 but the window's gradient times 1 within 1e-6 on every tensor: float32 rounding
    # inside a float64 model (Llama's RMSNorm), still faithful, and the explanation says so.
    rounded = {**F, "head.bias": F["head.bias"] + np.array([3 * SEMANTIC_TOLERANCE * top, 0, 0, 0])}
    step = judge_window(window(0, range(4), rounded), 4)
    assert step.verdict == "faithful" and "float32" in step.result.explanation
    assert step.result.max_relative_difference > SEMANTIC_TOLERANCE
    worst = int(np.argmax(np.abs(F["head.bias"])))
    beyond = {**F, "head.bias": F["head.bias"] + np.eye(4)[worst] * 1e-5 * np.linalg.norm(F["head.bias"])}
    assert judge_window(window(0, range(4), beyond), 4).verdict != "faithful"


def test_a_short_window_is_judged_with_its_own_k():
    step = judge_window(window(2, [8, 9], times(0.5)), 4)
    assert step.result.matches == "k/N" and step.window_text == "8-9"
    assert judge_window(window(2, [8, 9], times(0.5)), 2).result.matches == "1/N"


def test_window_text_names_runs_and_gaps():
    assert judge_window(window(0, [5], F), 4).window_text == "5"
    assert judge_window(window(0, [0, 2, 3], F), 4).window_text == "0, 2, 3"


def report(windows, seen, expected=None):
    return stack_report("transformers", "Tiny", 4, windows, seen, {"transformers": "x"}, ["a note [with brackets]"],
                        "check(trainer)", micro_batches_expected=expected)


def test_a_faithful_run_exits_0_and_counts_what_it_checked():
    r = report([window(0, range(4), F), window(1, range(4, 8), F)], 8, 8)
    assert r.exit_code == 0 and r.unstepped == [] and r.never_ran == 0
    assert r.summary() == ("FAITHFUL: every optimizer step applied the gradient of its window as one batch "
                           "(2 optimizer steps checked, 8 micro-batches seen of the 8 the data holds)")
    assert report([window(0, [0], F)], 1).counts_text() == "1 optimizer step checked, 1 micro-batch seen"


def test_micro_batches_that_never_reach_a_step_fail_the_run():
    r = report([window(0, range(4), F)], 6)
    assert r.unstepped == [4, 5] and r.exit_code == 1
    assert r.summary().startswith("DROPPED BATCHES: 2 micro-batches (4, 5) never reached an optimizer step")


def test_micro_batches_the_stack_never_ran_fail_the_run():
    r = report([window(0, range(4), F), window(1, range(4, 8), F)], 8, 10)
    assert r.never_ran == 2 and r.exit_code == 1
    assert "2 of the data's 10 micro-batches never ran" in r.summary()
    assert report([window(0, range(4), F)], 4, 4).never_ran == 0


def test_the_first_flagged_step_leads_the_summary():
    r = report([window(0, range(4), F), window(1, range(4, 8), times(4.0))], 8)
    assert [s.verdict for s in r.steps] == ["faithful", "constant-factor"] and r.exit_code == 1
    assert r.summary().startswith("FLAGGED: 1 of 2 optimizer steps; step 1 (micro-batches 4-7): applied = "
                                  "4.00 x the window's gradient on all 3 tensors")


@pytest.mark.parametrize("fmt", ["table", "markdown", "json"])
def test_every_format_draws_it_and_json_reads_back(fmt, tmp_path):
    r = report([window(0, range(4), F), window(1, range(4, 8), times(0.25))], 9)
    text = render(r, fmt)
    if fmt == "json":
        back = report_from_data(json.loads(text))
        assert back == r and back.exit_code == 1
        (tmp_path / "r.json").write_text(text)
        assert load_report(tmp_path / "r.json").steps[1].result.matches == "1/N"
    else:
        assert "a note [with brackets]" in text and "0.250 (1/N)" in text
        assert "never stepped on: 1" in text


def test_an_empty_stack_report_is_refused():
    empty = dict(report([window(0, range(4), F)], 4).to_dict(), steps=[], micro_batches_seen=0)
    with pytest.raises(Exception, match="no optimizer steps and no micro-batches"):
        report_from_data(empty)


def coverage(steps=None, unrecorded=()):
    return Coverage(who="loop.Check", feed="check.feed(loader)", fix="iterate check.feed(loader)",
                    idle="the with block", idle_fix="run the loop inside it", optimizer_steps=steps,
                    unrecorded=list(unrecorded))


def test_a_run_that_judged_nothing_is_never_a_report():
    """No step checked and no micro-batch seen: refused, saying whether the stack stepped unseen or not at all."""
    with pytest.raises(NothingJudgedError) as stepped:
        stack_report("accelerate", "Tiny", 4, [], 0, {}, coverage=coverage(3, [0, 1, 2]))
    assert str(stepped.value) == ("loop.Check: the optimizer stepped 3 times but no micro-batch went through "
                                  "check.feed(loader), so nothing was judged; iterate check.feed(loader)")
    with pytest.raises(NothingJudgedError) as idle:
        stack_report("accelerate", "Tiny", 4, [], 0, {}, coverage=coverage(0))
    assert str(idle.value) == "loop.Check: the with block ran no optimizer step (0 micro-batches seen); run the loop " \
        "inside it"
    with pytest.raises(NothingJudgedError, match="ran no optimizer step"):
        stack_report("gluon", "Net", 4, [], 0, {})  # no coverage given: refused all the same


def test_micro_batches_with_no_step_are_a_finding_not_a_refusal():
    r = stack_report("accelerate", "Tiny", 4, [], 3, {}, coverage=coverage(0))
    assert r.exit_code == 1 and r.unstepped == [0, 1, 2] and r.summary().startswith("DROPPED BATCHES")


def test_steps_the_check_did_not_see_never_pass_and_never_hide_a_finding():
    seen = [window(0, range(4), F)]
    with pytest.raises(AccumcheckError) as refused:
        stack_report("accelerate", "Tiny", 4, seen, 4, {}, coverage=coverage(2, [1]))
    assert not isinstance(refused.value, NothingJudgedError)
    assert str(refused.value) == (
        "loop.Check: 1 of the 2 optimizer steps (step 1, counted from 0) had no micro-batch recorded since the step "
        "before and was not judged: micro-batches fed around check.feed(loader), or a second step on one window; "
        "iterate check.feed(loader), and step once per window")
    flagged = stack_report("accelerate", "Tiny", 4, [window(0, range(4), times(4.0))], 4, {},
                           coverage=coverage(3, [1, 2]))
    assert flagged.exit_code == 1 and flagged.summary().startswith("FLAGGED: 1 of 1 optimizer steps")
    assert flagged.notes[-1].startswith("2 of the 3 optimizer steps (steps 1, 2, counted from 0) had no micro-batch")
    assert stack_report("accelerate", "Tiny", 4, seen, 4, {}, coverage=coverage(1)).exit_code == 0


def test_a_step_carries_its_window_s_counts_and_what_it_was_compared_with():
    step = judge_window(StackWindow(0, [0, 1], times(57 / 65), F, [30, 35], [28, 29]), 2)
    assert step.result.item_counts == [30, 35] and step.result.matches == "predicted/labelled"
    assert step.result.normalisation == "the window as one batch" and step.result.accumulated_scaled_by == "1"


def test_a_report_keeps_its_reproduce_line_and_says_it_ran_in_float64():
    r = report([window(0, range(4), F)], 4)
    assert r.reproduce == "check(trainer)" and r.precision == "float64" and r.tolerance == SEMANTIC_TOLERANCE
    bare = stack_report("gluon", "Net", 4, [window(0, range(4), F)], 4, {})
    assert bare.reproduce == "" and bare.precision == "float64" and bare.notes == []


def test_a_step_is_told_in_a_stack_s_words():
    assert judge_window(window(0, range(4), F), 4).result.explanation == \
        "equivalent: applied = the window's gradient within 1e-9"
    assert judge_window(window(0, range(4), times(0.25)), 4).result.explanation == (
        "applied = 0.250 x the window's gradient on all 3 tensors (spread 0): matches 1/N (N = 4): the loss is "
        "divided by N once more than the loss normalisation needs")
    weighted = {name: f * (1 + 0.1 * RNG.standard_normal(f.shape)) for name, f in F.items()}
    assert "the micro-batches are weighted unlike one batch" in judge_window(window(0, range(4), weighted), 4) \
        .result.explanation

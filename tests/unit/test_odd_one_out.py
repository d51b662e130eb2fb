"""Three or more frameworks compared pair by pair (accumcheck.judge.agreement.odd_one_out), on
agreement records built by hand: the framework that alone disagrees with all the others is named,
disagreements that single out no one name no one, and reports saved before records were labelled
still say which pair each record compares."""

from __future__ import annotations

import itertools

import pytest

from accumcheck.judge.agreement import odd_one_out
from accumcheck.render.wording import cross_summary, forward_lines, odd_one_out_sentence, odd_one_out_sentences
from accumcheck.report import Agreement, CrossReport, ForwardAgreement, OddOneOut


def record(name: str, pair: list[str] | None, ratio: float = 0.5, verdict: str | None = None) -> Agreement:
    verdict = verdict or ("agree" if ratio <= 1 else "disagree")
    return Agreement(name=name, kind="weight", shape=[2], verdict=verdict, max_abs_diff=ratio * 1e-7,
                     max_abs_diff_index=[0], max_ulps=1.0, ratio=ratio, worst_index=[0], bound_at_worst=1e-7,
                     float32_err_a=1e-8, float32_err_b=1e-8, frameworks=pair)


def every_pair(frameworks: list[str], name: str, ratios: dict[frozenset, float]) -> list[Agreement]:
    """One tensor's records for every pair (i < j); a pair not in ``ratios`` agrees (ratio 0.5)."""
    return [record(name, [a, b], ratios.get(frozenset((a, b)), 0.5)) for a, b in itertools.combinations(frameworks, 2)]


THREE = ["torch", "mxnet", "jax"]


def test_all_agree_names_no_one():
    assert odd_one_out(THREE, every_pair(THREE, "w", {})) == []


@pytest.mark.parametrize("odd", THREE)
def test_the_one_that_disagrees_with_both_others_is_named(odd):
    others = [f for f in THREE if f != odd]
    records = every_pair(THREE, "w", {frozenset((odd, f)): 12.3 + i for i, f in enumerate(others)})
    records += every_pair(THREE, "b", {})
    (found,) = odd_one_out(THREE, records)
    assert (found.name, found.kind, found.framework, found.ratio) == ("w", "weight", odd, 13.3)
    assert sorted(map(sorted, found.disagreeing)) == sorted(sorted((odd, f)) for f in others)
    assert sorted(found.others()) == sorted(others)


def test_one_pair_disagreeing_while_each_agrees_with_the_third_singles_out_no_one():
    # torch and jax disagree, and each agrees with mxnet: the bound is not transitive, no one is odd
    (found,) = odd_one_out(THREE, every_pair(THREE, "w", {frozenset(("torch", "jax")): 3.0}))
    assert found.framework is None and found.disagreeing == [["torch", "jax"]] and found.ratio == 3.0
    assert odd_one_out_sentence(found) == ("torch vs jax disagree on w (worst ratio 3): "
                                           "no one framework disagrees with all the others")


def test_every_pair_disagreeing_singles_out_no_one():
    ratios = {frozenset(p): 5.0 for p in itertools.combinations(THREE, 2)}
    (found,) = odd_one_out(THREE, every_pair(THREE, "w", ratios))
    assert found.framework is None and len(found.disagreeing) == 3
    assert odd_one_out_sentence(found).startswith("torch vs mxnet, torch vs jax and mxnet vs jax disagree on w")


def test_two_against_two_singles_out_no_one_and_one_against_three_is_named():
    four = ["a", "b", "c", "d"]
    split = {frozenset(p): 4.0 for p in itertools.product("ab", "cd")}
    assert [o.framework for o in odd_one_out(four, every_pair(four, "w", split))] == [None]
    alone = {frozenset(("d", f)): 4.0 for f in "abc"}
    (found,) = odd_one_out(four, every_pair(four, "w", alone))
    assert found.framework == "d"
    assert odd_one_out_sentence(found) == "d disagrees with a, b and c on w (worst ratio 4)"


def test_a_non_finite_sum_in_one_framework_singles_it_out():
    records = [record("w", ["torch", "mxnet"]), record("w", ["torch", "jax"], float("nan"), "non-finite"),
               record("w", ["mxnet", "jax"], float("nan"), "non-finite")]
    assert [o.framework for o in odd_one_out(THREE, records)] == ["jax"]


def test_two_frameworks_single_out_no_one():
    assert odd_one_out(["torch", "mxnet"], [record("w", ["torch", "mxnet"], 9.0)]) == []


def cross(frameworks, agreement, odd=(), forward=None, rest=()) -> CrossReport:
    return CrossReport(frameworks=frameworks, reports=[], agreement=agreement, forward=forward, allowance=16.0,
                       forward_rest=list(rest), odd_one_out=list(odd))


def test_records_saved_unlabelled_compare_the_first_framework_with_each_other():
    # before records were labelled, three frameworks gave first-vs-second, then first-vs-third
    old = cross(THREE, [record(n, None) for n in ("w", "b")] * 2)
    assert old.pairs() == [["torch", "mxnet"]] * 2 + [["torch", "jax"]] * 2
    assert cross(THREE[:2], [record("w", None)]).pairs() == [["torch", "mxnet"]]
    fwd = ForwardAgreement(max_abs_diff=0.0, max_abs_logit=1.0, relative=0.0, in_float32_units=0.0, index=[0])
    assert forward_lines(cross(THREE[:2], [], forward=fwd))[0].startswith(
        "forward (logits of micro-batch 0), torch vs mxnet: max |difference| 0")


def test_the_summary_names_the_odd_one_and_says_when_no_one_is():
    named = OddOneOut(name="block0.ffn.weight", kind="weight", framework="jax",
                      disagreeing=[["torch", "jax"], ["mxnet", "jax"]], ratio=12.3)
    nobody = OddOneOut(name="out.bias", kind="bias", framework=None, disagreeing=[["torch", "jax"]], ratio=2.0)
    records = [record("block0.ffn.weight", ["torch", "jax"], 12.3), record("out.bias", ["torch", "jax"], 2.0),
               record("out.weight", ["torch", "jax"])]
    text = cross_summary(cross(THREE, records, odd=[named, nobody]))
    assert text.endswith("torch vs mxnet vs jax: DISAGREE on 2 of 3 tensors: "
                    "jax disagrees with torch and mxnet on block0.ffn.weight (worst ratio 12.3); "
                    "torch vs jax disagree on out.bias (worst ratio 2): no one framework disagrees with all the others")
    assert cross(THREE, [], odd=[named]).odd_frameworks == {"block0.ffn.weight": "jax"}


def test_one_framework_off_on_several_tensors_is_one_sentence():
    def odd(name, ratio):
        return OddOneOut(name=name, kind="weight", framework="mxnet", disagreeing=[["torch", "mxnet"], ["mxnet", "jax"]],
                         ratio=ratio)

    nobody = OddOneOut(name="out.bias", kind="bias", framework=None, disagreeing=[["torch", "jax"]], ratio=2.0)
    assert odd_one_out_sentences([odd("embed.weight", 460.0), nobody, odd("ln0.gamma", 533.0)]) == [
        "mxnet disagrees with torch and jax on 2 tensors (worst ratio 533 on ln0.gamma): embed.weight, ln0.gamma",
        "torch vs jax disagree on out.bias (worst ratio 2): no one framework disagrees with all the others"]

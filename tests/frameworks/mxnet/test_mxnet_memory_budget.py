"""--memory-budget on MXNet: both passes run once per group of tensors, and the report is the one
of the run judged at once, bit for bit, on every built-in case with a fault injected."""

import pytest

import accumcheck

pytest.importorskip("mxnet")
from budget_checks import assert_same_report, tightest  # noqa: E402

from accumcheck.case.reading import builtin_case_names  # noqa: E402
from accumcheck.errors import AccumcheckError  # noqa: E402
from accumcheck.options.choices import FAULT_KINDS

N = 8
CASES = builtin_case_names()
FAULTS = ("scale", "drop-step", "double-step", "bf16", "repeat-step", "roundoff")


def both(case, **options):
    options = {"case": case, "framework": "mxnet", "accum_steps": N, **options}
    return accumcheck.compare(**options), accumcheck.compare(**options, memory_budget=tightest(**options))


@pytest.mark.parametrize("case", CASES)
def test_every_case_with_a_fault_judged_in_groups_is_judged_as_at_once(case):
    assert_same_report(*both(case, inject=FAULTS[CASES.index(case) % len(FAULTS)]))


@pytest.mark.slow
@pytest.mark.parametrize("fault", [None, *FAULT_KINDS])
@pytest.mark.parametrize("case", CASES)
def test_every_case_and_fault_judged_in_groups_is_judged_as_at_once(case, fault):
    assert_same_report(*both(case, inject=fault))


def test_an_imperative_block_judged_in_groups_is_judged_as_at_once():
    assert_same_report(*both("transformer-small", hybridize=False, inject="double-step"))


def test_the_oracle_is_not_budgeted():
    with pytest.raises(AccumcheckError, match="--memory-budget 1.0 GiB: not with --oracle"):
        accumcheck.compare("tiny-grads", framework="mxnet", memory_budget="1G", oracle=True)

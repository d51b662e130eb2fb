"""What the second pass must say about each injected fault (shared by the framework tests)."""

import pytest

from accumcheck.judge.attribution import describe
from accumcheck.run.faults import SCALE_FACTOR

# fault kind -> (cause kind, whether it names the micro-step, the factor it must find)
EXPECTED = {
    "drop-step": ("drop-step", True, -1.0),
    "repeat-step": ("repeat-step", True, 1.0),
    "double-step": ("running-total", True, 1.0),
    "scale": ("scale-step", True, SCALE_FACTOR - 1.0),
    "bf16": ("narrow-dtype", False, None),
}


def assert_explained(tensor, fault, steps):
    """``tensor``'s cause is the injected ``fault``, at its micro-step (N // 2), with a fit of 1.
    Where other micro-steps have the same gradient (a case of periodic batches) the fault's reading
    must be the cause or one of the alternatives that fit as well."""
    kind, at_step, factor = EXPECTED[fault]
    cause = tensor.cause
    assert cause is not None and cause.mode == "native" and cause.residual_ratio <= 1 and cause.fit > 0.99, cause
    assert tensor.severity == "diverged"
    if cause.alternatives:
        expected = describe(kind, steps // 2 if at_step else None, factor or 0.0, "bfloat16")[0]
        assert expected in [cause.words, *cause.alternatives], (expected, cause)
        return
    assert cause.kind == kind, (fault, cause)
    if at_step:
        assert cause.step == steps // 2, cause
    if factor is not None:
        assert cause.factor == pytest.approx(factor, rel=1e-3), cause
    if fault == "bf16":
        assert cause.dtype == "bfloat16"

"""Every built-in case, in every installed framework, at the --accum-steps given (CI: 16,32)."""

import pytest

import accumcheck


def _known_bug(framework: str, case: str) -> bool:
    """MXNet before 1.7 has apache/mxnet#16708, which shared-weight exists to catch."""
    if framework != "mxnet" or case != "shared-weight":
        return False
    import mxnet

    return tuple(int(x) for x in mxnet.__version__.split(".")[:2]) < (1, 7)


def test_builtin_case_is_faithful(accum_case, accum_framework, accum_compare):
    report = accum_compare(accum_case)
    if _known_bug(accum_framework, accum_case):
        assert {t.name for t in report.flagged} >= {"shared.weight"}
        return
    accumcheck.assert_faithful(report)
    assert all(t.ratio <= 1.0 for t in report.tensors)
    for t in report.tensors:  # where the modes differ, the report says by how much
        if t.verdict == "round-off":
            assert t.max_ulps > 0 and t.mismatched > 0
    if accum_framework == "torch":  # one backward feeds both modes: the same bits
        assert all(t.verdict == "identical" for t in report.tensors)


def test_mxnet_imperative_is_faithful_too(accum_case, accum_steps):
    pytest.importorskip("mxnet")
    if _known_bug("mxnet", accum_case):
        pytest.skip("apache/mxnet#16708 in this mxnet")
    report = accumcheck.compare(accum_case, framework="mxnet", accum_steps=accum_steps, hybridize=False)
    assert report.settings["hybridize"] is False and "imperative" in report.notes
    accumcheck.assert_faithful(report)

"""Three or more frameworks on one case: every pair compared and labelled, and the framework that
alone disagrees with all the others on a tensor named, in every renderer and in a saved report.

The extra frameworks are torch under other names, registered here: a twin (the positive control:
it agrees with torch bit for bit) and backends whose sums of one tensor come out scaled by an
exact power of two, as a framework with a wrong gradient scale would give them (the negative
control: each is faithful on its own, only the comparison sees it)."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

import accumcheck
from accumcheck.assertions import failure_message
from accumcheck.render import FORMATS, render
from accumcheck.report import CrossReport, load_report
from accumcheck.run import registry

pytest.importorskip("torch")

from accumcheck.torch.backend import TorchBackend  # noqa: E402

CASE, TENSOR = "shared-weight", "shared.weight"
SENTENCE = f"odd disagrees with torch and twin on {TENSOR} (worst ratio "


def scaled(name: str, factor: float = 1.0, tensor: str = TENSOR) -> type:
    """torch as backend ``name``, its sums of ``tensor`` (native, manual, both float64 sums, and
    its magnitudes) multiplied by ``factor``: exact, so its own report is torch's own."""

    class Scaled(TorchBackend):
        def run(self, config, progress=None, weights=None):
            result = super().run(config, progress, weights)
            result.framework = self.name
            for p in result.params:
                if p.name == tensor and factor != 1.0:
                    for field in ("native", "manual", "exact", "absum", "oracle"):
                        value = getattr(p, field)
                        setattr(p, field, value * value.dtype.type(factor))
            return result

    Scaled.name = name
    return Scaled


@pytest.fixture(scope="module", autouse=True)
def backends():
    saved = dict(registry._registered), dict(registry._instances)
    for backend in (scaled("twin"), scaled("twin2"), scaled("odd", 2.0), scaled("odd4", 4.0)):
        accumcheck.register_backend(backend)
    yield
    registry._registered.clear()
    registry._registered.update(saved[0])
    registry._instances.clear()
    registry._instances.update(saved[1])


def compare(frameworks: str) -> CrossReport:
    return accumcheck.compare(CASE, framework=frameworks, accum_steps=8)


@pytest.fixture(scope="module")
def odd_report() -> CrossReport:
    return compare("torch,twin,odd")


def test_three_that_agree_name_no_one():
    cross = accumcheck.compare_frameworks(CASE, frameworks=("torch", "twin", "twin2"), accum_steps=8)
    assert cross.exit_code == 0 and cross.odd_one_out == [] and cross.odd_frameworks == {}
    assert [a.frameworks for a in cross.agreement] == (
        [["torch", "twin"]] * 4 + [["torch", "twin2"]] * 4 + [["twin", "twin2"]] * 4)
    assert cross.pairs() == [a.frameworks for a in cross.agreement]
    assert {a.verdict for a in cross.agreement} == {"identical"}
    assert cross.forward.frameworks == ["torch", "twin"]
    assert [f.frameworks for f in cross.forward_rest] == [["torch", "twin2"], ["twin", "twin2"]]
    assert render(cross, "table").count("forward (logits of micro-batch 0), ") == 3
    assert "torch vs twin vs twin2: all 4 tensors agree within the bound in every pair" in render(cross, "table")


@pytest.mark.parametrize("order", ["torch,twin,odd", "odd,torch,twin", "twin,odd,torch"])
def test_the_one_framework_off_is_named_on_exactly_its_tensor(order, odd_report):
    cross = odd_report if order == "torch,twin,odd" else compare(order)
    assert cross.exit_code == 1 and all(r.exit_code == 0 for r in cross.reports)
    assert cross.odd_frameworks == {TENSOR: "odd"}
    (odd,) = cross.odd_one_out
    assert odd.framework == "odd" and odd.ratio > 1e3 and sorted(odd.others()) == ["torch", "twin"]
    flagged = sorted((a.name, sorted(a.frameworks)) for a in cross.flagged)
    assert flagged == [(TENSOR, ["odd", "torch"]), (TENSOR, ["odd", "twin"])]


def test_disagreements_that_single_out_no_one_say_so():
    cross = compare("torch,odd,odd4")  # three different scales of one tensor: every pair disagrees
    assert cross.exit_code == 1 and cross.odd_frameworks == {}
    (odd,) = cross.odd_one_out
    assert (odd.name, odd.framework, len(odd.disagreeing)) == (TENSOR, None, 3)
    assert (f"torch vs odd, torch vs odd4 and odd vs odd4 disagree on {TENSOR} (worst ratio "
            in render(cross, "markdown"))
    assert "no one framework disagrees with all the others" in render(cross, "table")


def test_two_frameworks_are_labelled_and_otherwise_as_before():
    cross = compare("torch,twin")
    assert [a.frameworks for a in cross.agreement] == [["torch", "twin"]] * 4
    assert cross.forward.frameworks == ["torch", "twin"] and cross.forward_rest == [] and cross.odd_one_out == []
    assert "torch: OK; twin: OK; torch vs twin: all 4 tensors agree within the bound" in render(cross, "table")


def test_every_renderer_names_the_pairs_and_the_odd_one(odd_report):
    table, markdown, html = (render(odd_report, fmt) for fmt in ("table", "markdown", "html"))
    for text in (table, markdown, html, failure_message(odd_report)):
        assert SENTENCE in text
    assert any(line.split()[:4] == [TENSOR, "torch", "vs", "odd"] and "disagree" in line
               for line in table.splitlines())
    assert f"| `{TENSOR}` | twin vs odd | weight | **disagree** |" in markdown
    assert '<td class="text">twin vs odd</td>' in html
    assert f"{TENSOR} (weight), torch vs odd: disagree" in failure_message(odd_report)
    assert render(odd_report, "csv").count(TENSOR) == 3  # each framework's own rows


def test_a_saved_three_framework_report_loads_back_equal_and_shows(odd_report, tmp_path):
    path = tmp_path / "cross.json"
    path.write_text(render(odd_report, "json"))
    loaded = load_report(path)
    assert loaded == odd_report
    assert loaded.odd_one_out[0].framework == "odd" and loaded.agreement[-1].frameworks == ["twin", "odd"]
    shown = run_cli("show", str(path))
    assert shown.returncode == 1 and SENTENCE in " ".join(shown.stdout.split())  # wrapped to the terminal


def test_a_report_saved_before_the_labels_still_loads_and_renders(odd_report, tmp_path):
    data = json.loads(render(odd_report, "json"))
    # then: the first framework against each other, unlabelled; no other pairs, no odd one named
    data["agreement"] = [{k: v for k, v in a.items() if k != "frameworks"} for a in data["agreement"]
                         if a["frameworks"][0] == "torch"]
    for key in ("forward_rest", "odd_one_out"):
        del data[key]
    del data["forward"]["frameworks"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    old = load_report(path)
    assert [a.frameworks for a in old.agreement] == [None] * 8 and old.odd_one_out == []
    assert old.pairs() == [["torch", "twin"]] * 4 + [["torch", "odd"]] * 4 and old.exit_code == 1
    for fmt in FORMATS:
        assert render(old, fmt)
    assert f"DISAGREE on 1 of 4 tensors: {TENSOR} (weight, torch vs odd, " in render(old, "markdown")

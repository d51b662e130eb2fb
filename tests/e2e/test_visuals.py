"""Sweep, plots, report diff and the HTML report (opened in headless Chromium where it exists)."""

import json
import os
import shutil
import subprocess

import pytest
from conftest import needs_torch, run_cli

from accumcheck.api import sweep
from accumcheck.render.plots import figures, growth, save


@needs_torch
def test_sweep_growth_stays_below_the_bound_and_plots_are_written(tmp_path):
    out = tmp_path / "sweep.json"
    result = run_cli("sweep", "--case", "tiny-grads", "--accum-steps", "1,4,16,64,256", "--plot", str(tmp_path),
                     "--format", "json", "--output", str(out))
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["kind"] == "sweep" and [r["accum_steps"] for r in data["reports"]] == [1, 4, 16, 64, 256]
    for row in data["growth"]:
        for entry in row["kinds"].values():
            assert entry["native"] <= row["bound"] and entry["manual"] <= row["bound"]
    grown = [row["kinds"]["weight"]["native"] for row in data["growth"]]
    assert grown[-1] > grown[1] > 0  # round-off does grow with N
    names = sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".png", ".svg"))
    assert "tiny-grads-torch-sweep-growth.png" in names and "tiny-grads-torch-sweep-growth.svg" in names
    assert "tiny-grads-torch-N256-scatter.svg" in names
    shown = run_cli("show", str(out))
    assert "errors below the bound throughout" in shown.stdout


@needs_torch
def test_sweep_with_a_fault_flags_it_above_the_diagonal(tmp_path):
    result = sweep("tiny-grads", [1, 4, 16], inject="double-step")
    assert result.exit_code == 1
    assert {n for n, _ in result.flagged} == {4, 16}  # at N = 1 the fault cannot apply
    assert any("fault not injected" in note for note in result.reports[0].notes)
    last = result.reports[-1]
    hit = last.flagged[0]
    assert hit.name == "dense0.weight" and hit.ratio * hit.bound_at_worst > hit.bound_at_worst  # above y = x
    assert hit.ratio_map and max(max(row) for row in hit.ratio_map) > 1
    paths = save({**figures(last), "growth": growth(result.reports)}, tmp_path, "faulty")
    assert {p.name for p in paths} >= {"faulty-scatter.png", "faulty-heatmaps.png", "faulty-growth.svg"}


@needs_torch
def test_diff_names_the_tensors_whose_verdict_changed(tmp_path):
    clean, faulty = tmp_path / "clean.json", tmp_path / "faulty.json"
    assert run_cli("compare", "--case", "shared-weight", "--format", "json", "--output", str(clean)).returncode == 0
    assert run_cli("compare", "--case", "shared-weight", "--inject", "drop-step", "--format", "json",
                   "--output", str(faulty)).returncode == 1
    result = run_cli("diff", str(clean), str(faulty))
    assert result.returncode == 1
    assert "1 of 4 tensors changed verdict: shared.weight (identical -> diverged)" in result.stdout
    same = run_cli("diff", str(clean), str(clean), "--format", "markdown")
    assert same.returncode == 0 and "no verdict changed (4 tensors in both)" in same.stdout


def test_diff_of_a_file_that_is_not_a_report(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    result = run_cli("diff", str(bad), str(bad))
    assert result.returncode == 2 and "not an accumcheck report" in result.stderr


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@needs_torch
@pytest.mark.browser
def test_html_report_opens_in_a_headless_browser(tmp_path):
    if CHROMIUM is None:  # CI installs it and sets ACCUMCHECK_REQUIRE_BROWSER: there the test must run
        if os.environ.get("ACCUMCHECK_REQUIRE_BROWSER"):
            pytest.fail("Chromium is not installed, and ACCUMCHECK_REQUIRE_BROWSER says this test must run")
        pytest.skip("Chromium is not installed (apt-get install chromium)")
    page = tmp_path / "report.html"
    result = run_cli("compare", "--case", "shared-weight", "--inject", "double-step", "--format", "html",
                     "--output", str(page))
    assert result.returncode == 1
    text = page.read_text()
    assert "data:image/png;base64," in text and "<script" not in text  # self-contained, nothing to run
    common = [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run(common + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    for expected in ("FLAGGED 1 of 4 tensors", "shared.weight", "diverged", "Mismatched elements"):
        assert expected in dom.stdout
    assert dom.stdout.count("<img") == 2  # the scatter and the heatmaps
    shot = tmp_path / "shot.png"
    run = subprocess.run(common + ["--window-size=1300,1800", f"--screenshot={shot}", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and shot.stat().st_size > 20_000, run.stderr[-2000:]

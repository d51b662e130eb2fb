"""The figures the README and docs/ quote are the ones the runs give (ci/figures.py).

The default suite checks the markers and the benchmark figures (read from the committed results);
the runs themselves are `slow` (`pytest -m slow`, which CI runs): each group of runs this
environment can make is regenerated and compared with the text, figure by figure.
"""

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("figures", ROOT / "ci" / "figures.py")
figures = importlib.util.module_from_spec(spec)
spec.loader.exec_module(figures)


def test_every_marker_names_a_figure_a_group_makes():
    assert figures.unknown_marks() == []
    names = [name for _, name, _ in figures.marks()]
    assert len(names) >= 30  # README and docs quote their figures through markers
    for path in figures.TEXTS:  # no marker left open or closed twice
        text = path.read_text()
        assert text.count("<!--fig ") == text.count("<!--/fig-->") == len(figures.MARK.findall(text)), path
        # A comment that starts a line starts an HTML block in Markdown and would cut its paragraph in
        # two: an inline figure never starts a line (a block figure's marker stands alone on its line).
        for number, line in enumerate(text.splitlines(), 1):
            if line.lstrip().startswith("<!--fig "):
                assert line.rstrip().endswith("-->"), f"{path.name}:{number}: an inline figure starts the line"


def test_the_benchmark_and_mutation_figures_are_those_of_the_committed_results():
    assert figures.check(figures.regenerate(["benchmarks", "mutation"])) == []


def test_an_edited_figure_is_caught(tmp_path, monkeypatch):
    """Negative control: one figure changed by a digit in a copy of the text fails the check."""
    copies = []
    for path in figures.TEXTS:
        copy = tmp_path / path.name
        shutil.copy(path, copy)
        copies.append(copy)
    monkeypatch.setattr(figures, "TEXTS", copies)
    monkeypatch.setattr(figures, "ROOT", tmp_path)
    path, name, text = next(mark for mark in figures.marks() if mark[1] == "torch.sweep.n256")
    generated = {"torch": {name: text}}
    assert figures.check(generated) == []
    path.write_text(path.read_text().replace(f"<!--fig {name}-->{text}<!--/fig-->", f"<!--fig {name}-->{text}1<!--/fig-->"))
    assert figures.check(generated) == [f"{path.name}: {name}: the text says {text + '1'!r}, a run gives {text!r}"]


def test_a_console_block_compares_timings_loosely():
    assert figures.compare_text("accumcheck 0.1.0 torch 2.13.0 · 2.46s", "accumcheck 0.1.0 torch 2.13.0 · 8.31s")
    assert not figures.compare_text("ratio 0.105 · 2.46s", "ratio 0.106 · 2.46s")


def test_the_baseline_kernels_override_what_the_machine_already_set(monkeypatch):
    # Some machines set OPENBLAS_CORETYPE for their CPU (Haswell on an AMD EPYC that OpenBLAS does
    # not know): the figures' runs must still get the baseline kernels, or their round-off moves.
    for name in figures.BASELINE_KERNELS:
        monkeypatch.setenv(name, "Haswell")
    figures.hold_kernels()
    assert {name: os.environ[name] for name in figures.BASELINE_KERNELS} == figures.BASELINE_KERNELS


RUNS = [name for name in figures.GROUPS if name not in ("benchmarks", "mutation")]


@pytest.mark.slow
@pytest.mark.parametrize("group", RUNS)
def test_the_text_quotes_what_the_runs_give(group):
    # The figures are made on the libraries' baseline kernels; a process that loaded a framework
    # before this test (more than this file collected) keeps its CPU's own kernels and may differ.
    figures.hold_kernels()
    fn, needs = figures.GROUPS[group]
    if not figures.can_run(needs):
        pytest.skip(f"the {group} figures need {needs}")
    assert figures.check({group: fn()}) == []

"""What a written reproduction script must do, for any framework (shared by the framework tests):
run in a subprocess, exit as accumcheck's verdict says, name the flagged tensors, hand back the
very gradients accumcheck's run computed, and quote its ratios to 3 significant digits."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np

from accumcheck import api
from accumcheck.judge import build_report
from accumcheck.run.registry import get_backend
from accumcheck.run.validation import configure

STDLIB = {"argparse", "math", "os", "sys", "pathlib"}

# A case file with what generated code must survive: a name with a space, layer names with '-',
# quotes and a backslash in the description, a conditional branch inside a block, attention with
# biases and an output layer tied to the embedding.
ODD_CASE = r'''name = "odd names"
description = "Odd: \"\"\" triple quotes, a back\\slash"
seed = 7
accum_steps = 4

[input]
kind = "tokens"
vocab = 11
seq_len = 5
min_len = 2
batch_size = 3

[[layers]]
type = "embedding"
name = "tok-embed"
dim = 8

[[layers]]
type = "block"
name = "blk"
body = [
  { type = "residual", name = "res", body = [ { type = "attention", name = "att", heads = 2, bias = true },
                                             { type = "activation", name = "g", fn = "gelu" } ] },
  { type = "conditional", name = "cond", every = 2, body = [ { type = "dense", name = "ffn-in", units = 8, bias = false },
                                                            { type = "activation", name = "t", fn = "tanh" } ] },
]

[[layers]]
type = "tied_output"
name = "head"
tie = "tok-embed"
'''


def write_case_script(folder: Path, framework: str, case: str, inject: str | None = None,
                      steps: int | None = 4, **options):
    """accumcheck's run of ``case`` (its RunResult and Report), and its script written into
    ``folder`` as repro.py through ``accumcheck.api.write_repro``."""
    config = configure({"case": case, "framework": framework, "accum_steps": steps, "inject": inject, **options})
    result = get_backend(framework).run(config)
    report = build_report(config.case, result, config.accum_steps, config.fault, False, 0.0, config.record())
    files = api.write_repro(report, config, folder / "repro.py")
    return config, result, report, files


def run_script(script: Path, *args: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    """The script run as a user runs it, from another folder."""
    return subprocess.run([python, str(script), *args], capture_output=True, text=True, timeout=600,
                          cwd=script.parent.parent)


def imported_modules(script: Path) -> set[str]:
    tree = ast.parse(script.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add((node.module or "").split(".")[0])
    return found


def assert_reproduces(folder: Path, framework: str, case: str, inject: str | None = None,
                      steps: int | None = 4, **options) -> subprocess.CompletedProcess:
    """The script of ``case`` exits 1 exactly where accumcheck flagged a tensor (naming each one),
    its native (and manual, E, S) totals are accumcheck's bit for bit, and its ratios are the
    report's to 3 significant digits."""
    config, result, report, files = write_case_script(folder, framework, case, inject, steps, **options)
    assert files.script.is_file() and files.data.is_file() and not files.case.exists()
    assert imported_modules(files.script) <= STDLIB | {"numpy", framework}
    saved = folder / "grads.npz"
    run = run_script(files.script, "--save", str(saved))
    assert "Traceback" not in run.stderr, run.stderr
    expected = 1 if report.flagged else 0
    assert run.returncode == expected, (run.stdout, run.stderr)
    assert ("DIVERGED:" if expected else "AGREE:") in run.stdout
    for tensor in report.flagged:
        assert tensor.name in run.stdout
    grads = np.load(saved)
    for p in result.params:
        for mode in ("native", "manual", "exact", "absum"):
            mine, theirs = grads[f"{mode}/{p.name}"], getattr(p, mode)
            assert mine.dtype == theirs.dtype and np.array_equal(mine, theirs), (case, p.name, mode)
    for t in report.tensors:
        native, manual = grads[f"ratio/{t.name}"]
        assert f"{native:.3g}" == f"{t.ratio_native:.3g}" and f"{manual:.3g}" == f"{t.ratio_manual:.3g}", t.name
    if inject is not None and config.fault.kind != "roundoff":  # roundoff: the control that stays within
        assert report.flagged and config.fault.param in run.stdout
    return run

import importlib.util
import os
import re
import signal
import subprocess
import sys

import pytest
from hypothesis import settings

pytest_plugins = ["pytester"]

# The default suite runs a bounded number of examples per property; `--hypothesis-profile thorough`
# runs at least 10,000 each.
settings.register_profile("default", max_examples=200, deadline=None)
# Hypothesis loads its "ci" profile where CI is set: the same 200 examples, derandomized (a run in CI
# replays exactly), with no example database.
settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True, database=None)
settings.register_profile("thorough", max_examples=10_000, deadline=None)

HAS_TORCH = importlib.util.find_spec("torch") is not None


# The signals a run ends on: their handlers are the host program's, left as found by every test (a
# handler left behind would change what the next test's Ctrl-C does).
ENDING = [getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)]


@pytest.fixture(autouse=True)
def _signal_handlers_as_found():
    before = {signum: signal.getsignal(signum) for signum in ENDING}
    yield
    changed = [signal.Signals(signum).name for signum, handler in before.items() if signal.getsignal(signum) != handler]
    for signum, handler in before.items():
        signal.signal(signum, handler)
    assert not changed, f"the test left the handler of {', '.join(changed)} changed"


def run_cli(*args: str, cwd=None, timeout: float = 300, env=None, columns: int = 120) -> subprocess.CompletedProcess:
    """Run the installed ``accumcheck`` console script (through this interpreter's environment),
    its output piped and fitted to ``columns`` (COLUMNS set: a process that loaded readline, as
    pytest does, passes its own terminal's width on to its children otherwise)."""
    exe = os.path.join(os.path.dirname(sys.executable), "accumcheck")
    env = {**(os.environ if env is None else env), "COLUMNS": str(columns)}
    return subprocess.run([exe, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env)


def unwrapped(output: str) -> str:
    """The output with each command split between its options (`` \\`` and an indented next line)
    joined again: a reproduce line as one line, however long its paths made it."""
    return re.sub(r" \\\n +", " ", output)


needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed (pip install 'accumcheck[torch]')")


@pytest.fixture
def cli():
    return run_cli


def linear_case(name: str, seed: int, accum_steps: int) -> str:
    """A case file: one dense layer of 3 units on 5 features, batches of 4."""
    return f"""
name = "{name}"
seed = {seed}
accum_steps = {accum_steps}

[input]
kind = "features"
features = 5
batch_size = 4

[[layers]]
type = "dense"
name = "linear"
units = 3
"""


def installed_backend(tmp_path, name: str, target: str, case: str) -> dict:
    """A case file and an environment where ``target`` (module:Class, importable from the test's
    folder) is an installed ``accumcheck.backends`` entry point named ``name``, as a package's
    dist-info folder on PYTHONPATH would make it."""
    from pathlib import Path

    (tmp_path / f"{name}.toml").write_text(case)
    info = tmp_path / f"{name}_backend-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}-backend\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[accumcheck.backends]\n{name} = {target}\n")
    tests = Path(__file__).resolve().parent
    folder = tests / "e2e"
    path = os.pathsep.join([str(tmp_path), str(folder), str(tests), os.environ.get("PYTHONPATH", "")])
    return {"case": str(tmp_path / f"{name}.toml"), "env": {**os.environ, "PYTHONPATH": path}, "dir": tmp_path}


def pytest_terminal_summary(terminalreporter):
    """One line that says whether the browser test ran (CI's log shows it, not just a count)."""
    for outcome in ("passed", "failed", "skipped"):
        for report in terminalreporter.stats.get(outcome, []):
            if "browser" in getattr(report, "keywords", {}) and (report.when == "call" or outcome == "skipped"):
                reason = f" ({report.longrepr[2]})" if outcome == "skipped" and isinstance(report.longrepr, tuple) else ""
                terminalreporter.write_line(f"HTML report in headless Chromium: {report.nodeid} {outcome}{reason}")

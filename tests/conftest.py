import importlib.util
import os
import re
import signal
import subprocess
import sys


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# The suite runs in parallel (pytest-xdist, one worker per core: see pytest_cmdline_main below).
# Each worker, and every process its tests start (the command line, torchrun's ranks, pytester's
# subprocesses), gets its share of the cores for the frameworks' thread pools, set here before
# any of them is imported: two workers each spinning a pool as wide as the machine would be
# many times slower than one. A count the environment already sets is kept.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")) if os.environ.get("PYTEST_XDIST_WORKER") else 0
if _WORKERS:
    for _variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ.setdefault(_variable, str(max(1, _usable_cores() // _WORKERS)))

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# At most this many workers by default, however many cores: each holds PyTorch, MXNet, JAX and
# the Hugging Face stacks in memory (about 2 GB).
MAX_WORKERS = 8

# Modules whose tests share one expensive module-scoped run (a torchrun job, the documentation's
# build): each module's tests go to one worker, which runs it once. Every other test goes on its
# own to the next free worker.
SHARED_SETUP = {
    "tests/frameworks/torch/test_fsdp2_stack.py",  # `jobs`: every scenario in one torchrun job
    "tests/frameworks/torch/test_deepspeed_stack.py",  # `runs`: every scenario in one torchrun job
    "tests/frameworks/torch/test_sharded_diagnostics.py",  # `fsdp2_runs`, `zero_runs`: torchrun jobs
    "tests/frameworks/mxnet/test_mxnet_float16.py",  # `plain`: the float16 comparison
    "tests/unit/test_docs.py",  # `site`: mkdocs build --strict
    "tests/e2e/test_hostile_reports.py",  # `place`: the real and tampered reports
}


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Run the tests on one pytest-xdist worker per usable core (at most MAX_WORKERS) where
    pytest-xdist is installed (the `test` extra installs it) and the command line chose nothing
    itself: ``-n N`` picks another number, ``-n 0`` (or ``-p no:xdist``) runs them in this process."""
    if getattr(config.option, "numprocesses", 0) is not None or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # no pytest-xdist, or -n given, or this is a worker already
    if "MUTANT_UNDER_TEST" in os.environ:
        return  # mutmut (ci/mutation.py) runs the tests in its own process, to see what each one calls
    if config.option.collectonly or config.getoption("usepdb", False) or config.getoption("dist", "no") != "no":
        return
    workers = min(_usable_cores(), MAX_WORKERS)
    if workers > 1:
        config.option.numprocesses = workers


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """(pytest-xdist's --dist load, its default) Each test to the next free worker, one at a time,
    except a SHARED_SETUP module's, which go to one worker together (first, as the largest units).
    Not xdist_group marks with --dist loadgroup: pytest-xdist 3.8 groups by editing the tests'
    node ids, which pytest 9.2 no longer lets it do (pytest-dev/pytest-xdist#1386)."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedSetupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in SHARED_SETUP else nodeid

    return SharedSetupScheduling(config, log)


pytest_plugins = ["pytester"]

# The default suite runs a bounded number of examples per property; CI's long checks
# (`--hypothesis-profile long`, ci/slow.sh) 2,000 each, drawn afresh at every run; `--hypothesis-profile
# thorough` (by hand) 10,000 each.
settings.register_profile("default", max_examples=200, deadline=None)
# Hypothesis loads its "ci" profile where CI is set: the same 200 examples, derandomized (a run in CI
# replays exactly), with no example database.
settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True, database=None)
settings.register_profile("long", max_examples=2_000, deadline=None)
settings.register_profile("thorough", max_examples=10_000, deadline=None)

HAS_TORCH = importlib.util.find_spec("torch") is not None


def pytest_configure(config):
    if _WORKERS and "torch" in sys.modules:  # imported before this file: its pool is already sized
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


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

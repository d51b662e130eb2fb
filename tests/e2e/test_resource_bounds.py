"""Runs that cannot fit are refused before they start: within seconds and a few hundred MB, as
measured on a fresh child process (its peak resident memory, from wait4).

Each measured process runs with an address-space limit of 8 GiB, a small machine: what accumcheck estimates
is held against the least of the memory available and that limit, so the refusals below hold on
any machine, however large.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import needs_torch

LIMIT = 8 << 30
FEW_HUNDRED_MB = 500 << 20
FEW_SECONDS = 30  # the unbounded runs these replace took minutes, or never ended


# A small launcher between this test process and the measured one. The peak resident memory the
# kernel reports for a process carries over an exec from the memory it was forked (or vforked)
# from, so a child started straight from pytest (with torch loaded) would report pytest's peak.
_LAUNCHER = """
import json, os, resource, sys, time
limit, argv = int(sys.argv[1]), sys.argv[2:]
started = time.perf_counter()
pid = os.fork()
if pid == 0:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os.execv(argv[0], argv)
_, status, usage = os.wait4(pid, 0)
print(json.dumps({"code": os.waitstatus_to_exitcode(status), "peak": usage.ru_maxrss * 1024,
                  "seconds": time.perf_counter() - started}))
"""


def _peak_of(argv: list[str], cwd: Path) -> tuple[int, str, float, int]:
    """(exit code, stderr, seconds, peak resident bytes) of ``argv`` run under LIMIT in a fresh
    process of its own."""
    launcher = subprocess.Popen([sys.executable, "-S", "-c", _LAUNCHER, str(LIMIT), *argv], cwd=cwd,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = launcher.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)  # the measured process and whatever it started
        launcher.communicate()
        pytest.fail(f"{argv[1:]} ran for a minute instead of being refused")
    figures = json.loads(out)
    return figures["code"], err, figures["seconds"], figures["peak"]


def _case(tmp_path: Path, name: str, batch: int, units: int) -> str:
    path = tmp_path / f"{name}.toml"
    path.write_text(textwrap.dedent(f"""
        name = "{name}"
        [input]
        kind = "features"
        batch_size = {batch}
        features = 3
        [[layers]]
        type = "dense"
        name = "d"
        units = {units}
        [[layers]]
        type = "dense"
        name = "e"
        units = {units}
    """))
    return str(path)


ACCUMCHECK = str(Path(sys.executable).with_name("accumcheck"))


@pytest.mark.parametrize("what", ["world-size 100000", "30000-unit layers", "batch of 10^8", "case /dev/zero",
                                  "show /dev/zero", "sweep of 30000-unit layers", "train of 30000-unit layers"])
def test_what_cannot_fit_is_refused_in_seconds_and_little_memory(what, tmp_path):
    wide, batch = _case(tmp_path, "wide", 4, 30000), _case(tmp_path, "batch", 10**8, 4)
    argv = {
        "world-size 100000": ["compare", "--world-size", "100000"],
        "30000-unit layers": ["compare", "--case", wide],
        "batch of 10^8": ["compare", "--case", batch],
        "case /dev/zero": ["compare", "--case", "/dev/zero"],
        "show /dev/zero": ["show", "/dev/zero"],
        "sweep of 30000-unit layers": ["sweep", "--case", wide, "--accum-steps", "2,4"],
        "train of 30000-unit layers": ["train", "--case", wide],
    }[what]
    code, err, seconds, peak = _peak_of([ACCUMCHECK, *argv], tmp_path)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert seconds < FEW_SECONDS, seconds
    assert peak < FEW_HUNDRED_MB, f"{peak / 2**20:.0f} MiB"
    expected = {"world-size 100000": "more ranks than the", "case /dev/zero": "is a device, not a regular file",
                "show /dev/zero": "is a device, not a regular file"}.get(what, "of memory is available")
    assert expected in err, err


def test_force_runs_past_the_estimate(tmp_path):
    """--force is the way past a refusal: the estimate is then not consulted (here a run that
    fits in a few MB, refused under an artificially small limit)."""
    small = _case(tmp_path, "small", 4, 8)
    env_limit = 1024  # a 1 KiB "machine": every run is refused without --force

    code = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import accumcheck.run.resources as r
        r.available_memory = lambda: {env_limit}
        from accumcheck.cli import main
        raise SystemExit(main(["compare", "--case", {small!r}, "--accum-steps", "2"]))
    """)], capture_output=True, text=True)
    assert code.returncode == 2 and "of memory is available" in code.stderr, code.stderr
    forced = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import accumcheck.run.resources as r
        r.available_memory = lambda: {env_limit}
        from accumcheck.cli import main
        raise SystemExit(main(["compare", "--case", {small!r}, "--accum-steps", "2", "--force"]))
    """)], capture_output=True, text=True)
    assert forced.returncode == 0, forced.stderr
    assert "OK: all 4 tensors faithful" in forced.stdout


@needs_torch
def test_an_endless_iterable_of_batches_is_read_only_as_far_as_needed(tmp_path):
    """accumcheck.torch.check takes accum_steps batches from itertools.cycle and stops."""
    script = textwrap.dedent("""
        import itertools, torch, accumcheck.torch
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        batches = itertools.cycle([(torch.randn(3, 4), torch.tensor([0, 1, 0]))])
        report = accumcheck.torch.check(model, torch.nn.functional.cross_entropy, batches, accum_steps=8)
        print(report.accum_steps, report.exit_code)
    """)
    (tmp_path / "endless.py").write_text(script)
    code, err, seconds, peak = _peak_of([sys.executable, "endless.py"], tmp_path)
    assert code == 0, err
    assert seconds < FEW_SECONDS and peak < FEW_HUNDRED_MB, (seconds, peak)


@needs_torch
def test_an_endless_iterable_without_accum_steps_is_refused():
    import itertools

    import torch

    import accumcheck.torch
    from accumcheck import AccumcheckError

    model = torch.nn.Linear(4, 2)
    batches = itertools.cycle([(torch.randn(3, 4), torch.tensor([0, 1, 0]))])
    with pytest.raises(AccumcheckError, match="batches is an iterable of more than 4096 batches"):
        accumcheck.torch.check(model, torch.nn.functional.cross_entropy, batches)

"""``accumcheck stack --world-size W`` started from a shell: the same command run on W ranks by
torchrun (the launcher users run their jobs with), each rank writing its report where this
process reads it back, and rank 0's report returned once every rank agrees.

A rank that fails says so in one line on its stderr, which torchrun keeps in a file per rank; the
first such line is raised here as the run's error (a usage error stays one, exit 2; anything else
is ours, exit 3). An interrupted run (Ctrl-C, SIGTERM, SIGHUP) ends torchrun and its ranks before
the interrupt goes on; where this process is killed outright, the kernel sends torchrun SIGTERM
(Linux), which ends its ranks.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ...errors import AccumcheckError, RankFailed
from ...report import StackReport, load_report

# Where a rank started here writes its report: rank-R.json in this folder.
RESULTS_VARIABLE = "ACCUMCHECK_STACK_REPORTS"
_GRACE_S = 10.0


def write_rank_report(report: StackReport) -> None:
    """In a rank started by ``launch``: this rank's report, for the process that started it."""
    folder = os.environ.get(RESULTS_VARIABLE)
    if folder:
        rank = os.environ.get("RANK", "0")
        Path(folder, f"rank-{rank}.json").write_text(report.to_json())


def launch(arguments: list[str], world_size: int) -> StackReport:
    """Run ``accumcheck stack ARGUMENTS`` on ``world_size`` ranks of this machine under torchrun
    (gloo on the CPU) and return rank 0's StackReport, once every rank's report says the same.
    Raises AccumcheckError with the first failing rank's own line."""
    with tempfile.TemporaryDirectory(prefix="accumcheck-stack-") as folder:
        logs = Path(folder, "logs")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
                   f"--log-dir={logs}", "--redirects=3", "-m", "accumcheck", "stack", *arguments,
                   f"--world-size={world_size}", "--format=json"]
        env = {**os.environ, RESULTS_VARIABLE: folder, "OMP_NUM_THREADS": os.environ.get(
            "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))}
        with open(Path(folder, "torchrun.log"), "w") as chatter:
            process = subprocess.Popen(command, stdout=chatter, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True, preexec_fn=_end_with_parent)
            try:
                process.wait()
            except BaseException:  # an interrupt: torchrun and its ranks go first
                _end(process)
                raise
        reports = [Path(folder, f"rank-{rank}.json") for rank in range(world_size)]
        if all(path.exists() for path in reports):
            texts = [path.read_text() for path in reports]
            first = json.loads(texts[0])
            for rank, text in enumerate(texts[1:], start=1):
                if _verdicts(json.loads(text)) != _verdicts(first):
                    raise RuntimeError(f"rank {rank}'s stack report differs from rank 0's; the ranks judged different "
                                       "windows")
            return load_report(reports[0])
        raise _failure(logs, Path(folder, "torchrun.log"), process.returncode)


def _verdicts(report: dict[str, Any]) -> list[Any]:
    return [(s["step"], s["micro_batches"], s["result"]["equivalent"], s["result"]["explanation"])
            for s in report.get("steps", [])]


def _failure(logs: Path, chatter: Path, code: int) -> Exception:
    """The first rank's own error line: AccumcheckError for a usage error, RankFailed for an
    internal error (the rank's line, its rank named), RuntimeError for a rank that died silently."""
    lines = []
    for output in sorted(logs.rglob("stderr.log")) + sorted(logs.rglob("stdout.log")):
        rank = output.parent.name  # torchrun's layout: <log-dir>/<run>/attempt_<n>/<rank>/stderr.log
        lines += [(rank, line) for line in output.read_text(errors="replace").splitlines()
                  if line.startswith("accumcheck: ")]
    for _, line in lines:
        if line.startswith("accumcheck: error"):
            return AccumcheckError(line.split(": ", 2)[-1])
    for rank, line in lines:
        if line.startswith("accumcheck: internal error"):
            return RankFailed(line.removeprefix("accumcheck: ").replace("internal error", f"internal error on rank {rank}",
                                                                          1))
    if lines:
        return RuntimeError(f"rank {lines[0][0]}: {lines[0][1].removeprefix('accumcheck: ')}")
    for stderr in sorted(logs.rglob("stderr.log")):  # a rank that died before accumcheck could say why
        last = stderr.read_text(errors="replace").strip().splitlines()[-1:]
        if last:
            return RuntimeError(f"rank {stderr.parent.name} ended with: {last[0][-300:]}")
    tail = chatter.read_text(errors="replace").strip().splitlines()[-3:] if chatter.exists() else []
    return RuntimeError(f"torchrun ended with exit code {code} and no rank reported: {' / '.join(tail)[-400:]}")


def _end(process: subprocess.Popen) -> None:
    """SIGTERM to torchrun's whole session (it and its ranks), SIGKILL after ``_GRACE_S``."""
    for signum, wait in ((signal.SIGTERM, _GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            return
        try:
            process.wait(wait)
            if signum == signal.SIGTERM:
                os.killpg(process.pid, signal.SIGKILL)  # a rank that outlived torchrun
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def _end_with_parent() -> None:
    """In torchrun, before it starts: SIGTERM when this process dies, however (Linux only)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

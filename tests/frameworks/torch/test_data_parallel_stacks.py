"""``accumcheck stack --world-size 2``: the built-in case through each data-parallel stack on two
CPU ranks under torchrun (gloo), judged against the global window, as a user runs it from a shell.

Each stack has its correct setup (faithful, exit 0) and a fault it must name (exit 1): a rank's
micro-batch never backwarded, a rank's loss doubled, the reduction in bfloat16. The ranks' reports
must agree (the command compares them); a rank's usage error is one line and exit 2 from the
command; a signal to the command ends torchrun and every rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is needed for two CPU ranks", allow_module_level=True)

EXE = os.path.join(os.path.dirname(sys.executable), "accumcheck")
ENV = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}, "OMP_NUM_THREADS": "1"}


def stack(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, "stack", "--world-size", "2", "--accum-steps", "2", *args], capture_output=True,
                          text=True, timeout=timeout, env=ENV)


def summary(done: subprocess.CompletedProcess) -> str:
    return next((line for line in done.stdout.splitlines() if line.startswith(("FAITHFUL", "FLAGGED"))),
                done.stdout[-2000:] + done.stderr[-2000:])


def needs(module: str):
    import importlib.util

    return pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"needs {module}")


@pytest.mark.parametrize("args, code, said", [
    (["--stack", "loop"], 0, "FAITHFUL: every optimizer step applied the gradient of its window as one batch "
                             "(3 optimizer steps checked, 12 micro-batches seen on 2 ranks of the 12 the data holds)"),
    (["--stack", "loop", "--fault", "rank-drops-micro-batch"], 1, "without micro-batch 1 (rank 1) of its 4"),
    (["--stack", "fsdp2", "--fault", "bfloat16-reduce"], 1, "precision lost in the reduction"),
    pytest.param(["--stack", "accelerate", "--fault", "rank-loss-scaled"], 1, "rank 1 2.00 x", marks=needs("accelerate")),
    pytest.param(["--stack", "fsdp2"], 0, "FAITHFUL", marks=pytest.mark.slow),
    pytest.param(["--stack", "loop", "--fault", "loss-over-n"], 1, "matches 1/N (N = 2)", marks=pytest.mark.slow),
    pytest.param(["--stack", "loop", "--fault", "bfloat16-reduce"], 1, "precision lost in the reduction",
                 marks=pytest.mark.slow),
    pytest.param(["--stack", "lightning"], 0, "FAITHFUL", marks=[pytest.mark.slow, needs("lightning")]),
    pytest.param(["--stack", "transformers", "--fault", "rank-loss-scaled"], 1, "rank 1 2.00 x",
                 marks=[pytest.mark.slow, needs("transformers")]),
])
def test_each_stack_on_two_ranks_is_judged_against_the_global_window(args, code, said):
    done = stack(*args)
    assert done.returncode == code, done.stderr[-2000:]
    assert said in summary(done)


def test_the_report_says_how_many_ranks_and_numbers_their_micro_batches(tmp_path):
    done = stack("--stack", "loop", "--batches", "8", "--format", "json")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["world_size"] == 2
    assert [s["micro_batches"] for s in report["steps"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert any("data parallel: 2 ranks (gloo)" in note for note in report["notes"])


def test_a_rank_refusing_its_input_is_one_line_and_exit_2():
    done = stack("--stack", "loop", "--fault", "step-per-micro-batch")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "not a fault the loop stack runs" in done.stderr


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (read through /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] not in ("Z", "X"):
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="lists processes through /proc (Linux)")
def test_sigterm_to_the_command_ends_torchrun_and_every_rank():
    process = subprocess.Popen([EXE, "stack", "--stack", "loop", "--world-size", "2", "--accum-steps", "2",
                                "--batches", "40000"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV,
                               start_new_session=True)
    started = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(started) < 3:  # torchrun and its two ranks
            time.sleep(0.5)
            started = sorted(descendants(process.pid))
        assert len(started) >= 3, "torchrun and its ranks never started"
        time.sleep(5)  # the ranks at work
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(alive(pid) for pid in started):
            time.sleep(0.2)
        assert [pid for pid in started if alive(pid)] == []
        assert "interrupted (SIGTERM)" in process.stderr.read().decode()
    finally:
        for pid in [process.pid, *started]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


RANK_WITHOUT_CHECK = """
import sys, torch, torch.distributed as dist
from accumcheck.errors import AccumcheckError
from accumcheck.torch import AccumulationCheck
AccumulationCheck.agree_timeout_s = 3
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
if dist.get_rank() == 1:  # this rank trains without the check
    sys.exit(0)
try:
    with AccumulationCheck(model, optimizer, step=lambda m, b: m(b).sum()):
        pass
except AccumcheckError as exc:
    print(exc)
    sys.exit(2)
"""


def test_a_rank_without_the_check_is_named_not_waited_for(tmp_path):
    script = tmp_path / "rank_without_check.py"
    script.write_text(RANK_WITHOUT_CHECK)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode != 0
    assert "accumcheck.torch.AccumulationCheck: not every rank entered the check within 3 s" in done.stdout
    assert "Ranks 1 failed" in done.stdout


ACCELERATE_SHORT_WINDOW = """
import sys, torch, torch.nn.functional as F
from accelerate import Accelerator
from accumcheck.integrations.accelerate import AccumulationCheck
N = 4
accelerator = Accelerator(gradient_accumulation_steps=N, cpu=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(0)
data = [torch.randint(0, 16, (2, 5), generator=gen) for _ in range((N + 2) * accelerator.num_processes)]
loader = torch.utils.data.DataLoader(data, batch_size=1, collate_fn=lambda one: one[0])
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
check = AccumulationCheck(accelerator, model, optimizer,
                          step=lambda m, ids: F.cross_entropy(m(ids).reshape(-1, 16), ids.reshape(-1)))
with check:
    for ids in check.batches(loader):  # every micro-batch the same number of tokens: the mean is the window's
        with accelerator.accumulate(model):
            accelerator.backward(F.cross_entropy(model(ids).reshape(-1, 16), ids.reshape(-1)))
            optimizer.step()
            optimizer.zero_grad()
report = check.report
if accelerator.is_main_process:
    print([(s.micro_batches, s.verdict, s.result.matches) for s in report.steps])
sys.exit(report.exit_code)
"""


@needs("accelerate")
def test_accelerate_on_two_processes_divides_the_short_last_global_window_by_n(tmp_path):
    script = tmp_path / "short_window.py"
    script.write_text(ACCELERATE_SHORT_WINDOW)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "([0, 1, 2, 3, 4, 5, 6, 7], 'faithful', None), ([8, 9, 10, 11], 'constant-factor', 'k/N')" in done.stdout

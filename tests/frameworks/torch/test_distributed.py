"""Data-parallel runs on torch.distributed (gloo on the CPU): DDP's no_sync() accumulation against
an all-reduce every micro-step, the single-process reference, per-rank verdicts, torchrun."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import needs_torch, run_cli

from accumcheck.case.reading import builtin_case_names

pytestmark = needs_torch


def _compare(case, **kwargs):
    import accumcheck

    return accumcheck.compare(case, world_size=2, **kwargs)


@pytest.mark.parametrize("case", builtin_case_names())
def test_every_builtin_case_is_faithful_on_two_ranks_and_matches_one_process(case):
    report = _compare(case)
    parallel = report.data_parallel
    assert report.exit_code == 0, [(t.name, t.verdict, t.ratio, t.worst_mode) for t in report.flagged]
    assert parallel.setup.world_size == 2 and parallel.setup.backend == "gloo"
    assert parallel.ranks_agree and parallel.final_identical
    assert parallel.single_process.agree
    for t in report.tensors:
        assert t.single_agreement <= 1.0 and t.single_ratio <= 1.0, t.name
        assert len(t.rank_local_ratios) == 2 and max(t.rank_local_ratios) <= 1.0, t.name
    # The loss of the W*N micro-batches, averaged by rank or in one process, is the same number.
    assert report.losses["mean_loss"] == pytest.approx(report.losses["single_process_mean_loss"], rel=1e-6)


@pytest.mark.parametrize("kind", ["drop-step", "double-step", "scale", "bf16"])
def test_a_fault_on_one_rank_is_flagged_and_the_rank_named(kind):
    report = _compare("shared-weight", inject=kind, inject_rank=1)
    assert report.exit_code == 1
    assert [t.name for t in report.flagged] == ["shared.weight"]
    faulty = report.flagged[0]
    assert faulty.flagged_ranks == [1]
    assert faulty.rank_local_ratios[0] <= 1.0 < faulty.rank_local_ratios[1]
    # The check against one process over the same micro-batches fires too.
    assert faulty.single_agreement > 1.0
    ranks = report.data_parallel.ranks
    assert ranks[0].flagged == [] and ranks[1].flagged == ["shared.weight"]
    assert not report.data_parallel.ranks_agree
    from accumcheck.render import render
    from accumcheck.render.wording import summary_line

    assert "shared.weight (weight, diverged" in summary_line(report) and "rank 1)" in summary_line(report)
    text = render(report, "table")
    assert "ranks DISAGREE: rank 0: faithful; rank 1: FLAGGED shared.weight" in text
    assert "per rank" in text  # the per-rank table


def test_the_roundoff_control_on_one_rank_is_not_flagged():
    report = _compare("tiny-grads", inject="roundoff", inject_rank=1)
    assert report.exit_code == 0, [(t.name, t.ratio, t.worst_mode) for t in report.flagged]
    assert report.data_parallel.ranks_agree


def test_the_conditional_branch_runs_with_find_unused_parameters_and_matches_one_process():
    import numpy as np

    from accumcheck.case.reading import builtin_case

    case = builtin_case("conditional-branch")
    # With two ranks, rank 0 takes the branch at micro-steps 0, 2, 4, ... but not at the last
    # (global batch 30), and rank 1 never does: no rank uses it in the synchronising step.
    assert [k for k in range(16) if case.gates(2 * k)[0]] == [0, 2, 4, 6, 8, 10, 12, 14]
    assert not any(case.gates(2 * k + 1)[0] for k in range(16))
    report = _compare(case)
    assert report.data_parallel.setup.find_unused_parameters is True
    assert report.exit_code == 0
    branch = [t for t in report.tensors if t.name.startswith("branch.")]
    assert len(branch) == 2
    for t in branch:
        assert t.max_abs_grad > 0  # the branch's gradients reached the average
        assert t.single_agreement <= 1.0
        # Rank 1 never used the branch, so it handed exact zeros to the all-reduce; rank 0's
        # own total (accumulated under no_sync) was within round-off of its own E.
        assert t.rank_local_ratios[1] == 0.0 and t.rank_local_ratios[0] <= 1.0
    assert np.isclose(report.losses["mean_loss"], report.losses["single_process_mean_loss"])


def test_a_reduced_precision_all_reduce_shows_as_precision_loss():
    report = _compare("embed-attention", accum_steps=8, reduce_dtype="bfloat16")
    assert report.exit_code == 1
    assert report.data_parallel.setup.reduce_dtype == "bfloat16"
    assert {t.verdict for t in report.tensors} == {"precision-loss"}
    for t in report.tensors:
        assert t.ratio_native <= 1.0  # within the bfloat16 all-reduce's own bound
        assert t.precision_ratio > 1.0  # beyond a float32 all-reduce's
        assert t.err_ulps_native > 100 * t.err_ulps_manual  # the float32 manual all-reduce keeps its digits
        assert t.single_agreement <= 1.0
    assert "--reduce-dtype bfloat16" in report.reproduce_command()


def _torchrun(*args, cwd):
    """torchrun (its module form, which is the same program) with two local ranks."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "accumcheck.cli", *args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=300, env=env)


def _accumcheck_frames(stderr: str) -> list[str]:
    """Traceback frames in accumcheck's own modules (torchrun prints its own traceback, and the
    interpreter's path, which may hold any folder name)."""
    import accumcheck

    here = Path(accumcheck.__file__).parent
    packages = {f'File "{folder}{os.sep}' for folder in (here, here.resolve())}
    return [line for line in stderr.splitlines() if line.strip().startswith(tuple(packages))]


def _comparable(path):
    data = json.loads(path.read_text())
    parallel = data.pop("data_parallel")
    launcher = parallel["setup"].pop("launcher")
    for key in ("created", "seconds"):
        data.pop(key)
    return data, parallel, launcher


@pytest.mark.slow
def test_torchrun_gives_the_same_report_as_world_size_two(tmp_path):
    spawned = run_cli("compare", "--case", "shared-weight", "--world-size", "2", "--inject", "scale",
                      "--inject-rank", "1", "--format", "json", "--output", str(tmp_path / "spawned.json"))
    assert spawned.returncode == 1, spawned.stderr
    launched = _torchrun("compare", "--case", "shared-weight", "--inject", "scale", "--inject-rank", "1",
                         "--format", "json", "--output", str(tmp_path / "torchrun.json"), cwd=tmp_path)
    # The ranks exit 1 (flagged); torchrun reports that as its ChildFailedError, with its own
    # traceback, and exits non-zero. No traceback comes from accumcheck.
    assert launched.returncode != 0 and "ChildFailedError" in launched.stderr
    assert _accumcheck_frames(launched.stderr) == []
    a, parallel_a, launcher_a = _comparable(tmp_path / "spawned.json")
    b, parallel_b, launcher_b = _comparable(tmp_path / "torchrun.json")
    assert (launcher_a, launcher_b) == ("torch.multiprocessing", "torchrun")
    assert a == b  # every tensor's every figure, bit for bit
    assert parallel_a == parallel_b
    # Only rank 0 printed.
    assert launched.stdout.count("report written to") == 1


def test_torchrun_with_a_clean_case_exits_zero_and_prints_one_table(tmp_path):
    launched = _torchrun("compare", "--case", "conditional-branch", "--accum-steps", "8", cwd=tmp_path)
    assert launched.returncode == 0, launched.stderr[-2000:]
    assert launched.stdout.count("OK: all 6 tensors faithful") == 1
    assert "data parallel: 2 ranks (gloo, torchrun)" in launched.stdout


def test_torchrun_world_size_mismatch_is_a_usage_error(tmp_path):
    launched = _torchrun("compare", "--case", "shared-weight", "--world-size", "3", cwd=tmp_path)
    assert "started by torchrun with WORLD_SIZE=2; pass --world-size 2 or leave it out" in launched.stderr
    assert launched.returncode != 0 and _accumcheck_frames(launched.stderr) == []


@pytest.mark.parametrize("args, fragment", [
    (["--world-size", "2", "--framework", "mxnet"], "--world-size 2: not available with the mxnet backend (no "
                                                     "data-parallel mode: data-parallel runs use torch.distributed); "
                                                     "use --framework torch"),
    (["--world-size", "2", "--framework", "torch,mxnet"], "--world-size 2: works with one framework at a time"),
    (["--world-size", "0"], "argument --world-size: '0' is not a positive integer"),
    (["--reduce-dtype", "bfloat16"], "--reduce-dtype bfloat16: applies to data-parallel runs; add --world-size W"),
    (["--world-size", "2", "--inject", "scale", "--inject-rank", "2"], "--inject-rank 2: ranks are 0..1"),
    (["--world-size", "2", "--inject-rank", "1"], "--inject-rank 1: names the rank of an --inject fault"),
    (["--world-size", "2", "--dtype", "bfloat16"], "--dtype bfloat16: not available with --world-size on the torch "
                                                    "backend (data-parallel runs keep float32 parameters"),
    (["--world-size", "2", "--full-batch"], "--full-batch: not available with --world-size"),
    (["--world-size", "2", "--device", "cuda:1"], "each rank takes its own GPU (cuda:LOCAL_RANK); use --device gpu"),
    (["--case", "conditional-branch", "--full-batch"], "routes each micro-batch through its conditional layers"),
])
def test_data_parallel_usage_errors_are_one_line_and_exit_two(args, fragment):
    result = run_cli("compare", *args)
    assert result.returncode == 2, result.stderr
    assert fragment in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_gpu_without_cuda_is_a_usage_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = run_cli("compare", "--world-size", "2", "--device", "gpu")
    assert result.returncode == 2
    assert "CUDA is not available" in result.stderr and "use --device cpu (gloo)" in result.stderr


FORK_SERVER_CHILDREN = """
import os, sys
from pathlib import Path
from accumcheck.torch.forkserver import start_early

start_early()  # returns once the server's process has been started (forked and executed)
children = [p for p in Path("/proc").iterdir() if p.name.isdigit() and (p / "stat").exists()
            and (p / "stat").read_text().rsplit(")", 1)[1].split()[1] == str(os.getpid())]
print(sum(b"multiprocessing.forkserver" in (p / "cmdline").read_bytes() for p in children),
      "torch" in sys.modules)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="lists the process's children through /proc")
@pytest.mark.parametrize("launched", [False, True])
def test_the_fork_server_starts_before_pytorch_is_imported_and_never_under_torchrun(launched):
    """A data-parallel run starts its ranks' fork server first thing, without importing PyTorch, so
    that the server's import and its own run side by side; a rank of a torchrun job starts none."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    if launched:
        env.update(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    done = subprocess.run([sys.executable, "-c", FORK_SERVER_CHILDREN], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == (["0", "False"] if launched else ["1", "False"])


@pytest.mark.gpu
def test_nccl_on_the_gpus():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    world = min(2, torch.cuda.device_count())
    import accumcheck

    clean = accumcheck.compare("embed-attention", world_size=world, device="gpu")
    assert clean.data_parallel.setup.backend == "nccl"
    assert clean.exit_code == 0, [(t.name, t.ratio, t.worst_mode) for t in clean.flagged]
    faulty = accumcheck.compare("embed-attention", world_size=world, device="gpu", inject="drop-step",
                                inject_rank=world - 1)
    assert [t.name for t in faulty.flagged] == ["embed.weight"]
    assert faulty.flagged[0].flagged_ranks == [world - 1]


def test_the_pytest_option_runs_accum_compare_data_parallel(pytester):
    pytester.makepyfile("""
        def test_case(accum_compare):
            report = accum_compare("shared-weight")
            assert report.data_parallel.setup.world_size == 2
            assert report.exit_code == 0
    """)
    result = pytester.runpytest_subprocess("--accum-world-size", "2",
                                           "--accum-framework", "torch", "--accum-steps", "8")
    result.stdout.fnmatch_lines(["*--accum-world-size 2*", "*1 passed*"])



def test_oracle_and_a_float64_manual_buffer_work_on_two_ranks():
    report = _compare("shared-weight", oracle=True, accum_dtype="float64")
    assert report.exit_code == 0 and report.accum_dtype == "float64"
    for t in report.tensors:
        # The float64 model over the same 32 micro-batches: both modes sit at float32 forward error.
        assert 0 < t.oracle_err_native < 1e-5 and 0 < t.oracle_err_manual < 1e-5
    assert "--oracle --world-size 2 --accum-dtype float64" in report.reproduce_command()


@pytest.mark.parametrize("case", ["conditional-branch", "padded-tokens"])
def test_the_reference_summed_from_the_ranks_pass_is_one_process_accumulation_bit_for_bit(case):
    """Each rank hands rank 0 the micro-gradients of its own global micro-batches from its pass, and
    rank 0 adds them in the global order: the very result of one process accumulating all W*N
    natively (a branch some micro-steps leave without a gradient; a loss divided by the window's
    token count), and its mean loss summed in the same order. The float64 oracle, which runs a
    model of its own, likewise. Manual is each micro-step's mean over the two ranks (float32, as
    an all-reduce gives it) added in step order."""
    import numpy as np
    import torch

    from accumcheck.case.reading import builtin_case
    from accumcheck.run.validation import configure
    from accumcheck.torch.builtin import CaseSubject, _native
    from accumcheck.torch.casemodel import deterministic
    from accumcheck.torch.distributed import run_data_parallel

    steps = 4
    run = run_data_parallel(configure({"case": case, "framework": "torch", "world_size": 2, "accum_steps": steps,
                                       "oracle": True}), {})
    spec = builtin_case(case)
    saved = torch.get_num_threads()
    torch.set_num_threads(1)  # as each of the two ranks on this machine's cores runs it
    try:
        with deterministic(torch.device("cpu")):
            references = {}
            for dtype in (torch.float32, torch.float64):
                native, loss = _native(CaseSubject(spec, spec.weights(), dtype, torch.device("cpu"), 2 * steps),
                                       None, "one process")
                references[dtype] = ({name: (g / 2).numpy() for name, g in native.items()}, loss)
            subject = CaseSubject(spec, spec.weights(), torch.float32, torch.device("cpu"), 2 * steps)
            loss_of = subject.step_loss(subject.model)
            micro = []
            for index in range(2 * steps):
                grads = torch.autograd.grad(loss_of(index), list(subject.params.values()), allow_unused=True)
                micro.append([torch.zeros_like(p) if g is None else g
                              for g, p in zip(grads, subject.params.values())])
    finally:
        torch.set_num_threads(saved)
    manual = [torch.zeros_like(p) for p in subject.params.values()]
    for k in range(steps):
        for total, g0, g1 in zip(manual, micro[2 * k], micro[2 * k + 1]):
            total.add_((g0 + g1) / 2)
    manual = dict(zip(subject.params, manual))
    for p in run.params:
        assert np.array_equal(p.manual, manual[p.name].numpy()), p.name
        assert np.array_equal(p.reference, references[torch.float32][0][p.name]), p.name
        assert np.array_equal(p.oracle, references[torch.float64][0][p.name]), p.name
    assert run.losses["single_process_mean_loss"] == references[torch.float32][1]


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_zero_sums_the_ranks_steps_alike_shared_or_sent(world_size, tmp_path):
    """Rank 0's sums from the ranks' micro-steps, read from shared memory or sent over gloo: the
    single-process reference is every step added in the global order (rank 0, 1, ... of step 0,
    then of step 1, ...), each rounded to float32; manual adds each step's float32 mean over the
    ranks into its buffer. Bit for bit, on two ranks and on three (a rank between the first and
    the last)."""
    import platform

    import numpy as np
    import torch.multiprocessing as mp
    from streamed_worker import STEPS, micro_gradient, run

    mp.start_processes(run, args=(world_size, str(tmp_path)), nprocs=world_size, start_method="spawn")
    total = np.zeros_like(micro_gradient(0, 0))
    manual = {"float32": np.zeros(total.size, np.float32), "float64": np.zeros(total.size)}
    for step in range(STEPS):
        mean = np.zeros_like(total)
        for rank in range(world_size):
            g = micro_gradient(step, rank)
            total = total + g
            mean = mean + g
        mean = mean / np.float32(world_size)
        for dtype, buffer in manual.items():
            manual[dtype] = buffer + mean.astype(dtype)
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    for way in ("shared", "sent"):
        for dtype in manual:
            name = f"{way}-{dtype}"
            assert json.loads((tmp_path / f"{name}.json").read_text())["shared"] == (way == "shared" and x86)
            assert np.array_equal(np.load(tmp_path / f"{name}-total.npy"), total), name
            assert np.array_equal(np.load(tmp_path / f"{name}-manual.npy"), manual[dtype]), name

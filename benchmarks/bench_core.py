"""Core performance figures of accumcheck, as ratios from one run (torch backend; CPU, or
(a) and (c) with --device cuda).

(a) overhead   wall time of ``accumcheck.compare(case="transformer-small", accum_steps=N)`` over a
               plain native loop on the same case and N (build the model, then N x forward +
               ``loss.backward()``: the least work compare must do, which builds the model and
               runs every micro-step's forward and backward at least once). Both warmed up once, then timed interleaved in an order that
               rotates from round to round (41 rounds: a run varies by several per cent on a
               shared machine); the median of the rounds' ratios, and their quartiles. Also shown, to say
               where the extra time goes: the backend run alone (``TorchBackend.run``) and the
               judging (``build_report`` on a finished run). Target <= 1.1.
(b) memory     peak RSS of a fresh child running compare at N=256 over that of a fresh child at
               N=16 (same code, same imports): the harness must not store per-step state. The
               figure is the child's VmHWM; its ru_maxrss is shown too but is not usable here (see
               CHILD). Target <= 1.05.
(c) comparator million elements/s of ``compare_tensor`` on a 20M-element float32 tensor (8 seeded
               micro-gradients per element, summed forward into A and in reverse into B; E and S
               in float64), against the memory floor: the least work it must do, reading each
               element of the four arrays once (4 + 4 + 8 + 8 = 24 bytes per element), timed with
               the fastest of four read-only passes (a compiled parallel pass, the same reading
               block by block as the comparator does, torch.sum per array, numpy.sum per array;
               the one used is recorded), so that its share of the floor cannot pass 1 (each
               pass: its least time of 9 interleaved rounds, as memory bandwidth on a shared
               machine varies by tens of per cent from round to round); against the same
               reduction in torch operations on the CPU (the path that judges on a GPU), and
               against ``torch.testing.assert_close(A, B)`` (AssertionError caught; its time
               counts). Also for A == B. Target: at least half the floor's throughput.

(d) mxnet      compare(framework="mxnet") over one plain grad_req='add' loop. Target <= 2.0 (MXNet
               needs two passes, native and manual, over the same micro-steps: the model is built
               once, its forward and backward run twice).
(e) data       compare(world_size=2) over a plain DDP job (no_sync for all but the last micro-step),
    parallel   both started the same way (torch.multiprocessing with accumcheck's start method, gloo,
               2 ranks, forked from a server that has imported torch and torch._dynamo, which DDP's
               constructor reads), and where the plain job's time goes (its rank 0: DDP's
               constructor, the micro-steps). Target <= 1.3.

Targets are informational: a MISS is printed, and the script still exits 0.

Every run writes its figures to benchmarks/results/bench_core.json (or --json FILE); ``figures``
renders from that file the text docs/performance.md quotes (``python ci/figures.py --group
benchmarks --write`` puts it there). Importing this module runs nothing and imports no framework.

    python benchmarks/bench_core.py               # full run, ~3 min on 2 cores
    python benchmarks/bench_core.py --quick       # smoke run, smaller N and tensor
    python benchmarks/bench_core.py --json out.json
    python benchmarks/bench_core.py --device cuda  # (a) on the GPU (absolute times too); (c) as ever
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from machine_info import cpu_family, load, write_result  # benchmarks/ is the script's folder

CASE = "transformer-small"
RESULT = Path(__file__).resolve().parent / "results" / "bench_core.json"
# The aims: (a), (b), (d) and (e) at most, (c) at least (a share of the read-only floor).
TARGETS = {"overhead": 1.1, "memory": 1.05, "comparator": 0.5, "mxnet": 2.0, "data_parallel": 1.3}


def installed(package: str) -> str | None:
    """The installed version of ``package``, without importing it; None when it is not installed."""
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def machine() -> dict:
    import numba
    import numpy as np
    import torch
    from machine_info import cpu_model  # benchmarks/ is the script's folder

    import accumcheck

    model = cpu_model()
    return {"cpu": model, "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "mxnet": installed("mxnet"), "numpy": np.__version__,
            "numba": numba.__version__, "accumcheck": accumcheck.__version__}


def timed_value(fn):
    """(seconds, result) of one call of ``fn``."""
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def timed(fn) -> float:
    return timed_value(fn)[0]


def rounds(fns: dict, reps: int) -> dict:
    """Warm each up once, then time them interleaved ``reps`` times, the order rotating from round
    to round (so that drift falls on all alike); each one's seconds, round by round."""
    for fn in fns.values():
        fn()
    names = list(fns)
    times: dict = {name: [] for name in fns}
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            times[name].append(timed(fns[name]))
    return times


def medians(fns: dict, reps: int) -> dict:
    """``rounds``' median seconds of each."""
    return {name: statistics.median(t) for name, t in rounds(fns, reps).items()}


def least(fns: dict, reps: int) -> dict:
    """``rounds``' least seconds of each: for passes bound by memory bandwidth, which on a shared
    machine varies by tens of per cent from round to round, the least time is the closest to what
    the pass itself costs (a median of a few rounds can put a pass above the floor by chance)."""
    return {name: min(t) for name, t in rounds(fns, reps).items()}


# ----------------------------------------------------------------------------- (a) overhead


def bench_overhead(steps: int, reps: int, device: str = "cpu") -> dict:
    import torch

    import accumcheck
    from accumcheck.case.reading import resolve_case
    from accumcheck.judge import build_report
    from accumcheck.run.validation import configure
    from accumcheck.torch.backend import TorchBackend
    from accumcheck.torch.casemodel import build_model, case_loss

    case = resolve_case(CASE)
    dev = torch.device(device)

    def native() -> None:
        model = build_model(case, case.weights(), torch.float32, dev)
        for step in range(steps):
            batch = case.batch(step)
            loss = case_loss(case, model(torch.from_numpy(batch.inputs).to(dev)), torch.from_numpy(batch.labels).to(dev))
            loss.backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()  # the work done, not just queued

    config = configure({"case": CASE, "framework": "torch", "accum_steps": steps, "device": device})
    run = TorchBackend().run(config)
    each = rounds({
        "compare": lambda: accumcheck.compare(case=CASE, framework="torch", accum_steps=steps, oracle=False,
                                              device=device),
        "native": native,
        "backend_run": lambda: TorchBackend().run(config),
        "judging": lambda: build_report(case, run, steps, None, False, 0.0),
    }, reps)
    t = {name: statistics.median(times) for name, times in each.items()}
    per_step = lambda s: s / steps * 1e3  # noqa: E731
    ratios = [c / n for c, n in zip(each["compare"], each["native"])]
    return {"steps": steps, "reps": reps, "compare_s": t["compare"], "native_s": t["native"],
            # the median of the rounds' ratios: a round's two runs saw the machine at the same speed
            "ratio": statistics.median(ratios),
            "ratio_quartiles": statistics.quantiles(ratios, n=4)[::2] if len(ratios) > 1 else [ratios[0]] * 2,
            "native_ms_per_step": per_step(t["native"]),
            "backend_extra_ms_per_step": per_step(t["backend_run"] - t["native"]),
            "judging_ms": t["judging"] * 1e3}


# ----------------------------------------------------------------------------- (b) memory

# The child prints its peak RSS twice: VmHWM (peak of its own address space) and ru_maxrss. Only
# VmHWM is used: Linux carries ru_maxrss over fork+exec, so a child of this (large) process reports
# at least this process's own peak, which would hide the figure.
CHILD = """
import resource, sys
import accumcheck
accumcheck.compare(case=%r, framework="torch", accum_steps=int(sys.argv[1]), oracle=False)
hwm = next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(hwm, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
""" % CASE


def peak_rss_mib(steps: int) -> tuple[float, float]:
    """(VmHWM, ru_maxrss) of a fresh child running compare at ``steps``, in MiB."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(steps)], check=True, capture_output=True, text=True)
    hwm, maxrss = out.stdout.split()[-2:]
    return int(hwm) / 1024, int(maxrss) / 1024  # both in KiB on Linux


def bench_memory(small: int, large: int, runs: int) -> dict:
    lo = [peak_rss_mib(small) for _ in range(runs)]
    hi = [peak_rss_mib(large) for _ in range(runs)]
    lo_mib, hi_mib = statistics.median(x[0] for x in lo), statistics.median(x[0] for x in hi)
    return {"small_steps": small, "large_steps": large, "runs": runs, "small_mib": lo_mib, "large_mib": hi_mib,
            "ratio": hi_mib / lo_mib, "small_ru_maxrss_mib": statistics.median(x[1] for x in lo),
            "large_ru_maxrss_mib": statistics.median(x[1] for x in hi)}


# ----------------------------------------------------------------------------- (c) comparator


def make_tensors(n: int, micro: int = 8, chunk: int = 1 << 20, seed: int = 0):
    """A (float32, forward sum), B (float32, reverse sum), E and S (float64) of ``micro`` seeded
    micro-gradients per element: a per-element mean plus noise, magnitudes spread over 1e-6..1e-2."""
    import numpy as np

    rng = np.random.default_rng(seed)
    a, b = np.empty(n, np.float32), np.empty(n, np.float32)
    e, s = np.empty(n), np.empty(n)
    for lo in range(0, n, chunk):
        m = min(chunk, n - lo)
        scale = (10.0 ** rng.uniform(-6, -2, m)).astype(np.float32)
        g = (rng.standard_normal(m, dtype=np.float32) + rng.standard_normal((micro, m), dtype=np.float32)) * scale
        fwd, rev = g[0].copy(), g[-1].copy()
        for k in range(1, micro):
            fwd += g[k]
            rev += g[micro - 1 - k]
        a[lo:lo + m], b[lo:lo + m] = fwd, rev
        g64 = g.astype(np.float64)
        e[lo:lo + m] = g64.sum(axis=0)
        s[lo:lo + m] = np.abs(g64).sum(axis=0)
    return a, b, e, s


def read_only_passes() -> dict:
    """The candidates for the memory floor: passes that only read A, B, E and S once each, the
    least work the comparator must do (it reads every element of the four arrays; A and B twice
    where they agree, the second time from L1). Each sums what it reads, so that nothing is
    optimised away. By name: ``numba``, a compiled parallel pass over whole chunks (each chunk's
    own slices: an index from 0 loads as vectors, one that might be negative as gathers);
    ``numba, blocked``, the same over blocks of the comparator's own length, A and B then E and S
    (two streams at a time instead of four, as the comparator reads them: on some CPUs the faster);
    ``torch.sum``, one ``torch.sum`` per array (PyTorch's threads); ``numpy.sum``, one
    ``numpy.sum`` per array (one thread). The floor is the fastest of them on the machine."""
    import numba
    import numpy as np
    import torch

    from accumcheck.judge.kernel import _BLOCK

    @numba.njit(parallel=True, fastmath=True, nogil=True)
    def read(a, b, e, s, chunks):
        n = a.size
        step = (n + chunks - 1) // chunks
        out = np.zeros(chunks)
        for c in numba.prange(chunks):
            lo = c * step
            hi = min(n, lo + step)
            a_, b_, e_, s_ = a[lo:hi], b[lo:hi], e[lo:hi], s[lo:hi]
            ta = tb = np.float32(0.0)
            te = ts = 0.0
            for i in range(a_.size):
                ta += a_[i]
                tb += b_[i]
                te += e_[i]
                ts += s_[i]
            out[c] = np.float64(ta) + np.float64(tb) + te + ts
        return out.sum()

    @numba.njit(parallel=True, fastmath=True, nogil=True)
    def read_blocked(a, b, e, s, chunks, block):
        n = a.size
        step = (n + chunks - 1) // chunks
        out = np.zeros(chunks)
        for c in numba.prange(chunks):
            total = 0.0
            for lo in range(c * step, min(n, (c + 1) * step), block):
                hi = min(n, c * step + step, lo + block)
                a_, b_, e_, s_ = a[lo:hi], b[lo:hi], e[lo:hi], s[lo:hi]
                ta = tb = np.float32(0.0)
                te = ts = 0.0
                for i in range(a_.size):
                    ta += a_[i]
                    tb += b_[i]
                for i in range(e_.size):
                    te += e_[i]
                    ts += s_[i]
                total += np.float64(ta) + np.float64(tb) + te + ts
            out[c] = total
        return out.sum()

    def blocked(a, b, e, s, chunks):
        return read_blocked(a, b, e, s, chunks, _BLOCK)

    def torch_sum(a, b, e, s, chunks):
        return sum(float(torch.from_numpy(x).sum()) for x in (a, b, e, s))

    def numpy_sum(a, b, e, s, chunks):
        return sum(float(x.sum()) for x in (a, b, e, s))

    return {"numba": read, "numba, blocked": blocked, "torch.sum": torch_sum, "numpy.sum": numpy_sum}


def bench_comparator(n: int, reps: int) -> dict:
    import numpy as np
    import torch

    from accumcheck.bounds import ModeBound
    from accumcheck.judge import compare_tensor
    from accumcheck.judge.kernel import _CHUNK, _MAX_CHUNKS
    from accumcheck.torch.judging import reduce_tensors

    a, b, e, s = make_tensors(n)
    bound = ModeBound.for_sum("float32", 8)
    floors = read_only_passes()
    chunks = int(min(_MAX_CHUNKS, max(1, -(-n // _CHUNK))))
    # What compare_tensor must read of each element: A and B in their dtype, E and S in float64.
    per_element = a.itemsize + b.itemsize + e.itemsize + s.itemsize
    results = {"numel": n, "reps": reps, "bytes_per_element": per_element}
    for label, other in (("differ", b), ("identical", a.copy())):
        raised = []
        tensors = [torch.from_numpy(x) for x in (a, other, e, s)]

        def ours() -> None:
            results[f"{label}_verdict"] = compare_tensor("bench", "weight", a, other, e, s, bound, bound).verdict

        def theirs() -> None:
            try:
                torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(other))
            except AssertionError:
                raised.append(True)

        def floor(name: str):
            return lambda: floors[name](a, other, e, s, chunks)

        # The compiled and numpy passes interleaved with each other, the torch operations with
        # each other: torch's threads keep spinning a while after an operation, and would take a
        # core from whichever compiled pass came next.
        t = least({"ours": ours, "numba": floor("numba"), "numba, blocked": floor("numba, blocked"),
                   "numpy.sum": floor("numpy.sum")}, reps)
        t.update(least({"torch.sum": floor("torch.sum"), "assert_close": theirs, "torch_ops": lambda: reduce_tensors(
            *tensors, bound.relative, 0.0, bound.relative, 0.0, 1.3e-6, 1e-5)}, reps))
        kernel = min(floors, key=lambda name: t[name])
        results[label] = {"ours_meps": n / t["ours"] / 1e6, "assert_close_meps": n / t["assert_close"] / 1e6,
                          "floor_meps": n / t[kernel] / 1e6, "floor_kernel": kernel,
                          "floor_gbs": per_element * n / t[kernel] / 1e9,
                          "floor_candidates_meps": {name: n / t[name] / 1e6 for name in floors},
                          "torch_ops_meps": n / t["torch_ops"] / 1e6,
                          "floor_share": t[kernel] / t["ours"], "ratio": t["assert_close"] / t["ours"],
                          "assert_close_raised": bool(raised), "mismatched": int(np.count_nonzero(a != other))}
    return results


# ----------------------------------------------------------------------------- report


def verdict(value: float, target: float, at_most: bool) -> str:
    ok = value <= target if at_most else value >= target
    return "PASS" if ok else "MISS"


# ----------------------------------------------------------------------------- (e) data parallel


def _plain_ddp_rank(rank: int, world: int, folder: str, steps: int) -> None:
    """One rank of the plain job (e) compares with: DDP, no_sync() for all but the last micro-step."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from accumcheck.case.reading import resolve_case
    from accumcheck.torch.casemodel import build_model, case_loss

    started = time.perf_counter()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world)
    case = resolve_case(CASE)
    model = build_model(case, case.weights(), torch.float32, torch.device("cpu"))
    built = time.perf_counter()
    ddp = DistributedDataParallel(model)
    wrapped = time.perf_counter()
    for step in range(steps):
        batch = case.batch(step * world + rank)
        with ddp.no_sync() if step < steps - 1 else contextlib.nullcontext():
            case_loss(case, ddp(torch.from_numpy(batch.inputs)), torch.from_numpy(batch.labels)).backward()
    dist.barrier()
    if rank == 0:  # where the job's time goes: DDP's constructor, the micro-steps
        Path(folder, "phases").write_text(f"{wrapped - built} {time.perf_counter() - wrapped} {wrapped - started}")
    del ddp
    dist.destroy_process_group()


def bench_data_parallel(steps: int, reps: int, world: int = 2) -> dict:
    """compare(world_size=2) over the plain DDP job, both started the same way (torch.multiprocessing
    with accumcheck's start method, gloo, W ranks on this machine): what the float64 sums, the
    micro-gradients sent to rank 0 for the single-process reference and manual, gathering every
    rank's view and judging add."""
    import tempfile

    import torch.multiprocessing as mp

    import accumcheck
    from accumcheck.torch.forkserver import start_method

    method = start_method()
    phases = []

    def plain() -> None:
        with tempfile.TemporaryDirectory() as folder:
            mp.start_processes(_plain_ddp_rank, args=(world, folder, steps), nprocs=world, start_method=method)
            phases.append([float(x) for x in Path(folder, "phases").read_text().split()])

    t = medians({
        "compare": lambda: accumcheck.compare(case=CASE, framework="torch", accum_steps=steps, world_size=world),
        "plain": plain,
    }, reps)
    return {"steps": steps, "reps": reps, "world": world, "start_method": method, "compare_s": t["compare"],
            "plain_s": t["plain"], "ratio": t["compare"] / t["plain"],
            # rank 0 of the plain job: DDP's constructor, its micro-steps
            "plain_ddp_init_s": statistics.median(p[0] for p in phases),
            "plain_steps_s": statistics.median(p[1] for p in phases)}


# ----------------------------------------------------------------------------- (d) MXNet


def bench_mxnet(steps: int, reps: int) -> dict | None:
    """compare(framework="mxnet") over one plain grad_req='add' accumulation loop (hybridized).
    MXNet needs two passes (add, then write + buffer), so 2 is the floor."""
    try:
        import mxnet as mx
        from mxnet import autograd
    except ImportError:
        return None
    import accumcheck
    from accumcheck.case.reading import resolve_case
    from accumcheck.mxnet.casemodel import case_step, prepared

    case = resolve_case(CASE)

    def plain() -> None:
        block = prepared(case, case.weights(), "float32", mx.cpu(), True)
        for p in block.canonical.values():
            p.grad_req = "add"
        step = case_step(case, block, mx.cpu(), "float32")
        for index in range(steps):
            with autograd.record():
                loss, _ = step(index)
            loss.backward()
        [p.grad().asnumpy() for p in block.canonical.values()]

    t = medians({
        "compare": lambda: accumcheck.compare(case=CASE, framework="mxnet", accum_steps=steps),
        "plain": plain,
    }, reps)
    return {"steps": steps, "reps": reps, "mxnet": mx.__version__, "compare_s": t["compare"],
            "plain_s": t["plain"], "ratio": t["compare"] / t["plain"]}


# ----------------------------------------------------------------------------- the docs' text


def displayed(value: float, digits: int) -> float:
    """``value`` as the text shows it: an aim is met or missed by the figure the reader sees."""
    return round(value, digits)


def aim(target: float, value: float, digits: int, at_most: bool, unit: str = "", why: str = "") -> str:
    """The aim column: "≤ 1.2", "≥ 5× — missed", "≤ 2.2 — missed (why)"."""
    shown = displayed(value, digits)
    met = shown <= target if at_most else shown >= target
    return f"{'≤' if at_most else '≥'} {target:g}{unit}" + ("" if met else " — missed") + (f" ({why})" if why else "")


def command(result: dict) -> str:
    """The command line of the run."""
    flags = (["--quick"] if result.get("quick") else []) + (
        [f"--device {result['device']}"] if result.get("device", "cpu") != "cpu" else [])
    return " ".join(["python benchmarks/bench_core.py", *flags])


def machine_sentence(result: dict) -> str:
    m = result["machine"]
    mxnet = m.get("mxnet") or (result.get("mxnet") or {}).get("mxnet")
    versions = [f"torch {m['torch']}"] + ([f"mxnet {mxnet}"] if mxnet else []) + [
        f"numpy {m['numpy']}", f"numba {m['numba']}"]
    gpu = f" with an {m['gpu']}" if m.get("gpu") else ""
    cores = m.get("usable_cores") or m["cores"]
    loads = result.get("load") or {}
    if loads.get("before") is not None:  # other processes share the machine: what they were doing
        versions.append(f"load average {loads['before']:.2f} before the run, {loads['after']:.2f} after")
    return (f"From one run of `{command(result)}` on this {cores}-core {cpu_family(m['cpu'])} machine{gpu} "
            f"({', '.join(versions)}):")


def half(fraction: float) -> str:
    return "half" if 0.45 <= fraction <= 0.55 else f"{100 * fraction:.0f}%"


def ranks_started(method: str) -> str:
    return {"forkserver": "the ranks forked from a server that has imported torch",
            "spawn": "the ranks spawned afresh", "fork": "the ranks forked"}.get(method, f"ranks started by {method}")


def quartiles(over: dict) -> str:
    """(a)'s spread: the quartiles of the rounds' ratios (a run from before they were kept: none)."""
    low, high = over.get("ratio_quartiles") or (None, None)
    return "" if low is None else f"the {over['reps']} rounds' quartiles {low:.2f} to {high:.2f}; "


def floor_text(comp: dict, c: dict) -> str:
    """The floor as the table states it: the bytes read per element, at what speed, by which pass."""
    return (f"its {comp.get('bytes_per_element', 24)} bytes per element read at {c['floor_meps']:.0f} M/s "
            f"by {floor_name(c)}, the fastest read-only pass here")


def table(result: dict) -> str:
    """docs/performance.md's table (a) to (e): the measured column and the aims with their misses."""
    targets = {**TARGETS, **result.get("targets", {})}
    over, mem, comp = result["overhead"], result.get("memory"), result["comparator"]
    mxb, dp = result.get("mxnet"), result.get("data_parallel")
    rows = [("(a) `compare` (oracle off) / plain native accumulation loop, "
             f"`{CASE}`, N = {over['steps']}" + ("" if result.get("device", "cpu") == "cpu" else f", {result['device']}"),
             f"{over['ratio']:.2f} ({quartiles(over)}"
             f"{over['compare_s'] * 1e3:.0f} ms / {over['native_s'] * 1e3:.0f} ms; "
             f"{over['native_ms_per_step']:.2f} ms per native micro-step, {over['backend_extra_ms_per_step']:+.2f} ms "
             f"in the backend, {over['judging_ms']:.1f} ms judging and mapping)",
             aim(targets["overhead"], over["ratio"], 2, True))]
    if mem is not None:
        rows.append((f"(b) peak RSS at N = {mem['large_steps']} / at N = {mem['small_steps']}",
                     f"{mem['ratio']:.3f} ({mem['large_mib']:.0f} / {mem['small_mib']:.0f} MiB VmHWM of fresh child "
                     "processes)", aim(targets["memory"], mem["ratio"], 3, True)))
    differ, same = comp["differ"], comp["identical"]
    for what, c in ((f"(c) comparator, {comp['numel'] / 1e6:g}M float32 elements, A ≠ B in "
                     f"{half(differ['mismatched'] / comp['numel'])} of them", differ), ("(c) the same with A = B", same)):
        rows.append((what, f"{c['ours_meps']:.0f} Melem/s, {100 * c['floor_share']:.0f} % of the floor: "
                           f"{floor_text(comp, c)}; `assert_close` {c['assert_close_meps']:.0f}, the same "
                           f"reduction in torch operations {c['torch_ops_meps']:.0f}",
                     aim(100 * targets["comparator"], 100 * c["floor_share"], 0, False, " % of the floor")))
    if mxb is not None:
        rows.append((f"(d) MXNet `compare` / one plain `grad_req='add'` loop, `{CASE}`, N = {mxb['steps']}",
                     f"{mxb['ratio']:.2f} ({mxb['compare_s'] * 1e3:.0f} ms / {mxb['plain_s'] * 1e3:.0f} ms)",
                     aim(targets["mxnet"], mxb["ratio"], 2, True,
                         why="two passes of forward and backward over one model")))
    if dp is not None:
        rows.append((f"(e) `compare --world-size {dp['world']}` / a plain DDP `no_sync()` job, `{CASE}`, "
                     f"N = {dp['steps']} per rank, both started the same way, with gloo",
                     f"{dp['ratio']:.2f} ({dp['compare_s']:.2f} s / {dp['plain_s']:.2f} s, "
                     f"{ranks_started(dp.get('start_method', 'forkserver'))}{plain_phases(dp)})",
                     aim(targets["data_parallel"], dp["ratio"], 2, True) if "data_parallel" in targets else "—"))
    lines = ["| figure | measured | aim |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n" + "\n".join(lines) + "\n"


def summary(result: dict) -> str:
    """One sentence: what `compare` costs over a plain loop, and the comparator's speed."""
    over, comp = result["overhead"], result["comparator"]
    differ, same = comp["differ"], comp["identical"]
    cores = result["machine"].get("usable_cores") or result["machine"]["cores"]
    return (f"On a {cores}-core {cpu_family(result['machine']['cpu'])} machine, `compare` takes {over['ratio']:.2f}× "
            f"the time of a plain native accumulation loop over the same model (`{CASE}`, N = {over['steps']}), "
            f"and the comparator judges {differ['ours_meps']:.0f} M elements/s where native and manual differ in "
            f"{half(differ['mismatched'] / comp['numel'])} of them, {same['ours_meps']:.0f} M/s where they agree: "
            f"{100 * differ['floor_share']:.0f} % and {100 * same['floor_share']:.0f} % of the fastest pass that "
            f"only reads the four arrays ({floor_name(differ)}, {comp.get('bytes_per_element', 24)} bytes per "
            f"element, {differ['floor_meps']:.0f} M/s), where `torch.testing.assert_close` does "
            f"{differ['assert_close_meps']:.0f} M/s")


def plain_phases(dp: dict) -> str:
    """Where the plain job's time goes, from its rank 0 (a run from before this was kept: nothing)."""
    if "plain_ddp_init_s" not in dp:
        return ""
    return (f"; the plain job's rank 0 spends {dp['plain_ddp_init_s']:.2f} s in DDP's constructor and "
            f"{dp['plain_steps_s']:.2f} s in its {dp['steps']} micro-steps")


def floor_name(c: dict) -> str:
    kernel = c.get("floor_kernel", "numba")
    return {"numba": "a compiled parallel pass", "numba, blocked": "a compiled parallel pass reading block by block "
            "as the comparator does", "torch.sum": "`torch.sum` per array",
            "numpy.sum": "`numpy.sum` per array"}.get(kernel, f"`{kernel}`")


def figures(result: dict) -> dict[str, str]:
    """The text docs/performance.md quotes from a run (the JSON this script writes), by name:
    ``machine`` (the sentence above the table), ``table`` (a) to (e), ``summary`` (one
    sentence on (a) and (c)), and, when (e) ran,
    ``e.global`` (the reference's global micro-batches), ``e.steps`` (the micro-steps per rank) and
    ``e.start`` (how the ranks start)."""
    out = {"machine": machine_sentence(result), "table": table(result), "summary": summary(result)}
    dp = result.get("data_parallel")
    if dp is not None:
        out["e.global"] = str(dp["steps"] * dp["world"])
        out["e.steps"] = str(dp["steps"])
        out["e.start"] = ("Since the ranks of both are forked from a server that has imported PyTorch, neither pays "
                          "for starting Python and importing PyTorch in each rank (spawning the ranks afresh makes "
                          "both sides slower by that cost)" if dp.get("start_method", "forkserver") == "forkserver" else
                          "The ranks of both start afresh, so both pay for starting Python and importing PyTorch in "
                          "each rank")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short smoke run (smaller N and tensor)")
    parser.add_argument("--json", metavar="FILE", default=str(RESULT),
                        help="where to write the figures as JSON (default: benchmarks/results/bench_core.json)")
    parser.add_argument("--device", default="cpu", help="where (a) runs: cpu or cuda; on cuda (b) and (d), "
                        "CPU measurements, are left out (default: %(default)s)")
    args = parser.parse_args()
    import torch

    on_gpu = args.device != "cpu"
    q = args.quick
    started = time.perf_counter()
    load_before = load()

    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores ({info['usable_cores']} usable, torch threads "
          f"{info['torch_threads']}); python {info['python']}, torch {info['torch']}, numpy {info['numpy']}, "
          f"numba {info['numba']}, accumcheck {info['accumcheck']}{'  [--quick]' if q else ''}")

    phases = {}
    if on_gpu:
        info["gpu"], info["cuda"] = torch.cuda.get_device_name(args.device), torch.version.cuda
        print(f"device: {info['gpu']}, CUDA {info['cuda']}")
    phases["a"], over = timed_value(lambda: bench_overhead(steps=8 if q else 32, reps=3 if q else 41, device=args.device))
    phases["b"], mem = (0.0, None) if on_gpu else timed_value(
        lambda: bench_memory(small=16, large=64 if q else 256, runs=1 if q else 3))
    phases["c"], comp = timed_value(lambda: bench_comparator(n=2_000_000 if q else 20_000_000, reps=3 if q else 9))
    phases["d"], mxb = (0.0, None) if on_gpu else timed_value(lambda: bench_mxnet(steps=8 if q else 32,
                                                                                  reps=3 if q else 7))
    phases["e"], dp = (0.0, None) if on_gpu else timed_value(lambda: bench_data_parallel(steps=8 if q else 32,
                                                                                         reps=1 if q else 11))

    t = TARGETS
    rows = [
        ("(a) overhead", f"compare / native loop, {CASE}, N={over['steps']}, {args.device}", over["ratio"],
         f"<= {t['overhead']:g}", verdict(over["ratio"], t["overhead"], True),
         f"{over['compare_s'] * 1e3:.0f} ms / {over['native_s'] * 1e3:.0f} ms, median of {over['reps']} "
         f"(quartiles {over['ratio_quartiles'][0]:.3f} to {over['ratio_quartiles'][1]:.3f})"),
    ]
    if mem is not None:
        rows.append(("(b) memory", f"peak RSS N={mem['large_steps']} / N={mem['small_steps']}", mem["ratio"],
                     f"<= {t['memory']:g}", verdict(mem["ratio"], t["memory"], True),
                     f"VmHWM {mem['large_mib']:.0f} / {mem['small_mib']:.0f} MiB, median of {mem['runs']} children "
                     f"(ru_maxrss {mem['large_ru_maxrss_mib']:.0f} / {mem['small_ru_maxrss_mib']:.0f})"))
    for label in ("differ", "identical"):
        c = comp[label]
        rows.append(("(c) comparator", f"compare_tensor / read-only pass, {comp['numel'] / 1e6:g}M, "
                     f"A {'!=' if label == 'differ' else '=='} B", c["floor_share"], f">= {t['comparator']:g}",
                     verdict(c["floor_share"], t["comparator"], False),
                     f"{c['ours_meps']:.0f} vs {c['floor_meps']:.0f} Melem/s ({c['floor_kernel']}; "
                     + ", ".join(f"{k} {v:.0f}" for k, v in c["floor_candidates_meps"].items())
                     + f"; assert_close {c['assert_close_meps']:.0f}, "
                     f"torch ops {c['torch_ops_meps']:.0f}), best of {comp['reps']}"))
    if mxb is not None:
        rows.append(("(d) mxnet", f"compare / grad_req='add' loop, {CASE}, N={mxb['steps']}", mxb["ratio"],
                     f"<= {t['mxnet']:g}", verdict(mxb["ratio"], t["mxnet"], True),
                     f"{mxb['compare_s'] * 1e3:.0f} ms / {mxb['plain_s'] * 1e3:.0f} ms, mxnet {mxb['mxnet']}, "
                     f"median of {mxb['reps']}"))
    if dp is not None:
        rows.append(("(e) data par.", f"compare --world-size {dp['world']} / plain DDP no_sync job, N={dp['steps']}",
                     dp["ratio"], f"<= {t['data_parallel']:g}", verdict(dp["ratio"], t["data_parallel"], True),
                     f"{dp['compare_s']:.2f} s / {dp['plain_s']:.2f} s (both start {dp['world']} ranks the same way, "
                     f"{dp['start_method']}), median of {dp['reps']}"))
    print()
    print(f"{'figure':<15} {'measures':<50} {'ratio':>7}  {'target':<8} {'':<4}  detail")
    for name, what, ratio, target, ok, detail in rows:
        print(f"{name:<15} {what:<50} {ratio:>7.3f}  {target:<8} {ok:<4}  {detail}")

    print()
    print(f"(a) per micro-step: native fwd+bwd {over['native_ms_per_step']:.2f} ms; the backend run adds "
          f"{over['backend_extra_ms_per_step']:.2f} ms (hooks, manual/E/S adds); "
          f"judging all tensors (once) {over['judging_ms']:.1f} ms")
    print(f"(c) A != B: {comp['differ']['mismatched']} elements differ, verdict {comp['differ_verdict']}, "
          f"assert_close raised: {comp['differ']['assert_close_raised']}; "
          f"A == B: verdict {comp['identical_verdict']}, assert_close raised: {comp['identical']['assert_close_raised']}")
    for label in ("differ", "identical"):
        if comp[label]["floor_share"] > 1:
            print(f"(c) {label}: compare_tensor beat every read-only pass: the floor measures the wrong thing")
    elapsed = time.perf_counter() - started
    print(f"total {elapsed:.0f} s (" + ", ".join(f"{k} {v:.0f} s" for k, v in phases.items()) + ")")

    load_after = load()
    if load_before is not None:
        print(f"load average {load_before:.2f} before the run, {load_after:.2f} after")
    result = {"machine": info, "device": args.device, "quick": q, "seconds": elapsed,
              "load": {"before": load_before, "after": load_after}, "overhead": over,
              "memory": mem, "comparator": comp, "mxnet": mxb, "data_parallel": dp, "targets": dict(TARGETS)}
    return write_result(args.json, result)


if __name__ == "__main__":
    sys.exit(main())

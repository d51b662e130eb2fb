"""The GPU checks that ci/gpu_check.sh runs, as one script that writes its figures as JSON.

  verdicts     every built-in case on the GPU: faithful (positive control); drop-step and bf16
               flagged on exactly the injected tensor, roundoff not (negative and positive
               controls); absolute time of each compare
  determinism  each case accumulated twice with deterministic algorithms on (as accumcheck runs):
               bit-identical is expected; then twice with them off: tensors whose kernels are
               nondeterministic (atomic adds) differ, and their run-to-run difference, in units of
               the round-off bound, is reported as the noise floor
  judging      every built-in case and fault judged on the GPU against the same run judged by the
               host kernel (equal but the sums' last bits), and the device reduction's throughput
               on 20M and 200M elements
  data         accumcheck.compare(world_size=W) with nccl on W = min(2, GPUs) GPUs, clean and with
  parallel     a fault on the last rank (which must be named)

Exit status: 0 when every check holds, 1 otherwise (the noise floor is reported, not judged).

    python ci/gpu_check.py --out figures.json
    python ci/gpu_check.py --summarize FOLDER   # the summary ci/gpu_check.sh writes
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

import accumcheck
from accumcheck.bounds import ModeBound
from accumcheck.case.reading import builtin_case, builtin_case_names
from accumcheck.torch.builtin import CaseSubject
from accumcheck.torch.casemodel import deterministic, to_numpy
from accumcheck.torch.passes import accumulate

DEV = torch.device("cuda")
WHERE = "gpu"  # accumcheck's --device; --device cpu runs the same checks on the CPU (a dry run)


def check_verdicts() -> dict:
    out = {}
    for name in builtin_case_names():
        started = time.perf_counter()
        clean = accumcheck.compare(name, device=WHERE)
        seconds = time.perf_counter() - started
        entry = {"clean_exit": clean.exit_code, "seconds": round(seconds, 3), "worst_ratio": max(t.ratio for t in clean.tensors),
                 "device": clean.device, "faults": {}}
        for kind in ("drop-step", "bf16", "roundoff"):
            report = accumcheck.compare(name, device=WHERE, inject=kind)
            target = report.inject.split(":")[1].split("@")[0]
            flagged = [t.name for t in report.flagged]
            entry["faults"][kind] = {"flagged": flagged, "ok": flagged == ([] if kind == "roundoff" else [target])}
        entry["ok"] = clean.exit_code == 0 and all(f["ok"] for f in entry["faults"].values())
        out[name] = entry
    return {"ok": all(e["ok"] for e in out.values()), "cases": out}


@contextlib.contextmanager
def _default_kernels():
    """PyTorch's default (possibly nondeterministic) kernels for the duration."""
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved)


def _twice(case, deterministic_on: bool) -> tuple[dict, dict]:
    runs = []
    for _ in range(2):
        with deterministic(DEV) if deterministic_on else _default_kernels():
            subject = CaseSubject(case, case.weights(), torch.float32, DEV, case.accum_steps)
            runs.append(accumulate(subject.params, subject.step_loss(subject.model), case.accum_steps, None, None,
                                   "determinism", hold_refs=True))
    return runs[0], runs[1]


def check_determinism() -> dict:
    out = {}
    for name in builtin_case_names():
        case = builtin_case(name)
        bound = ModeBound.for_sum("float32", case.accum_steps)
        entry = {}
        for label, on in (("deterministic", True), ("default", False)):
            a, b = _twice(case, on)
            differing = {}
            for tensor, grad in a["native"].items():
                x, y = to_numpy(grad), to_numpy(b["native"][tensor])
                if not np.array_equal(x, y):
                    absum = to_numpy(a["buffers"][tensor][2]).astype(np.float64)
                    floor = np.abs(x.astype(np.float64) - y) / (bound.relative * absum + bound.absolute)
                    differing[tensor] = float(np.nan_to_num(floor, nan=0.0).max())
            entry[label] = {"bit_identical": not differing, "noise_floor": differing}
        out[name] = entry
    # Deterministic mode must reproduce itself; the default mode's noise floor is information.
    return {"ok": all(e["deterministic"]["bit_identical"] for e in out.values()), "cases": out}


def check_data_parallel() -> dict:
    world = min(2, torch.cuda.device_count()) if WHERE == "gpu" else 2
    clean = accumcheck.compare("embed-attention", world_size=world, device=WHERE)
    faulty = accumcheck.compare("embed-attention", world_size=world, device=WHERE, inject="drop-step",
                                inject_rank=world - 1)
    named = faulty.flagged[0].flagged_ranks if faulty.flagged else None
    return {"ok": clean.exit_code == 0 and [t.name for t in faulty.flagged] == ["embed.weight"] and named == [world - 1],
            "world_size": world, "backend": clean.data_parallel.setup.backend, "clean_exit": clean.exit_code,
            "clean_seconds": clean.seconds,
            "single_process_worst": clean.data_parallel.single_process.worst_agreement,
            "fault_flagged": [t.name for t in faulty.flagged], "fault_ranks": named}


SUMMED = {"condition", "rel_err_native", "rel_err_manual", "grad_sum_sq", "norm_share", "spread_predicted",
          "spread_native", "spread_manual"}  # made of sums: torch adds in its own order


def _differences(a, b, where=""):
    if where in (".created", ".seconds"):
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _differences(a.get(k), b.get(k), f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    if where.rsplit(".", 1)[-1] in SUMMED and isinstance(a, float) and isinstance(b, float):
        return [] if abs(a - b) <= 1e-12 * max(abs(a), abs(b)) else [f"{where}: {a!r} / {b!r}"]
    return [] if a == b or (a != a and b != b) else [f"{where}: {a!r} / {b!r}"]


def check_judging() -> dict:
    """Judged on the GPU against judged on the host from the same run, every case and fault; and the
    device reduction's throughput on 20M and 200M float32 elements, half of them differing."""
    import dataclasses

    from accumcheck.case.reading import resolve_case
    from accumcheck.judge import build_report
    from accumcheck.judge.kernel import reduce_on_host
    from accumcheck.options.choices import FAULT_KINDS
    from accumcheck.run.validation import configure
    from accumcheck.torch.backend import TorchBackend
    from accumcheck.torch.judging import reduce_tensors

    cases, ok = {}, True
    for name in builtin_case_names():
        for fault in (None, *FAULT_KINDS):
            config = configure({"case": name, "framework": "torch", "accum_steps": 16, "inject": fault,
                                "device": WHERE})
            run = TorchBackend().run(config)
            on_device = all(p.reducer is not None for p in run.params)
            there = build_report(resolve_case(name), run, 16, config.fault, False, 0.0).to_dict()
            host = build_report(resolve_case(name), dataclasses.replace(run, params=[
                dataclasses.replace(p, reducer=None) for p in run.params]), 16, config.fault, False, 0.0).to_dict()
            found = _differences(there, host)
            cases[f"{name}/{fault or 'clean'}"] = {"judged_on_device": on_device, "differences": found[:5]}
            ok &= not found and (on_device or WHERE == "cpu")
    throughput = {}
    for n in (20_000_000, 200_000_000) if DEV.type == "cuda" else (2_000_000,):  # a dry run: small
        g = torch.Generator(device=DEV).manual_seed(0)
        scale = 10.0 ** (torch.rand(n, generator=g, device=DEV, dtype=torch.float64) * 4 - 6)
        e = torch.randn(n, generator=g, device=DEV, dtype=torch.float64) * scale
        s = e.abs() * 3
        a = e.float()
        b = a.clone()
        b[::2] = (e[::2] * (1 + 1e-7)).float()
        args = (1e-6, 0.0, 1e-6, 0.0, 1.3e-6, 1e-5)
        reduce_tensors(a, b, e, s, *args)
        if DEV.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        got = reduce_tensors(a, b, e, s, *args)  # ends with the scalars' copy to the host
        seconds = time.perf_counter() - started
        entry = {"melem_per_s": round(n / seconds / 1e6, 1), "mismatched": got.mismatched}
        if n <= 20_000_000:
            want = reduce_on_host(*(x.cpu().numpy() for x in (a, b, e, s)), *args)
            entry["equal_to_host_kernel"] = all(
                getattr(got, f) == getattr(want, f) or (f.startswith("sum") and abs(getattr(got, f) - getattr(
                    want, f)) <= 1e-12 * abs(getattr(want, f))) for f in got._fields)
            ok &= entry["equal_to_host_kernel"]
        throughput[str(n)] = entry
        del a, b, e, s, scale
    return {"ok": ok, "cases": cases, "throughput": throughput}


def summarize(folder: Path) -> str:
    """The one summary file of ci/gpu_check.sh: its steps, these figures, the benchmarks' tables."""
    lines = ["# accumcheck GPU check", ""]
    steps = folder / "steps.txt"
    lines += ["## steps", ""] + [f"- {line}" for line in steps.read_text().splitlines()] if steps.exists() else []
    checks = folder / "gpu_checks.json"
    if checks.exists():
        f = json.loads(checks.read_text())
        lines += ["", f"## checks: torch {f['torch']}, CUDA {f['cuda']}, {f['gpus']} x {f['gpu']}", ""]
        v = f.get("verdicts", {})
        for name, e in v.get("cases", {}).items():
            faults = ", ".join(f"{k} -> {x['flagged'] or 'none'}{'' if x['ok'] else ' (WRONG)'}" for k, x in e["faults"].items())
            lines.append(f"- verdicts {name}: clean exit {e['clean_exit']}, worst ratio {e['worst_ratio']:.3g}, "
                         f"{e['seconds']:.2f} s; {faults}")
        for name, e in f.get("determinism", {}).get("cases", {}).items():
            det, default = e["deterministic"], e["default"]
            floor = ", ".join(f"{t} {x:.3g}" for t, x in default["noise_floor"].items()) or "none"
            lines.append(f"- determinism {name}: deterministic mode bit-identical: {det['bit_identical']}"
                         + ("" if det["bit_identical"] else f" (differs: {det['noise_floor']})")
                         + f"; default kernels' run-to-run noise floor (x bound): {floor}")
        judging = f.get("judging", {})
        if "cases" in judging:
            wrong = {k: e for k, e in judging["cases"].items() if e["differences"] or not e["judged_on_device"]}
            lines.append(f"- judged on the GPU: {len(judging['cases']) - len(wrong)} of {len(judging['cases'])} "
                         f"case/fault reports equal to the host kernel's" + (f"; differ: {wrong}" if wrong else ""))
            for n, e in judging.get("throughput", {}).items():
                lines.append(f"- device reduction, {int(n) / 1e6:g}M float32 elements (half differing): "
                             f"{e['melem_per_s']} Melem/s" + (f", equal to the host kernel: {e['equal_to_host_kernel']}"
                                                              if "equal_to_host_kernel" in e else ""))
        dp = f.get("data_parallel", {})
        if "world_size" in dp:
            lines.append(f"- data parallel: {dp['world_size']} rank(s), {dp['backend']}: clean exit {dp['clean_exit']} "
                         f"({dp['clean_seconds']} s, single-process agreement {dp['single_process_worst']:.3g}); "
                         f"fault on the last rank flagged {dp['fault_flagged']}, ranks named {dp['fault_ranks']}")
        for name in ("verdicts", "determinism", "judging", "data_parallel"):
            if "error" in f.get(name, {}):
                lines += ["", f"{name} crashed:", "```", f[name]["error"], "```"]
    for log in ("bench_core", "bench_diagnostics"):
        path = folder / f"{log}.log"
        if path.exists():
            lines += ["", f"## {log}", "", "```", path.read_text().rstrip(), "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="where to write the figures (JSON)")
    parser.add_argument("--summarize", metavar="DIR", help="instead, print the summary of gpu_check.sh's folder DIR")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the same checks on the CPU, a dry run of this script (default: %(default)s)")
    args = parser.parse_args()
    if args.summarize:
        print(summarize(Path(args.summarize)), end="")
        return 0
    if not args.out:
        parser.error("--out FILE is required")
    global DEV, WHERE
    if args.device == "cpu":
        DEV, WHERE = torch.device("cpu"), "cpu"
    elif not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA GPU", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(0) if WHERE == "gpu" else "none (dry run on the CPU)"
    figures = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": gpu,
               "gpus": torch.cuda.device_count(), "accumcheck": accumcheck.__version__}
    ok = True
    for name, check in (("verdicts", check_verdicts), ("determinism", check_determinism),
                        ("judging", check_judging), ("data_parallel", check_data_parallel)):
        started = time.perf_counter()
        try:
            figures[name] = check()
        except Exception:  # one check's crash is recorded; the others still run
            figures[name] = {"ok": False, "error": traceback.format_exc()}
        figures[name]["seconds"] = round(time.perf_counter() - started, 1)
        ok &= figures[name]["ok"]
        print(f"{name}: {'PASS' if figures[name]['ok'] else 'FAIL'} ({figures[name]['seconds']} s)", flush=True)
    with open(args.out, "w") as handle:
        json.dump(figures, handle, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

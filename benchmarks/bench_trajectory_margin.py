"""Where ``accumcheck train`` draws its line: native's gap from manual over the control's, on
faithful runs and on faults.

Every built-in case, Adam (lr 1e-3) and SGD (lr 1e-2), N = 16 and 32, 20 optimizer steps, on each
framework this environment has: without a fault and with ``--inject roundoff`` (a valid
reordering: faithful, must not be flagged), and with each fault that changes the sum (drop-step,
repeat-step, double-step, scale, bf16: must be flagged where they reach the parameters). JAX runs
with optax's default running mean and, faithful only, with ``--no-grad-mean``. Each run records its
worst ratio (native's parameter gap from manual over the control's band, the largest over its
steps and tensors), its largest gap in float32 ulps (how far a fault moved the parameters at all)
and its first non-finite step, if any: a run is flagged where its worst ratio is past the margin
(``accumcheck.run.trajectory.MARGIN``, chosen from these figures) or it went non-finite. MXNet 1.6.0 (apache/mxnet#16708, a real fault) is measured
where it is installed, on the case it hits: ``.venv-mxnet16/bin/python
benchmarks/bench_trajectory_margin.py --framework mxnet --case shared-weight --faithful-only`` in
the environment ``ci/mxnet_16708.sh`` builds, its rows labelled by the release. The libraries are held to their baseline
kernels (as ``ci/figures.py`` holds them), so that the figures do not follow the CPU; with
``--own-kernels`` they run the CPU's own (AVX2, AVX-512), which round otherwise: the faithful runs
are measured both ways (``--faithful-only --own-kernels``), their rows labelled by the kernels.

Every run updates benchmarks/results/bench_trajectory_margin.json (or --json FILE), replacing the
rows it measured and keeping the others; ``figures`` renders the text docs/trajectory.md quotes.
Importing this module runs nothing.

    python benchmarks/bench_trajectory_margin.py [--framework torch,mxnet,jax] [--case C,...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

RESULT = Path(__file__).resolve().parent / "results" / "bench_trajectory_margin.json"
CASES = ("tiny-grads", "shared-weight", "conditional-branch", "padded-tokens", "transformer-small", "embed-attention")
OPTIMIZERS = (("adam", 1e-3), ("sgd", 1e-2))
ACCUM_STEPS = (16, 32)
STEPS = 20
FAITHFUL = (None, "roundoff")
FAULTS = ("drop-step", "repeat-step", "double-step", "scale", "bf16")
BASELINE_KERNELS = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default", "DNNL_MAX_CPU_ISA": "SSE41",
                    "OPENBLAS_CORETYPE": "Prescott"}


def label(framework: str, options: dict) -> str:
    """A row's framework: the framework and its release, and any option it ran with."""
    from accumcheck.run.registry import get_backend

    release = get_backend(framework).versions().get(framework, "")
    return " ".join([framework, release] + [f"--no-{k.replace('_', '-')}" for k, v in options.items() if v is False])


def measure(framework: str, case: str, optimizer: str, lr: float, accum_steps: int, inject: str | None,
            options: dict, kernels: str = "baseline") -> dict:
    import accumcheck

    report = accumcheck.train(case, framework=framework, steps=STEPS, optimizer=optimizer, lr=lr,
                              accum_steps=accum_steps, inject=inject, **options)
    finite = [v for values in report.control_ratio.values() for v in values if math.isfinite(v)]
    ulps = [v for values in report.band_ratio.values() for v in values if math.isfinite(v)]
    # the worst ratio and how far the parameters moved at all: independent of the margin, which
    # ``figures`` applies
    return {"framework": label(framework, options), "case": case, "optimizer": optimizer, "lr": lr,
            "accum_steps": accum_steps, "inject": inject, "worst": max(finite, default=0.0),
            "worst_ulps": max(ulps, default=0.0), "non_finite": min(report.non_finite.values(), default=None),
            "kernels": kernels}


def grid(frameworks: list[str], cases: list[str], faithful_only: bool) -> list[tuple]:
    runs = []
    for framework in frameworks:
        variants = [({}, FAITHFUL + (() if faithful_only else FAULTS))]
        if framework == "jax":
            variants.append(({"grad_mean": False}, FAITHFUL))
        for options, injects in variants:
            for case in cases:
                for optimizer, lr in OPTIMIZERS:
                    for n in ACCUM_STEPS:
                        runs += [(framework, case, optimizer, lr, n, inject, options) for inject in injects]
    return runs


def key(row: dict) -> tuple:
    return row["framework"], row["case"], row["optimizer"], row["accum_steps"], row["inject"], row["kernels"]


def flagged(row: dict, margin: float) -> bool:
    """Whether ``train`` exits 1 on the run under ``margin``: past it, or inf or nan."""
    return row["worst"] > margin or row["non_finite"] is not None


def kind_of(row: dict) -> str:
    """"faithful" (a valid order of the sum: no fault, or ``roundoff``), "fault" (an injected fault, or
    MXNet 1.6.0's own), or "mean" (JAX's MultiSteps running mean without a fault: another algorithm,
    not a reordering, shown apart)."""
    if row["inject"] in FAULTS or row["framework"].startswith("mxnet 1.6"):
        return "fault"
    if row["framework"].startswith("jax") and "--no-grad-mean" not in row["framework"]:
        return "mean"
    return "faithful"


def summarise(rows: list[dict], margin: float) -> dict:
    """The faithful runs' worst ratio, the faults' flagged and not, and what sits nearest the margin."""
    faithful = [r for r in rows if kind_of(r) == "faithful"]
    faults = [r for r in rows if kind_of(r) == "fault"]
    means = [r for r in rows if kind_of(r) == "mean"]
    caught = [r for r in faults if flagged(r, margin)]
    return {"margin": margin, "faithful_runs": len(faithful),
            "faithful_flagged": sum(flagged(r, margin) for r in faithful),
            "faithful_max": max((r["worst"] for r in faithful if r["non_finite"] is None), default=0.0),
            "fault_runs": len(faults), "faults_flagged": len(caught),
            "flagged_min": min((r["worst"] for r in caught if r["non_finite"] is None), default=math.inf),
            "missed": [r for r in faults if not flagged(r, margin)],
            "means": len(means), "means_flagged": [r for r in means if flagged(r, margin)]}


def _run_text(row: dict) -> str:
    return (f"{row['framework']} {row['case']} {row['optimizer']} N = {row['accum_steps']}"
            + (f" --inject {row['inject']}" if row["inject"] else "")
            + (" (the CPU's own kernels)" if row["kernels"] == "own" else ""))


def figures(result: dict) -> dict[str, str]:
    """The quoted text: ``margin``, ``faithful-max`` (the faithful runs' worst ratio and where),
    ``headroom`` (the margin over it),
    ``flagged-min`` (the least a flagged fault went past), ``faults`` (flagged of run), ``missed``
    (the faults not flagged, with how far they moved the parameters), ``mean`` (JAX's running-mean
    runs without a fault flagged, and on which cases), ``command``, ``table`` (per
    framework and fault: runs, flagged, least and largest ratio)."""
    rows, margin = result["rows"], result["margin"]
    s = summarise(rows, margin)
    faithful = [r for r in rows if kind_of(r) == "faithful"]
    worst = max(faithful, key=lambda r: r["worst"], default=None)
    lines = ["| framework | `--inject` | runs | flagged | least ratio | largest ratio |", "|---|---|---:|---:|---:|---:|"]
    groups: dict[tuple, list[dict]] = {}
    order = ["torch", "mxnet", "jax"]
    injects = [None, *FAITHFUL[1:], *FAULTS]
    for row in sorted(rows, key=lambda r: (order.index(r["framework"].split()[0]), r["framework"], r["kernels"],
                                           injects.index(r["inject"]))):
        own = " (own kernels)" if row["kernels"] == "own" else ""
        groups.setdefault((row["framework"] + own, row["inject"] or "none"), []).append(row)
    for (framework, inject), group in groups.items():
        ratios = [r["worst"] for r in group]
        lines.append(f"| {framework} | {inject} | {len(group)} | {sum(flagged(r, margin) for r in group)} | "
                     f"{min(ratios):.3g} | {max(ratios):.3g} |")
    missed = "".join(f"- {_run_text(r)}: {r['worst']:.3g}x the control's band, {r['worst_ulps']:.3g} ulps\n"
                     for r in s["missed"])
    return {"margin": f"{margin:g}", "faithful-max": f"{s['faithful_max']:.3g}",
            "faithful-worst-run": _run_text(worst) if worst else "none", "faithful": f"{s['faithful_runs'] - s['faithful_flagged']} of "
                                                                 f"{s['faithful_runs']}",
            "headroom": f"{margin / s['faithful_max']:.2g}" if s["faithful_max"] else "inf",
            "flagged-min": f"{s['flagged_min']:.3g}", "faults": f"{s['faults_flagged']} of {s['fault_runs']}",
            "missed": "\n" + (missed or "- none\n"),
            "mean": f"{len(s['means_flagged'])} of {s['means']}" + (" (" + ", ".join(sorted({
                f"{r['case']}" for r in s["means_flagged"]})) + ")" if s["means_flagged"] else ""),
            "command": "`python benchmarks/bench_trajectory_margin.py`",
            "table": "\n" + "\n".join(lines) + "\n"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--framework", default="torch,mxnet,jax")
    parser.add_argument("--case", default=",".join(CASES))
    parser.add_argument("--faithful-only", action="store_true", help="no injected faults (a release's own runs)")
    parser.add_argument("--json", metavar="FILE", default=str(RESULT))
    parser.add_argument("--again", action="store_true", help="measure the runs the file holds again")
    parser.add_argument("--own-kernels", action="store_true",
                        help="the CPU's own kernels (AVX2, AVX-512), not the libraries' baseline ones")
    args = parser.parse_args()
    kernels = "own" if args.own_kernels else "baseline"
    if not args.own_kernels:
        os.environ.update(BASELINE_KERNELS)
    from accumcheck.run.trajectory import MARGIN

    path = Path(args.json)
    old = json.loads(path.read_text()) if path.exists() else {"rows": []}
    rows = {key(r): r for r in old["rows"]}
    for run in grid(args.framework.split(","), args.case.split(","), args.faithful_only):
        framework, case, optimizer, _, n, inject, options = run
        if not args.again and (label(framework, options), case, optimizer, n, inject, kernels) in rows:
            continue
        row = measure(*run, kernels=kernels)
        rows[key(row)] = row
        print(f"{row['worst']:10.3g}  flagged {flagged(row, MARGIN)}  {_run_text(row)}", flush=True)
        result = {"steps": STEPS, "margin": MARGIN, "rows": sorted(rows.values(), key=lambda r: tuple(map(str, key(r))))}
        path.write_text(json.dumps(result, indent=1) + "\n")  # after every run: a long measurement resumes
    text = figures({"margin": MARGIN, "rows": list(rows.values())})
    print(text["table"])
    print(f"margin {text['margin']}: faithful at most {text['faithful-max']} ({text['faithful']} passed); "
          f"faults flagged {text['faults']}, the least flagged at {text['flagged-min']}; missed: {text['missed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Behaviour snapshot for refactors: save the JSON report of every built-in case in every framework
with every fault, then compare a later snapshot with it field by field.

    python ci/report_snapshot.py save before/             # on the tree before the change
    python ci/report_snapshot.py save after/              # on the tree after it
    python ci/report_snapshot.py compare before/ after/   # exit 1 on any difference
    python ci/report_snapshot.py compare before/ after/ --sums-rtol 1e-12   # sums in another order

Runs (N = 16 micro-steps, the CPU): each built-in case x {torch, mxnet, jax, torch+mxnet, torch+jax} x {no fault,
each fault kind}, one data-parallel run (two gloo ranks, a fault on rank 1), and one run for each
option that changes what is run or judged (dtypes, modes, full batch, oracle, hybridize, seed,
the all-reduce's dtype, two refused combinations). A run that raises is recorded as its error
message, and compared as such.

Both snapshots are read back through the installed ``accumcheck.load_report`` (so a snapshot
written by an older release is read as the current one reads it) and compared as data: every
field must be equal, floats bit for bit, except the run's timing (``seconds``), its ``created``
time and accumcheck's own version. A run refused in both counts as equal; where the message
changed, both are printed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import accumcheck

try:
    from accumcheck.case.reading import builtin_case_names
except ImportError:  # earlier layouts: a flat package
    try:
        from accumcheck.casefile import builtin_case_names
    except ImportError:
        from accumcheck.cases import builtin_case_names

STEPS = 16
FRAMEWORKS = ("torch", "mxnet", "jax", "torch+mxnet", "torch+jax")
FAULTS = (None, "drop-step", "double-step", "scale", "bf16", "roundoff")
DATA_PARALLEL = {"case": "shared-weight", "inject": "scale", "world_size": 2, "inject_rank": 1}
# Each option that changes what is run or judged, once.
OPTIONS = {
    "dtype-bfloat16": {"case": "transformer-small", "framework": "torch", "dtype": "bfloat16"},
    "dtype-float16": {"case": "embed-attention", "framework": "torch", "dtype": "float16"},
    "accum-dtype-float64": {"case": "embed-attention", "framework": "torch", "accum_dtype": "float64"},
    "mode-accumulator": {"case": "embed-attention", "framework": "torch", "mode": "accumulator"},
    "mode-compensated": {"case": "tiny-grads", "framework": "torch", "mode": "compensated", "dtype": "bfloat16"},
    "full-batch-mean": {"case": "padded-tokens", "framework": "torch", "full_batch": True},
    "full-batch-token-count": {"case": "padded-tokens", "framework": "torch", "full_batch": True,
                               "loss_reduction": "token_count"},
    "oracle-torch": {"case": "tiny-grads", "framework": "torch", "oracle": True},
    "oracle-mxnet": {"case": "embed-attention", "framework": "mxnet", "oracle": True},
    "mxnet-imperative": {"case": "transformer-small", "framework": "mxnet", "hybridize": False},
    "seed": {"case": "shared-weight", "framework": "torch", "seed": 7, "inject": "double-step:out.weight"},
    "reduce-dtype-bfloat16": {"case": "embed-attention", "framework": "torch", "world_size": 2,
                              "reduce_dtype": "bfloat16"},
    "memory-budget-torch": {"case": "transformer-small", "framework": "torch", "memory_budget": "132M",
                            "inject": "scale"},
    "memory-budget-mxnet": {"case": "transformer-small", "framework": "mxnet", "memory_budget": "132M",
                            "inject": "drop-step"},
    "full-batch-mxnet": {"case": "padded-tokens", "framework": "mxnet", "full_batch": True},
    "full-batch-mxnet-token-count": {"case": "padded-tokens", "framework": "mxnet", "full_batch": True,
                                     "loss_reduction": "token_count"},
    "oracle-jax": {"case": "embed-attention", "framework": "jax", "oracle": True},
    "jax-nojit": {"case": "tiny-grads", "framework": "jax", "jit": False, "inject": "scale"},
    "refused-mxnet-bfloat16": {"case": "embed-attention", "framework": "mxnet", "dtype": "bfloat16"},
    "refused-world-size-mxnet": {"case": "embed-attention", "framework": "mxnet", "world_size": 2},
}
IGNORED = {"seconds", "created", "accumcheck"}  # timing, creation time, accumcheck's version
# Figures made from a sum over a tensor's elements: ``--sums-rtol`` compares them within a relative
# tolerance, for a change that only adds the same numbers in another order (the verdicts, maxima,
# indices and counts stay exact).
SUMMED = {"condition", "rel_err_native", "rel_err_manual", "grad_sum_sq", "norm_share", "spread_predicted",
          "spread_native", "spread_manual"}


def runs() -> list[tuple[str, dict[str, Any]]]:
    """(file stem, what to run) for every run of the snapshot."""
    out = []
    for case in builtin_case_names():
        for framework in FRAMEWORKS:
            for fault in FAULTS:
                out.append((f"{case}--{framework}--{fault or 'clean'}",
                            {"case": case, "framework": framework, "inject": fault}))
    out.append(("data-parallel--" + DATA_PARALLEL["case"], {"framework": "torch", **DATA_PARALLEL}))
    out += [(f"option--{name}", spec) for name, spec in OPTIONS.items()]
    return out


def run_one(spec: dict[str, Any]) -> str:
    """The run's JSON report, or {"error": message} when it raises an AccumcheckError."""
    spec = dict(spec)
    framework = spec.pop("framework")
    try:
        if "+" in framework:
            report = accumcheck.compare_frameworks(frameworks=framework.split("+"), accum_steps=STEPS, **spec)
        else:
            report = accumcheck.compare(framework=framework, accum_steps=STEPS, **spec)
    except accumcheck.AccumcheckError as exc:
        return json.dumps({"error": str(exc)}) + "\n"
    return report.to_json()


def save(folder: Path, only: str | None) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    todo = [(stem, spec) for stem, spec in runs() if only is None or only in stem]
    for i, (stem, spec) in enumerate(todo, 1):
        (folder / f"{stem}.json").write_text(run_one(spec))
        print(f"[{i}/{len(todo)}] {stem}", flush=True)
    return 0


def _normalised(path: Path) -> Any:
    data = json.loads(path.read_text())
    if "error" in data and len(data) == 1:
        return {"error": True}  # refused both times; the messages are printed, not compared
    return _strip(accumcheck.load_report(path).to_dict())


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in IGNORED}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def differences(a: Any, b: Any, where: str = "", sums_rtol: float = 0.0) -> list[str]:
    """Paths where ``a`` and ``b`` differ (floats compared exactly, the SUMMED ones within ``sums_rtol``)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                out.append(f"{where}.{key}: only in {'after' if key in b else 'before'}")
            else:
                out += differences(a[key], b[key], f"{where}.{key}", sums_rtol)
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items before, {len(b)} after"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]", sums_rtol)]
    if (sums_rtol and where.rsplit(".", 1)[-1] in SUMMED and isinstance(a, float) and isinstance(b, float)
            and math.isclose(a, b, rel_tol=sums_rtol)):
        return []
    if type(a) is not type(b) or a != b:
        return [f"{where}: {a!r} before, {b!r} after"]
    return []


def compare(before: Path, after: Path, sums_rtol: float = 0.0) -> int:
    names = sorted(p.name for p in before.glob("*.json"))
    missing = [n for n in names if not (after / n).is_file()]
    failed = 0
    for name in names:
        if name in missing:
            continue
        found = differences(_normalised(before / name), _normalised(after / name), sums_rtol=sums_rtol)
        errors = [json.loads(p.read_text()).get("error") for p in (before / name, after / name)]
        if all(isinstance(e, str) for e in errors) and errors[0] != errors[1]:
            print(f"refused in both, reworded {name}:\n  before: {errors[0]}\n  after:  {errors[1]}")
        if found:
            failed += 1
            print(f"DIFFERS {name}: " + "; ".join(found[:5]) + (f" (+{len(found) - 5} more)" if len(found) > 5 else ""))
    for name in missing:
        print(f"MISSING {name} in {after}")
    compared = len(names) - len(missing)
    print(f"report_snapshot: {compared - failed} of {compared} reports equal"
          + (f", {len(missing)} missing" if missing else ""))
    return 1 if failed or missing or not names else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("save", help="run every case, framework and fault; write one JSON report each")
    s.add_argument("folder", type=Path)
    s.add_argument("--only", metavar="TEXT", help="only the runs whose file name contains TEXT")
    c = sub.add_parser("compare", help="compare two snapshots field by field")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    c.add_argument("--sums-rtol", type=float, default=0.0, metavar="R",
                   help="compare the figures made of sums (%s) within this relative tolerance" % ", ".join(sorted(SUMMED)))
    args = parser.parse_args(argv)
    if args.command == "save":
        return save(args.folder, args.only)
    return compare(args.before, args.after, args.sums_rtol)


if __name__ == "__main__":
    sys.exit(main())

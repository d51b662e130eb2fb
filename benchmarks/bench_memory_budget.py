"""--memory-budget on a big model: what ``accumcheck.torch.check`` holds beside a wide MLP without a
budget and with a quarter of that as its budget, each in a fresh child process.

    (i)   the model's own   build the MLP (plain torch, random weights) and run the plain native
                            accumulation loop: N x forward + ``loss.backward()`` (accumcheck imported,
                            so that the check's children differ from it by the check alone)
    (ii)  unbounded         the same model and batches, ``accumcheck.torch.check(...)``
    (iii) budgeted          the same with ``memory_budget = (peak (ii) - peak (i)) / 4``

Peak memory is each child's ``VmHWM`` (``/proc/self/status``); "above the model's own" is a child's
peak less (i)'s. The figures: the peaks above the model's own of (ii) and (iii), whether (iii) stays
within its budget, the groups it ran, the wall times of the two checks, and whether the two checks
gave the same report (every tensor's verdict and figures, compared as JSON).

Every run writes benchmarks/results/bench_memory_budget.json (or --json FILE); ``figures`` renders
from it the text docs/performance.md and the README quote (``python ci/figures.py --group
benchmarks --write``). Importing this module runs nothing and imports no framework.

    python benchmarks/bench_memory_budget.py             # 51M parameters, N = 4, about a minute
    python benchmarks/bench_memory_budget.py --quick     # 25M parameters
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from machine_info import cpu_family  # benchmarks/ is the script's folder

RESULT = Path(__file__).resolve().parent / "results" / "bench_memory_budget.json"
MIB = 2**20
SHARE = 4  # the budget: a quarter of what the unbounded check adds

CHILD = """
import hashlib, json, sys, time
import torch
import accumcheck.torch
from accumcheck.report.values import encode

width, layers, inputs, batch, steps, what, budget = json.loads(sys.argv[1])
torch.manual_seed(0)
modules = [torch.nn.Linear(inputs, width), torch.nn.ReLU()]
for _ in range(layers):
    modules += [torch.nn.Linear(width, width), torch.nn.ReLU()]
model = torch.nn.Sequential(*modules, torch.nn.Linear(width, 10))
gen = torch.Generator().manual_seed(1)
batches = [(torch.randn(batch, inputs, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
           for _ in range(steps)]
loss_fn = torch.nn.functional.cross_entropy
started = time.perf_counter()
out = {}
if what == "own":
    for x, y in batches:
        loss_fn(model(x), y).backward()
else:
    report = accumcheck.torch.check(model, loss_fn, batches, accum_steps=steps, memory_budget=budget)
    tensors = encode(report)["tensors"]
    out = {"groups": report.groups, "verdicts": sorted({t["verdict"] for t in tensors}),
           "tensors": hashlib.sha256(json.dumps(tensors, sort_keys=True).encode()).hexdigest(),
           "exit_code": report.exit_code}
out["seconds"] = time.perf_counter() - started
out["parameters"] = sum(p.numel() for p in model.parameters())
out["tensors_count"] = len(list(model.parameters()))
out["largest"] = max(p.numel() for p in model.parameters())
out["peak"] = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps(out))
"""


def child(shape: dict, what: str, budget: int | None = None) -> dict:
    """One fresh child process: the model's own loop ("own") or the check; its figures."""
    args = json.dumps([shape["width"], shape["layers"], shape["inputs"], shape["batch"], shape["steps"], what, budget])
    done = subprocess.run([sys.executable, "-c", CHILD, args], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the {what} child failed:\n{done.stderr}")
    return json.loads(done.stdout)


def machine() -> dict:
    import numba
    import numpy as np
    import torch
    from machine_info import cpu_model  # benchmarks/ is the script's folder

    import accumcheck

    return {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
            "numba": numba.__version__, "accumcheck": accumcheck.__version__,
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}


def measure(shape: dict) -> dict:
    own = child(shape, "own")
    whole = child(shape, "check")
    added = whole["peak"] - own["peak"]
    budget = added // SHARE
    grouped = child(shape, "check", budget)
    above = grouped["peak"] - own["peak"]
    return {"parameters": own["parameters"], "tensors": own["tensors_count"], "largest_tensor": own["largest"],
            "own_peak": own["peak"], "own_seconds": own["seconds"],
            "unbounded": {"peak": whole["peak"], "above_own": added, "seconds": whole["seconds"],
                          "groups": whole["groups"], "verdicts": whole["verdicts"]},
            "budgeted": {"budget": budget, "peak": grouped["peak"], "above_own": above, "seconds": grouped["seconds"],
                         "groups": grouped["groups"], "verdicts": grouped["verdicts"],
                         "within_budget": above <= budget},
            "identical": whole["tensors"] == grouped["tensors"] and whole["exit_code"] == grouped["exit_code"]}


def millions(n: int) -> str:
    return f"{n / 1e6:.1f}M"


def mib(n: float) -> str:
    return f"{n / MIB:,.0f} MiB"


def command(result: dict) -> str:
    return "python benchmarks/bench_memory_budget.py" + (" --quick" if result.get("quick") else "")


def model_words(result: dict) -> str:
    s, m = result["shape"], result["measured"]
    return (f"an MLP {s['inputs']} → {s['layers']} × {s['width']} → 10 ({millions(m['parameters'])} parameters in "
            f"{m['tensors']} tensors, the largest {millions(m['largest_tensor'])}), N = {s['steps']} micro-batches of "
            f"{s['batch']}")


def table(result: dict) -> str:
    m = result["measured"]
    whole, part = m["unbounded"], m["budgeted"]
    rows = [("the model's own: build and plain accumulation loop", mib(m["own_peak"]), "—", "—",
             f"{m['own_seconds']:.2f} s"),
            ("`accumcheck.torch.check`, no budget", mib(whole["peak"]), mib(whole["above_own"]), "1",
             f"{whole['seconds']:.2f} s"),
            (f"the same with `memory_budget` = a quarter of that, {mib(part['budget'])}", mib(part["peak"]),
             mib(part["above_own"]) + (" (within the budget)" if part["within_budget"] else " — over the budget"),
             str(part["groups"]), f"{part['seconds']:.2f} s")]
    lines = ["| fresh child process | peak RSS | above the model's own | groups | time |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows]
    return "\n" + "\n".join(lines) + "\n"


def figures(result: dict) -> dict[str, str]:
    """The text docs/performance.md and the README quote from a run (the JSON this script writes):
    ``machine`` (the sentence above the table), ``table``, ``identical`` (whether the two reports
    agree) and ``summary`` (the README's figures in one phrase)."""
    m, info = result["measured"], result["machine"]
    whole, part = m["unbounded"], m["budgeted"]
    return {
        "machine": (f"From one run of `{command(result)}` on this {info['cores']}-core {cpu_family(info['cpu'])} "
                    f"machine (torch {info['torch']}, numba {info['numba']}), {model_words(result)}:"),
        "table": table(result),
        "identical": ("the two checks gave the same report: every tensor's verdict and figures, bit for bit"
                      if m["identical"] else "the two checks' reports differ"),
        "summary": (f"{millions(m['parameters'])} parameters: {mib(whole['above_own'])} beside the model without a "
                    f"budget, {mib(part['above_own'])} with a budget of {mib(part['budget'])} ({part['groups']} groups, "
                    f"{part['seconds'] / whole['seconds']:.1f}× the time, the same verdicts)"
                    if m["identical"] and part["within_budget"] else "see docs/performance.md"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 25M-parameter MLP instead of 51M")
    parser.add_argument("--json", metavar="FILE", default=str(RESULT),
                        help="where to write the figures as JSON (default: benchmarks/results/bench_memory_budget.json)")
    args = parser.parse_args()
    shape = ({"width": 1024, "layers": 24, "inputs": 256, "batch": 8, "steps": 4} if args.quick else
             {"width": 2048, "layers": 12, "inputs": 512, "batch": 8, "steps": 4})
    started = time.perf_counter()
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB; torch {info['torch']}, "
          f"numba {info['numba']}, accumcheck {info['accumcheck']}")
    measured = measure(shape)
    result = {"machine": info, "quick": args.quick, "shape": shape, "share": SHARE, "measured": measured,
              "seconds": time.perf_counter() - started}
    print(figures(result)["machine"])
    print(table(result))
    print(figures(result)["identical"].capitalize())
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0 if measured["identical"] and measured["budgeted"]["within_budget"] else 1


if __name__ == "__main__":
    sys.exit(main())

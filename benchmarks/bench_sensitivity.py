"""How small a one-step fault accumcheck tells from round-off: the worst-case bound against the
statistical tier.

One 64x64 tensor, N = 32 micro-gradients of order 1 (standard normal, float32, seeded). The manual
total adds them in order; the native one scales micro-step 16 by 1 + alpha first (alpha from 1e-8
to 1e-3, four values a decade). Each pair is judged as accumcheck judges a run, with the second
pass replaying the micro-gradients. For every alpha and seed the verdict is recorded; the figures
are the smallest alpha from which every seed is ``suspicious`` or worse, and from which every seed
is ``diverged`` (past the worst-case bound). No timing: the figures are exact for a seed.

Every run writes benchmarks/results/bench_sensitivity.json (or --json FILE); ``figures`` renders
the text docs/maths.md quotes. Importing this module runs nothing.

    python benchmarks/bench_sensitivity.py [--seeds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SHAPE, STEPS, FAULTY = (64, 64), 32, 16
SEEDS = 5
ALPHAS = [10.0 ** (e / 4) for e in range(-32, -11)]  # 1e-8 .. 1e-3
RESULT = Path(__file__).resolve().parent / "results" / "bench_sensitivity.json"
ORDER = ("identical", "round-off", "suspicious", "diverged")


def verdict(alpha: float, seed: int) -> str:
    import numpy as np

    from accumcheck.judge import build_report
    from accumcheck.run.results import ParamAccumulation, RunResult

    grads = np.random.default_rng(seed).standard_normal((STEPS, *SHAPE)).astype(np.float32)
    native = np.zeros(SHAPE, np.float32)
    manual = np.zeros(SHAPE, np.float32)
    for k, g in enumerate(grads):
        manual += g
        native += (g.astype(np.float64) * (1.0 + alpha)).astype(np.float32) if k == FAULTY else g
    wide = grads.astype(np.float64)
    param = ParamAccumulation("w", "weight", native, manual, wide.sum(0), np.abs(wide).sum(0))
    run = RunResult([param], "numpy", {}, "cpu", "float32", "float32")
    report = build_report(None, run, STEPS, None, False, 0.0, {"model": "bench"},
                          lambda names: ({"w": g} for g in grads))
    return report.tensors[0].verdict


def smallest(rows: list[dict], at_least: str) -> float | None:
    """The smallest alpha from which every larger alpha, on every seed, is ``at_least`` or worse."""
    found = None
    for row in sorted(rows, key=lambda r: -r["alpha"]):
        if all(ORDER.index(v) >= ORDER.index(at_least) for v in row["verdicts"]):
            found = row["alpha"]
        else:
            break
    return found


def figures(result: dict) -> dict[str, str]:
    """The quoted text: ``suspicious`` and ``diverged`` (the smallest alpha of each), ``command``
    and ``table`` (verdict counts per alpha)."""
    rows = result["rows"]
    lines = ["| alpha | " + " | ".join(ORDER) + " |", "|---:|" + "---:|" * len(ORDER)]
    for row in rows:
        lines.append(f"| {row['alpha']:.1e} | " + " | ".join(str(row["verdicts"].count(v)) for v in ORDER) + " |")
    return {"suspicious": f"{result['suspicious']:.1e}", "diverged": f"{result['diverged']:.1e}",
            "command": "`python benchmarks/bench_sensitivity.py`",
            "table": "\n" + "\n".join(lines) + "\n"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=SEEDS)
    parser.add_argument("--json", metavar="FILE", default=str(RESULT))
    args = parser.parse_args()
    rows = [{"alpha": alpha, "verdicts": [verdict(alpha, seed) for seed in range(args.seeds)]} for alpha in ALPHAS]
    result = {"shape": list(SHAPE), "steps": STEPS, "faulty_step": FAULTY, "seeds": args.seeds, "rows": rows,
              "suspicious": smallest(rows, "suspicious"), "diverged": smallest(rows, "diverged")}
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    text = figures(result)
    print(text["table"])
    print(f"suspicious from alpha = {text['suspicious']}, diverged from alpha = {text['diverged']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

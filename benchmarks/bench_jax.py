"""What ``accumcheck compare --framework jax`` costs over one plain optax.MultiSteps loop.

The plain loop is what a JAX user runs: the case's model (``transformer-small``) as a jitted
``value_and_grad`` and a jitted ``MultiSteps(optax.sgd(1.0), every_k_schedule=N).update``, N
micro-steps, from fresh functions each time (so both sides compile, as a fresh process does).
``compare`` also runs the manual tree_map buffer, the float64 sums E and S on the host, and judges
every tensor. The two alternate, REPS times each; the figure is the median of the rounds' ratios.

Every run writes its figures to benchmarks/results/bench_jax.json (or --json FILE); ``figures``
renders from that file the text docs/jax.md quotes. Importing this module runs nothing.

    python benchmarks/bench_jax.py [--steps 32] [--reps 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from machine_info import cpu_family, cpu_model, load, write_result  # benchmarks/ is the script's folder

CASE = "transformer-small"
RESULT = Path(__file__).resolve().parent / "results" / "bench_jax.json"


def plain_loop(steps: int) -> None:
    import jax
    import optax

    from accumcheck.case.reading import resolve_case
    from accumcheck.jax.casemodel import CaseParams, case_batches, grad_function

    case = resolve_case(CASE)
    device = jax.devices("cpu")[0]
    params = CaseParams(case, case.weights(), "float32", "float32", device).arrays()
    batches = case_batches(case, steps, "float32", device)
    grad_of = grad_function(case, jit=True)
    optimizer = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=steps)
    state, update = optimizer.init(params), jax.jit(optimizer.update)
    for step in range(steps):
        _, grads = grad_of(params, batches(step))
        updates, state = update(grads, state, params)
    jax.block_until_ready(updates)


def measure(steps: int, reps: int) -> dict:
    import jax
    import optax

    import accumcheck

    def compare() -> None:
        accumcheck.compare(CASE, framework="jax", accum_steps=steps)

    runs = {"compare": compare, "plain": lambda: plain_loop(steps)}
    for run in runs.values():
        run()  # warm up: imports, first compiles
    times: dict[str, list[float]] = {name: [] for name in runs}
    for rep in range(reps):
        for name in (list(runs) if rep % 2 == 0 else list(runs)[::-1]):
            started = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - started)
    return {"case": CASE, "steps": steps, "reps": reps, "jax": jax.__version__, "optax": optax.__version__,
            "compare_s": statistics.median(times["compare"]), "plain_s": statistics.median(times["plain"]),
            "ratio": statistics.median(c / p for c, p in zip(times["compare"], times["plain"])),
            "rounds": times}


def machine() -> dict:
    import platform

    return {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "load_before": load()}


def figures(result: dict) -> dict[str, str]:
    """docs/jax.md's sentence, by name ``summary``."""
    m = result["machine"]
    return {"summary": f"{result['ratio']:.2f}× one plain `optax.MultiSteps` loop (`{result['case']}`, "
                      f"N = {result['steps']}; `benchmarks/bench_jax.py` on a {m['cores']}-core "
                      f"{cpu_family(m['cpu'])})"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", metavar="FILE", default=str(RESULT))
    args = parser.parse_args()
    result = {"machine": machine(), **measure(args.steps, args.reps)}
    print(f"compare --framework jax / plain MultiSteps loop, {CASE}, N = {args.steps}: {result['ratio']:.2f} "
          f"({result['compare_s'] * 1e3:.0f} ms / {result['plain_s'] * 1e3:.0f} ms, median of {args.reps})")
    return write_result(args.json, result)


if __name__ == "__main__":
    sys.exit(main())

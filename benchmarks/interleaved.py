"""Timing variants of one loop against each other on a busy, noisy machine: the variants take
turns in small chunks of steps, in a rotating order, so that drift in the machine's speed falls on
all of them alike."""

from __future__ import annotations

import statistics
from typing import Protocol


class Runner(Protocol):
    def steps(self, n: int, flush: bool) -> float:
        """Run ``n`` steps; their seconds (``flush``: the last chunk of a round)."""

    def close(self) -> None: ...


def rounds(runners: dict[str, Runner], reps: int, steps: int, chunk: int) -> dict[str, list[float]]:
    """Each runner's time for ``steps`` steps in each of ``reps`` rounds, the runners taking turns
    every ``chunk`` steps; every runner is closed at the end."""
    names = list(runners)
    try:
        for runner in runners.values():
            runner.steps(3, flush=True)  # warm up
        times: dict[str, list[float]] = {name: [] for name in names}
        chunks = [chunk] * (steps // chunk) + ([steps % chunk] if steps % chunk else [])
        for round_ in range(reps):
            spent = dict.fromkeys(names, 0.0)
            for c, n in enumerate(chunks):
                for k in range(len(names)):
                    name = names[(round_ + c + k) % len(names)]
                    spent[name] += runners[name].steps(n, flush=c == len(chunks) - 1)
            for name in names:
                times[name].append(spent[name])
        return times
    finally:
        for runner in runners.values():
            runner.close()


def summary(times: dict[str, list[float]], steps: int, aim: float, aimed: tuple[str, ...],
            baseline: str = "plain") -> dict[str, dict]:
    """Each runner's median time, per step, and the median over rounds of its ratio to
    ``baseline`` in the same round, printed as a table (``aimed`` runners marked against ``aim``)."""
    print(f"{'variant':<11} {'ms/step':>8} {'ratio':>7}")
    variants = {}
    for name, rounds_s in times.items():
        ratio = statistics.median(t / p for t, p in zip(rounds_s, times[baseline]))
        median = statistics.median(rounds_s)
        variants[name] = {"median_s": median, "ms_per_step": median / steps * 1e3, "ratio": ratio,
                          "rounds_s": rounds_s}
        mark = f"  aim <= {aim:g}: " + ("PASS" if ratio <= aim else "MISS") if name in aimed else ""
        print(f"{name:<11} {variants[name]['ms_per_step']:8.2f} {ratio:7.3f}{mark}")
    return variants

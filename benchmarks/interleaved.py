"""Timing variants of one loop against each other on a busy, noisy machine: the variants take
turns in small chunks of steps, in a rotating order, so that drift in the machine's speed falls on
all of them alike."""

from __future__ import annotations

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

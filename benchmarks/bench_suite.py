"""How long the README's test command runs its tests: the default suite, as CI runs it.

Runs ``python -m pytest --accum-steps 16,32`` (the README's test command after its install) with
this interpreter in the repository's root, once, and records the wall time, the outcome and the
machine (its load average before and after the run). The suite runs on one pytest-xdist worker
per core (tests/conftest.py). Take it on an idle machine: the suite's runs share the cores with
anything else.
The install before it (a fresh virtual environment) is not timed.

Every run writes its figures to benchmarks/results/bench_suite.json (or --json FILE); ``figures``
renders from that file the text the README quotes. Importing this module runs nothing.

    python benchmarks/bench_suite.py [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = Path(__file__).resolve().parent / "results" / "bench_suite.json"
COMMAND = ["-m", "pytest", "--accum-steps", "16,32", "-q", "-p", "no:cacheprovider"]
COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped)")


def machine() -> dict:
    from machine_info import cpu_family, cpu_model, load  # benchmarks/ is the script's folder

    return {"cpu": cpu_family(cpu_model()), "cores": os.cpu_count(), "python": platform.python_version(),
            "load_before": load()}


def figures(result: dict) -> dict[str, str]:
    """The text the README quotes from a run (the JSON this script writes), by name: ``readme``
    (how long the tests take, on which Python and machine)."""
    cpu, cores = result["machine"]["cpu"], result["machine"]["cores"]
    minutes = round(result["seconds"] / 60)
    return {"readme": f"Python {result['machine']['python'].rsplit('.', 1)[0]}; its tests take about {minutes} "
                      f"minutes on a {cores}-core {cpu}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", default=str(RESULT),
                        help="where to write the figures as JSON (default: benchmarks/results/bench_suite.json)")
    args = parser.parse_args(argv)
    about = machine()
    started = time.perf_counter()
    run = subprocess.run([sys.executable, *COMMAND], cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    lines = run.stdout.strip().splitlines() or [""]
    last = lines[-1]
    for line in lines:  # what failed, as pytest's summary names it
        if line.startswith(("FAILED ", "ERROR ")):
            print(line)
    counts = {word.rstrip("s") if word.startswith("error") else word: int(n) for n, word in COUNTS.findall(last)}
    print(last)
    print(f"the default suite took {seconds:.0f} s ({seconds / 60:.1f} min) on {about['cores']} cores of "
          f"{about['cpu']}, exit code {run.returncode}")
    from machine_info import load, write_result  # benchmarks/ is the script's folder

    about["load_after"] = load()  # the 1-minute average: the suite's own last minute counts in it
    write_result(args.json, {"machine": about, "command": "python " + " ".join(COMMAND), "seconds": seconds,
                             "exit_code": run.returncode, "counts": counts})
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())

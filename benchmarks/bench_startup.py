"""What an installed accumcheck costs a pytest run that does not use it.

Runs ``pytest`` on one trivial test file, alternately with the accumcheck plugin loaded (as it is
wherever accumcheck is installed: pytest loads it through its ``pytest11`` entry point) and
blocked with ``-p no:accumcheck`` (pytest then never imports accumcheck: the same as not
installed), REPS times each, interleaved, and prints the median wall time of each and the
median of the rounds' paired differences (with its quartiles). Also times ``python -c "import
accumcheck"`` against ``python -c "pass"``, and lists what importing the plugin module loads
beyond what pytest itself has loaded.

Every run writes its figures to benchmarks/results/bench_startup.json (or --json FILE);
``figures`` renders from that file the text docs/performance.md quotes. Importing this module
runs nothing.

    python benchmarks/bench_startup.py [--reps 21] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

AIM_S = 0.1  # the most an unused plugin may add to a pytest start
REPS = 21  # the default of --reps
RESULT = Path(__file__).resolve().parent / "results" / "bench_startup.json"
LOADED = "pytest, accumcheck plugin loaded"
BLOCKED = "pytest, accumcheck plugin blocked"


def timed(command: list[str], cwd: str) -> float:
    started = time.perf_counter()
    subprocess.run(command, cwd=cwd, check=True, capture_output=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    return time.perf_counter() - started


def interleaved(commands: dict[str, list[str]], reps: int, cwd: str) -> dict[str, list[float]]:
    """Each command once per round, ``reps`` rounds, after one warm-up round."""
    for command in commands.values():
        timed(command, cwd)
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(reps):
        for name, command in commands.items():
            times[name].append(timed(command, cwd))
    return times


def machine() -> dict:
    from machine_info import cpu_model  # benchmarks/ is the script's folder

    model = cpu_model()
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "pytest": version("pytest"), "accumcheck": version("accumcheck")}


# ----------------------------------------------------------------------------- the docs' text


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def figures(result: dict) -> dict[str, str]:
    """The text docs/performance.md quotes from a run (the JSON this script writes), by name:
    ``command`` (the command line, as code), ``plugin`` (what the plugin adds to a pytest start),
    ``quartiles`` (of the rounds' differences), ``pytest`` (a pytest start with the plugin
    blocked), ``aim``, ``import`` (what ``import accumcheck`` adds) and ``loaded`` (what
    importing the plugin loads)."""
    low, high = result["plugin_quartiles_s"]
    extra = [m for m in result["loaded"] if m != "accumcheck"]
    flags = f" --reps {result['reps']}" if result["reps"] != REPS else ""
    return {"command": f"`python benchmarks/bench_startup.py{flags}`",
            "plugin": ms(result["plugin_s"]),
            "quartiles": f"{low * 1000:.0f} to {ms(high)}",
            "pytest": ms(result["median_s"][BLOCKED]),
            "aim": ms(result["aim_s"]),
            "import": ms(result["import_s"]),
            "loaded": "loads no module beyond the package itself" if not extra else
                      "loads, beyond the package itself, " + ", ".join(extra)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=REPS)
    parser.add_argument("--json", metavar="FILE", default=str(RESULT),
                        help="where to write the figures as JSON (default: benchmarks/results/bench_startup.json)")
    args = parser.parse_args(argv)
    python = sys.executable
    with tempfile.TemporaryDirectory(prefix="accumcheck-startup-") as folder:
        Path(folder, "test_trivial.py").write_text("def test_nothing():\n    pass\n")
        pytest = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_trivial.py"]
        times = interleaved({
            LOADED: pytest,
            BLOCKED: pytest + ["-p", "no:accumcheck"],
            "python -c 'import accumcheck'": [python, "-c", "import accumcheck"],
            "python -c 'pass'": [python, "-c", "pass"],
        }, args.reps, folder)
        loaded = json.loads(subprocess.run(
            [python, "-c", "import json, sys, pytest; before = set(sys.modules); import accumcheck.plugin; "
             "print(json.dumps(sorted(m for m in set(sys.modules) - before if '.' not in m)))"],
            cwd=folder, capture_output=True, text=True, check=True).stdout)
    median = {name: statistics.median(values) for name, values in times.items()}
    # Each round's two runs, one after the other, as a pair: the machine's drift cancels.
    pairs = sorted(a - b for a, b in zip(times[LOADED], times[BLOCKED]))
    plugin = statistics.median(pairs)
    quartiles = statistics.quantiles(pairs, n=4)
    package = statistics.median(a - b for a, b in zip(times["python -c 'import accumcheck'"], times["python -c 'pass'"]))
    print(f"{args.reps} interleaved runs each, medians:")
    for name, value in median.items():
        print(f"  {name:40s} {value * 1000:7.1f} ms")
    print(f"the plugin adds {plugin * 1000:.1f} ms to a pytest start (median of the rounds' differences; quartiles "
          f"{quartiles[0] * 1000:.1f} to {quartiles[2] * 1000:.1f} ms; aim <= {AIM_S * 1000:.0f} ms): "
          f"{'met' if plugin <= AIM_S else 'MISSED'}; import accumcheck adds {package * 1000:.1f} ms")
    print(f"top-level modules that importing the plugin loads beyond pytest's own: {loaded}")
    result = {"machine": machine(), "reps": args.reps, "median_s": median, "plugin_s": plugin,
              "plugin_quartiles_s": [quartiles[0], quartiles[2]], "import_s": package, "aim_s": AIM_S,
              "loaded": loaded}
    from machine_info import write_result  # benchmarks/ is the script's folder

    return write_result(args.json, result)


if __name__ == "__main__":
    sys.exit(main())

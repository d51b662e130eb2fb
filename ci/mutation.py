"""Mutation testing of the modules accumcheck's verdicts rest on.

    python ci/mutation.py            # a fresh run: mutants/ is rebuilt
    python ci/mutation.py --cached   # reuse mutants/; every mutant not yet killed is tried again
    python ci/mutation.py --report   # only read the results of the last run

mutmut (configured under [tool.mutmut] in pyproject.toml: the modules, and the unit-level tests
it runs) changes one thing at a time in the listed modules and runs the tests that reach the
changed function. This script then counts, per module, the mutants the tests killed, those that
survived, and the survivors listed in ci/mutation_equivalents.toml as equivalent (no observable
change, each with its reason), writes ci/mutation_scores.json and prints a table.

Exit status 1 when a module scores below 90 % (killed / (total - equivalent)), when a survivor is
neither killed nor listed, or when the list is stale: a listed mutant that no longer exists, that
changes another line than the one listed, or that the tests now kill.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = ROOT / "mutants"
SCORES = ROOT / "ci" / "mutation_scores.json"
EQUIVALENTS = ROOT / "ci" / "mutation_equivalents.toml"
COMMAND = "python ci/mutation.py"
MIN_SCORE = 0.9

# mutmut's exit code per mutant: a failing test (1; 3 for an error inside pytest), a timeout or a
# crash all mean the change was detected. None: not tried yet.
KILLED = {1, 3, 24, -24, 36, 152, 255, -9, -11}


def modules() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    return sorted(config["only_mutate"])


def environment() -> dict[str, str]:
    """mutmut forks every mutant's test run from a process that has already run the tests. GNU
    OpenMP, numba's default threading layer here and torch's, cannot run again in a forked child,
    so the compiled kernel runs on numba's workqueue layer and torch on one thread (two runs in
    parallel on two cores would only oversubscribe them anyway)."""
    env = dict(os.environ)
    env.update(NUMBA_THREADING_LAYER="workqueue", NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.setdefault("NUMBA_CACHE_DIR", str(MUTANTS / "numba-cache"))
    return env


def run_mutmut(names: list[str], max_children: int | None) -> int:
    command = [sys.executable, "-m", "mutmut", "run"]
    if max_children:
        command += ["--max-children", str(max_children)]
    return subprocess.run(command + names, cwd=ROOT, env=environment()).returncode


def exit_codes(module: str) -> dict[str, int | None]:
    meta = MUTANTS / (module + ".meta")
    if not meta.is_file():
        return {}
    return json.loads(meta.read_text())["exit_code_by_key"]


def changes(module: str) -> dict[str, str]:
    """Each mutant's change, as the lines it puts in place of the original's (stripped, joined by
    ' / '; '' when it only deletes), read from mutmut's copy of the module."""
    path = MUTANTS / module
    if not path.is_file():
        return {}
    source = path.read_text()
    lines = source.splitlines()
    functions = {node.name: node for node in ast.walk(ast.parse(source))
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def text(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:  # the name left out
        first, *rest = lines[node.lineno - 1:node.end_lineno]
        return [first.replace(node.name, "", 1), *rest]

    found = {}
    for name, node in functions.items():
        base, _, number = name.rpartition("__mutmut_")
        if not base or not number.isdigit() or base + "__mutmut_orig" not in functions:
            continue
        diff = difflib.unified_diff(text(functions[base + "__mutmut_orig"]), text(node), lineterm="", n=0)
        added = [line[1:].strip() for line in diff if line.startswith("+") and not line.startswith("+++")]
        found[name] = " / ".join(added)
    return found


def compiled(module: str) -> set[str]:
    """The module's numba-compiled functions: a mutant of one would need a trampoline numba cannot
    compile. mutmut leaves decorated functions alone; this checks that it did."""
    tree = ast.parse((ROOT / module).read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
            and any("jit" in ast.unparse(d) for d in node.decorator_list)}


def load_equivalents() -> dict[str, dict[str, str]]:
    if not EQUIVALENTS.is_file():
        return {}
    listed: dict[str, dict[str, str]] = {}
    for entry in tomllib.loads(EQUIVALENTS.read_text()).get("equivalent", []):
        if set(entry) != {"mutant", "change", "reason"} or not entry["reason"].strip():
            raise SystemExit(f"{EQUIVALENTS.name}: each entry needs mutant, change and reason: {entry}")
        if entry["mutant"] in listed:
            raise SystemExit(f"{EQUIVALENTS.name}: {entry['mutant']} is listed twice")
        listed[entry["mutant"]] = entry
    return listed


def tally(equivalents: dict[str, dict[str, str]]) -> tuple[dict[str, dict[str, float]], list[str]]:
    """Per module: total, killed, survived, equivalent and score; and every problem found."""
    table: dict[str, dict[str, float]] = {}
    problems: list[str] = []
    seen: set[str] = set()
    for module in modules():
        codes = exit_codes(module)
        if not codes:
            problems.append(f"{module}: no results (did mutmut run over it?)")
        changed = changes(module)
        kernels = compiled(module)
        killed = survived = equivalent = 0
        for key, code in sorted(codes.items()):
            name = key.rpartition(".")[2]
            if name.rpartition("__mutmut_")[0].removeprefix("x_") in kernels:
                problems.append(f"{key}: a mutant of a numba-compiled function")
            listed = equivalents.get(key)
            if listed is not None:
                seen.add(key)
                if listed["change"] != changed.get(name):
                    problems.append(f"{key}: listed as equivalent for the change {listed['change']!r}, "
                                    f"but it now makes {changed.get(name)!r}")
            if code is None:
                problems.append(f"{key}: not tried")
            elif code in KILLED:
                killed += 1
                if listed is not None:
                    problems.append(f"{key}: listed as equivalent, but the tests kill it")
            else:
                survived += 1
                if listed is not None:
                    equivalent += 1
                else:
                    problems.append(f"{key}: survived (exit {code}): {changed.get(name)!r}")
        total = len(codes)
        scored = total - equivalent
        score = killed / scored if scored else 1.0
        table[module] = {"total": total, "killed": killed, "survived": survived, "equivalent": equivalent,
                         "score": round(score, 4)}
        if score < MIN_SCORE:
            problems.append(f"{module}: score {score:.1%} is below {MIN_SCORE:.0%}")
    for key in sorted(set(equivalents) - seen):
        problems.append(f"{key}: listed as equivalent, but there is no such mutant")
    return table, problems


def render(table: dict[str, dict[str, float]]) -> str:
    width = max(len(m) for m in table) if table else 6
    rows = [f"{'module':<{width}}  {'total':>5}  {'killed':>6}  {'survived':>8}  {'equiv':>5}  {'score':>6}"]
    for module, row in table.items():
        rows.append(f"{module:<{width}}  {row['total']:>5}  {row['killed']:>6}  {row['survived']:>8}  "
                    f"{row['equivalent']:>5}  {row['score']:>6.1%}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--cached", action="store_true", help="reuse mutants/, trying again every mutant not killed")
    how.add_argument("--report", action="store_true", help="only read the results of the last run")
    parser.add_argument("--max-children", type=int, help="mutants tried in parallel (default: one per core)")
    args = parser.parse_args(argv)
    if not args.report:
        if not args.cached and MUTANTS.exists():
            shutil.rmtree(MUTANTS)
        if run_mutmut([], args.max_children):
            print("mutmut run failed", file=sys.stderr)
            return 1
        if args.cached:  # results stand once decided: try the survivors against today's tests
            again = [key for module in modules() for key, code in exit_codes(module).items() if code not in KILLED]
            if again and run_mutmut(again, args.max_children):
                print("mutmut run failed", file=sys.stderr)
                return 1
    table, problems = tally(load_equivalents())
    SCORES.write_text(json.dumps({"command": COMMAND, "modules": table}, indent=2, sort_keys=True) + "\n")
    print(render(table))
    for problem in problems:
        print("FAIL", problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

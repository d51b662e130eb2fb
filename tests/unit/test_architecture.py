"""The house's rules, read from the source: imports run one way, and only the framework packages
(and each training stack's integration, its own framework) name a framework.

The floors, lowest first (a module may import from its own floor and the floors below):

  core          everything not named below: bounds, options, files, errors, accumcheck.case (the
                built-in and file cases), accumcheck.run (config, the backend interface and
                registry, faults, resources), accumcheck.repro, reports, renderers, diagnostics'
                framework-free parts
  judge         accumcheck.judge: statistics, verdicts, data-parallel and cross-framework checks
  frameworks    accumcheck.torch, accumcheck.mxnet, accumcheck.jax: one package per framework
  entry points  accumcheck (the package's face, and ``python -m accumcheck``), accumcheck.api, .cli, .plugin, .assertions, and
                accumcheck.integrations (one module per training stack)

Every import counts, at module level or inside a function.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "accumcheck"
FLOORS = ("core", "judge", "frameworks", "entry points")
ENTRY_POINTS = {"accumcheck", "accumcheck.__main__", "accumcheck.api", "accumcheck.cli", "accumcheck.plugin", "accumcheck.assertions"}
FRAMEWORKS = ("torch", "mxnet", "jax")
# Each training stack's integration and the one framework it may name.
INTEGRATIONS = {"accumcheck.integrations.transformers": "torch", "accumcheck.integrations.accelerate": "torch",
                "accumcheck.integrations.lightning": "torch", "accumcheck.integrations.deepspeed": "torch",
                "accumcheck.integrations.gluon": "mxnet", "accumcheck.integrations.keras": "torch"}


def framework_of(module: str) -> str | None:
    """The framework whose package ``module`` is in, if any."""
    for framework in FRAMEWORKS:
        if module == f"{PACKAGE}.{framework}" or module.startswith(f"{PACKAGE}.{framework}."):
            return framework
    return None


def floor_of(module: str) -> str:
    if module in ENTRY_POINTS or module.startswith("accumcheck.integrations"):
        return "entry points"
    if module == "accumcheck.judge" or module.startswith("accumcheck.judge."):
        return "judge"
    return "frameworks" if framework_of(module) else "core"


def modules(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package under ``root``."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` imports, anywhere in its body."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # ``from X import Y``: Y may be a module of X, or a name defined in X
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # import a.b.c: the deepest module that exists
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path, package: str = PACKAGE) -> dict[str, set[str]]:
    known = modules(root, package)
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of the graph: its strongly connected components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Imports that run from a lower floor up to a higher one."""
    return sorted(f"{a} ({floor_of(a)}) -> {b} ({floor_of(b)})" for a, targets in graph.items() for b in targets
                  if FLOORS.index(floor_of(b)) > FLOORS.index(floor_of(a)))


def framework_mentions(source: str) -> list[str]:
    """Where code (not a docstring or comment) imports or names a framework: an import of it, a
    name or attribute called after it, or a string that is its name or a module path into it."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    module_path = re.compile(rf"({'|'.join(FRAMEWORKS)})(\.\w+)*")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] in FRAMEWORKS]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in FRAMEWORKS:
            found.append(f"line {node.lineno}: from {node.module} import")
        elif isinstance(node, ast.Name) and node.id in (*FRAMEWORKS, "mx"):
            found.append(f"line {node.lineno}: name {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in FRAMEWORKS:
            found.append(f"line {node.lineno}: attribute .{node.attr}")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
              and module_path.fullmatch(node.value)):
            found.append(f"line {node.lineno}: string {node.value!r}")
    return found


# ----------------------------------------------------------------------------- the rules, held


def test_the_package_imports_in_no_circle():
    assert cycles(import_graph(ROOT)) == []


def test_no_import_runs_from_a_lower_floor_up():
    assert upward(import_graph(ROOT)) == []


def named_frameworks(mention: str) -> set[str]:
    """The frameworks a mention from ``framework_mentions`` names (``mx`` is MXNet)."""
    words = set(re.findall(r"\w+", mention.partition(": ")[2]))
    return {f for f in FRAMEWORKS if f in words} | ({"mxnet"} if "mx" in words else set())


def room_of(module: str) -> str:
    """The folder (or root module) a module lives in: ``accumcheck.run.config`` is in ``run``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "accumcheck"


def two_way_rooms(graph: dict[str, set[str]]) -> list[str]:
    """Pairs of rooms each importing the other (a circle between folders, if not between modules)."""
    edges = {(room_of(a), room_of(b)) for a, targets in graph.items() for b in targets if room_of(a) != room_of(b)}
    return sorted(f"{a} <-> {b}" for a, b in edges if (b, a) in edges and a < b)


def test_no_two_folders_import_each_other():
    assert two_way_rooms(import_graph(ROOT)) == []


def test_only_a_framework_package_or_its_integration_names_a_framework():
    offenders = {}
    for name, path in modules(ROOT).items():
        if framework_of(name):  # its own framework, and another only to borrow inside a function
            continue
        own = {INTEGRATIONS[name]} if name in INTEGRATIONS else set()
        found = [m for m in framework_mentions(path.read_text()) if not named_frameworks(m) <= own]
        if found:
            offenders[name] = found
    assert offenders == {}


def test_every_integration_is_known_and_imports_only_its_own_framework():
    graph = import_graph(ROOT)
    integrations = {name for name in graph if name.startswith("accumcheck.integrations.")}
    assert integrations == set(INTEGRATIONS)
    crossed = {name: sorted(t for t in graph[name] if framework_of(t) not in (None, own))
               for name, own in INTEGRATIONS.items()}
    assert {name: ts for name, ts in crossed.items() if ts} == {}


def test_the_package_adds_no_import_finder_and_its_public_paths_are_folders():
    script = ("import sys; before = list(sys.meta_path); import accumcheck, accumcheck.torch, accumcheck.mxnet, "
              "accumcheck.jax; print(len(sys.meta_path) - len(before), "
              "[m.__file__ for m in (accumcheck.torch, accumcheck.mxnet, accumcheck.jax)])")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    added, files = result.stdout.split(" ", 1)
    assert added == "0", result.stderr
    for framework in FRAMEWORKS:
        assert str(ROOT / PACKAGE / framework / "__init__.py") in files
    assert not (ROOT / PACKAGE / "frameworks").exists()


def test_the_root_holds_at_most_ten_modules():
    flat = sorted(p.name for p in (ROOT / PACKAGE).glob("*.py"))
    assert len(flat) <= 10, flat


def test_every_module_is_small():
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules(ROOT).items()}
    # The compiled comparator kernel's module is allowed its length: the kernel is one loop.
    assert {name: n for name, n in sizes.items() if n > 450 and name != "accumcheck.judge.statistics"} == {}


# ----------------------------------------------------------------------------- the checks bite


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_a_circle_is_found_also_through_a_function_level_import(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "report.py": "from .sweep import SweepReport\n",
        "sweep.py": "def sweep():\n    from .api import compare\n",
        "api.py": "from . import report\n",
    })
    assert cycles(import_graph(root)) == [["accumcheck.api", "accumcheck.report", "accumcheck.sweep"]]


def test_an_upward_import_is_found(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "", "case/__init__.py": "", "case/definition.py": "from ..torch import backend\n",
        "torch/__init__.py": "", "torch/backend.py": "",
    })
    assert upward(import_graph(root)) == [
        "accumcheck.case.definition (core) -> accumcheck.torch.backend (frameworks)"]


def test_two_folders_importing_each_other_are_found(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "", "run/__init__.py": "", "run/config.py": "from ..options import spec\n",
        "options/__init__.py": "", "options/spec.py": "from ..run.budget import byte_count\n", "run/budget.py": "",
    })
    assert two_way_rooms(import_graph(root)) == ["options <-> run"]


def test_framework_names_in_code_are_found_and_docstrings_are_not():
    source = '''"""Runs on torch and mxnet."""
import torch.nn
from mxnet import gluon


def f(framework, options):
    """Not for "torch" only."""
    # torch in a comment
    if framework != "torch" or options.mxnet:
        return importlib.util.find_spec("torch.cuda"), mx
    return "compared with torch.testing's defaults"
'''
    assert sorted(framework_mentions(source)) == [
        "line 10: name mx", "line 10: string 'torch.cuda'", "line 2: import torch.nn", "line 3: from mxnet import",
        "line 9: attribute .mxnet", "line 9: string 'torch'"]

"""The core imports no deep-learning framework: not on import, not when comparing or rendering."""

import subprocess
import sys

SCRIPT = r"""
import sys
import numpy as np
import accumcheck
from accumcheck.judge import build_report
from accumcheck.run.registry import backend_names, get_backend, installed_backends
from accumcheck.run.results import ParamAccumulation, RunResult
from accumcheck.case.reading import builtin_case
from accumcheck.render import FORMATS, render

# Finding, listing and asking backends what they can do imports no framework.
installed_backends()
for name in backend_names():
    get_backend(name, installed=False).capabilities
accumcheck.configure({"case": "shared-weight"})
case = builtin_case("shared-weight")
g = np.ones((16, 16), np.float32)
params = [ParamAccumulation("shared.weight", "weight", g, g.copy(), g.astype(np.float64),
                            g.astype(np.float64))]
run = RunResult(params=params, framework="none", versions={}, device="cpu", param_dtype="float32",
                accum_dtype="float32")
report = build_report(case, run, 4, None, False, 0.0)
assert report.tensors[0].verdict == "identical"
for fmt in FORMATS:
    render(report, fmt)

# A data-parallel report is judged and drawn by the core alone too.
import accumcheck.cli, accumcheck.run.launch, accumcheck.plugin
from accumcheck.run.results import RankAccumulation
from accumcheck.report import DataParallelSetup
rank = RankAccumulation(0, "host", {"shared.weight": g}, {"shared.weight": g.astype(np.float64)},
                        {"shared.weight": g.astype(np.float64)}, {"shared.weight": g})
params[0].reference = g.copy()
run.ranks = [rank]
run.data_parallel = DataParallelSetup(world_size=1, backend="gloo", launcher="test", reduce_dtype="float32",
                                      find_unused_parameters=False, hosts=["host"], fault_rank=None, native="-",
                                      manual="-", reference="-", micro_batches="-")
report = build_report(case, run, 4, None, False, 0.0)
assert report.exit_code == 0 and report.data_parallel.ranks_agree
for fmt in FORMATS:
    render(report, fmt)
loaded = [m for m in ("torch", "mxnet", "jax", "tensorflow") if m in sys.modules]
print("LOADED", loaded)
"""


def test_core_imports_no_framework():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "LOADED []" in result.stdout


def test_the_plugin_and_the_package_load_nothing_heavy():
    """What every pytest start pays where accumcheck is installed: importing the plugin (and so
    the package) loads neither numpy, numba, rich, matplotlib nor any framework."""
    script = ("import sys, accumcheck.plugin; "
              "print(sorted(m for m in ('numpy', 'numba', 'rich', 'matplotlib', 'torch', 'mxnet', 'accumcheck.api')"
              " if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "[]", (result.stdout, result.stderr)

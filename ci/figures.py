"""Every figure the README and docs/ quote from a run, regenerated from the runs themselves.

    python ci/figures.py                      # recompute each group this environment can run; compare
    python ci/figures.py --write              # ... and write the new values into the text
    python ci/figures.py --group torch        # one group (torch, your-model, data-parallel, mxnet,
                                              # mxnet-1.6.0, benchmarks); --list shows them

In the text a figure is marked ``<!--fig NAME-->text<!--/fig-->``: inline, around a number in a
sentence, or on lines of their own around a whole console block. The markers are HTML comments,
invisible on GitHub and in the built docs. The example programs are not figures: the docs show
them from examples/ itself (``--8<--``). A group is one set of runs; each returns its figures
by name, formatted as the text shows them. Timings inside console blocks (``· 1.25s``) are the
only part compared loosely. ``benchmarks`` reads benchmarks/results/*.json, which the benchmark
scripts write (``--json``); it checks that the text quotes the last measured run and re-measures
nothing. ``mxnet-1.6.0`` runs in the environment ci/mxnet_16708.sh builds.

Exit code: 0 when every figure matches (or was written), 1 when one differs, 2 when a marker
names no known figure or a group's figure is quoted nowhere.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

# The float32 kernels of MKL, oneDNN, OpenBLAS and PyTorch's own are picked by the CPU (SSE, AVX2,
# AVX-512, AMX), and they round differently: figures that follow round-off (ulps, a trajectory
# under Adam) differ between CPUs. The figures are made with every library held to its baseline
# x86-64 kernels, which every x86 CPU runs alike (MKL's conditional numerical reproducibility
# mode); the settings must be in place before the libraries load, they replace whatever the machine
# set (some set OPENBLAS_CORETYPE for a CPU OpenBLAS does not know), and the runs started from here
# inherit them (``hold_kernels``, called first by ``main`` and by the slow figure test).
BASELINE_KERNELS = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default", "DNNL_MAX_CPU_ISA": "SSE41",
                    "OPENBLAS_CORETYPE": "Prescott"}


def hold_kernels() -> None:
    """Hold the libraries to their baseline kernels in this process (before they load) and its children."""
    os.environ.update(BASELINE_KERNELS)


ROOT = Path(__file__).resolve().parents[1]
TEXTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RESULTS = ROOT / "benchmarks" / "results"
MARK = re.compile(r"<!--fig ([\w.\-]+)-->(.*?)<!--/fig-->", re.S)
TIMING = re.compile(r"· \d+(\.\d+)?s\b")

Group = Callable[[], dict[str, str]]
GROUPS: dict[str, tuple[Group, str]] = {}


def group(name: str, needs: str) -> Callable[[Group], Group]:
    """Register a group of figures; ``needs`` says what environment it runs in (checked by ``can_run``)."""
    def register(fn: Group) -> Group:
        GROUPS[name] = (fn, needs)
        return fn
    return register


def can_run(needs: str) -> bool:
    if needs == "nothing":
        return True
    if needs == "torch":
        return importlib.util.find_spec("torch") is not None
    package, _, version = needs.partition("==")
    if importlib.util.find_spec(package) is None:
        return False
    from importlib.metadata import version as installed

    return not version or installed(package) == version


# ----------------------------------------------------------------------------- formatting


def sig(x: float, digits: int = 3) -> str:
    """As the reports print numbers: %g with ``digits`` significant digits."""
    return f"{x:.{digits}g}"


SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def power_of_ten(x: float) -> str:
    """The decade of x: 10⁵ for 3.1e5."""
    return "10" + str(int(math.floor(math.log10(x)))).translate(SUPERSCRIPT)


def times_ten(x: float, digits: int = 2) -> str:
    """3.4·10⁶."""
    exponent = int(math.floor(math.log10(abs(x))))
    mantissa = round(x / 10**exponent, digits - 1)
    if mantissa >= 10:
        mantissa, exponent = mantissa / 10, exponent + 1
    return f"{mantissa:.{digits - 1}f}·10" + str(exponent).translate(SUPERSCRIPT)


def e_notation(x: float, digits: int = 1) -> str:
    """7e4, 1e6 (3.6e-7 with two digits): e-notation without the exponent's padding."""
    mantissa, exponent = f"{x:.{digits - 1}e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def thousands(x: float, digits: int = 2) -> str:
    """1,600: ``digits`` significant digits, with a thousands separator."""
    return f"{float(sig(x, digits)):,.0f}"


def rounded(x: float, digits: int = 2) -> str:
    """297.4 -> 300: ``digits`` significant digits, written out without an exponent."""
    return f"{float(sig(x, digits)):.{max(digits - 1 - int(math.floor(math.log10(abs(x)))), 0)}f}" if x else "0"


def words(n: int) -> str:
    return {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}.get(n, str(n))


# ----------------------------------------------------------------------------- running


def cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """The installed command line, as a user's terminal would show it piped at 120 columns (COLUMNS
    set: a parent that loaded readline, as pytest does, would pass on its own terminal's width)."""
    exe = Path(sys.executable).parent / "accumcheck"
    result = subprocess.run([str(exe), *args], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "COLUMNS": "120", **(env or {})}, timeout=900)
    if result.returncode not in (0, 1):
        raise RuntimeError(f"accumcheck {' '.join(args)} failed:\n{result.stderr}")
    return result.returncode, result.stdout


def console(command: str, output: str, keep: Callable[[list[str]], list[str]] | None = None) -> str:
    """A console block: the command, then its output (``keep`` elides lines, writing ``...``)."""
    lines = [line.rstrip() for line in output.rstrip("\n").splitlines()]
    lines = keep(lines) if keep else lines
    return "\n```\n$ " + command + "\n" + "\n".join(lines) + "\n```\n"


def with_wrapped(lines: list[str], keep: Callable[[str], bool]) -> list[str]:
    """The lines ``keep`` picks, each with the lines it wrapped onto (indented deeper, under it)."""
    out, depth = [], None
    for line in lines:
        indent = len(line) - len(line.lstrip(" "))
        if keep(line):
            out.append(line)
            depth = indent
        elif depth is not None and line.strip() and indent > depth:
            out.append(line)
        else:
            depth = None
    return out


def synthetic_causes() -> list[tuple[str, str]]:
    """The explanations no --inject makes, judged as a run is: 16 standard-normal 32x32
    micro-gradients, the native total computed as the first column says."""
    import numpy as np

    from accumcheck.judge import build_report
    from accumcheck.run.results import ParamAccumulation, RunResult

    grads = np.random.default_rng(0).standard_normal((16, 32, 32)).astype(np.float32)

    def total(step=lambda t, k, g: t + g) -> np.ndarray:
        t = np.zeros(grads.shape[1:], np.float32)
        for k, g in enumerate(grads):
            t = step(t, k, g).astype(np.float32)
        return t

    noisy = (grads * (1 + 1e-3 * np.random.default_rng(1).standard_normal(grads.shape))).astype(np.float32)
    natives = {
        "(the total halved)": total() * np.float32(0.5),
        "(the total kept in float16)": total(lambda t, k, g: (t + g).astype(np.float16)),
        "(the total times 16 at every step, each micro-gradient times 8/9)":
            total(lambda t, k, g: t * np.float32(16) + g * np.float32(8 / 9)),
        "(micro-gradients computed differently, relative 1e-3)": total(lambda t, k, g: t + noisy[k]),
    }
    rows = []
    wide = grads.astype(np.float64)
    for what, native in natives.items():
        param = ParamAccumulation("w", "weight", native, total(), wide.sum(0), np.abs(wide).sum(0))
        run = RunResult([param], "numpy", {}, "cpu", "float32", "float32")
        report = build_report(None, run, len(grads), None, False, 0.0, {"model": "m"},
                              lambda names: ({"w": g} for g in grads))
        rows.append((what, report.tensors[0].cause.detail))
    return rows


def cases() -> list[str]:
    from accumcheck.case.reading import builtin_case_names

    return list(builtin_case_names())


# ----------------------------------------------------------------------------- PyTorch


@group("torch", needs="torch")
def torch_figures() -> dict[str, str]:
    import accumcheck

    figures: dict[str, str] = {}
    code, out = cli("compare", "--case", "shared-weight", "--inject", "double-step")
    figures["torch.double-step.console"] = console("accumcheck compare --case shared-weight --inject double-step", out)

    _, out = cli("compare")
    figures["torch.clean.ok"] = f"`{out.strip().splitlines()[-1]}`"

    ill = accumcheck.compare("tiny-grads", framework="torch", accum_steps=1000)
    marked = [t for t in ill.tensors if t.ill_conditioned]
    example = next(t for t in marked if t.name == "dense1.weight")
    figures["torch.ill.count"] = words(len(marked))
    figures["torch.ill.label"] = f"`{marked[0].label}`"
    figures["torch.ill.max-e"] = sig(example.max_abs_grad)
    figures["torch.ill.error"] = sig(max(example.err_native, example.err_manual))
    figures["torch.ill.bound"] = sig(example.bound_at_worst)

    sweep = accumcheck.sweep("tiny-grads", [1, 4, 16, 64, 256], framework="torch")
    growth = {row["N"]: max(row["kinds"]["weight"]["native"], row["kinds"]["weight"]["manual"]) for row in sweep.rows()}
    figures["torch.sweep.n4"] = sig(growth[4], 1)
    figures["torch.sweep.n256"] = sig(growth[256], 2)

    command = ["compare", "--case", "transformer-small", "--dtype", "bfloat16", "--accum-steps", "32"]
    _, out = cli(*command)
    figures["torch.bf16.console"] = console("accumcheck " + " ".join(command), out,
                                            lambda lines: ["...", lines[-1].split("), ")[0] + "), ..."])
    bf16 = accumcheck.compare("transformer-small", framework="torch", dtype="bfloat16", accum_steps=32)
    figures["torch.bf16.native-ulps"] = times_ten(max(t.err_ulps_native for t in bf16.tensors))
    figures["torch.bf16.manual-ulps"] = sig(max(t.err_ulps_manual for t in bf16.tensors), 2)

    mean = accumcheck.compare("padded-tokens", framework="torch", full_batch=True, loss_reduction="mean")
    agree = [accumcheck.compare("padded-tokens", framework="torch", full_batch=True, loss_reduction=r)
             for r in ("token_count", "sum")]
    figures["torch.full-batch.mean-off"] = f"{100 * mean.full_batch.max_relative_difference:.0f}%"
    figures["torch.full-batch.agree"] = sig(max(r.full_batch.max_relative_difference for r in agree), 2)

    compensated, plain = 0.0, 0.0
    for case in cases():
        for n in (16, 32, 256):
            report = accumcheck.compare(case, framework="torch", accum_steps=n, mode="compensated")
            compensated = max(compensated, max(t.err_ulps_native for t in report.tensors))
        report = accumcheck.compare(case, framework="torch", accum_steps=256, mode="accumulator")
        plain = max(plain, max(t.err_ulps_native for t in report.tensors))
    figures["torch.accumulator.compensated-ulps"] = sig(compensated, 2)
    figures["torch.accumulator.plain-ulps"] = rounded(plain)

    figures.update(torch_train_figures())

    def flagged_at(case: str, n: int) -> bool:
        return accumcheck.compare(case, framework="torch", accum_steps=n, inject="scale").exit_code == 1

    for case, (yes, no) in {"tiny-grads": (128, 256), "shared-weight": (256, 512),
                            "embed-attention": (256, 512)}.items():
        figures[f"torch.scale.{case}"] = ("flagged" if flagged_at(case, yes) else "not flagged") + f" at N = {yes} " + (
            "but not at" if not flagged_at(case, no) else "and at") + f" {no}"
    # Each fault's cause, as the second pass finds it (the README's worked examples).
    rows = ["| `--inject` | the flagged tensor's cause |", "|---|---|"]
    for fault in ("drop-step", "repeat-step", "double-step", "scale", "bf16"):
        hit = accumcheck.compare("transformer-small", framework="torch", accum_steps=16, inject=fault).flagged[0]
        rows.append(f"| `{fault}` | {hit.cause.detail} |")
    rows += [f"| {what} | {detail} |" for what, detail in synthetic_causes()]
    figures["torch.causes"] = "\n" + "\n".join(rows) + "\n"
    clean = [accumcheck.compare(case, framework="torch").tensors for case in cases()]
    ratios = [max(t.ratio for t in tensors) for tensors in clean]
    figures["torch.clean.ratios"] = f"{sig(min(ratios), 2)}–{sig(max(ratios), 2)}"
    return figures


def torch_train_figures() -> dict[str, str]:
    """accumcheck train on PyTorch: a valid reordering under Adam (amplified, within the control's
    band) and a fault (past it)."""
    import accumcheck

    adam = accumcheck.train("tiny-grads", steps=15, optimizer="adam", inject="roundoff", oracle=True)
    command = ["train", "--case", "tiny-grads", "--steps", "15", "--inject", "roundoff"]
    _, out = cli(*command)
    fault = accumcheck.train("shared-weight", steps=15, optimizer="adam", inject="double-step")
    return {"torch.train.adam-ulps": power_of_ten(max(max(v) for v in adam.band_ratio.values())),
            "torch.train.adam-first": str(min(adam.first_out_of_band.values())),
            "torch.train.adam-ratio": sig(max(max(v) for v in adam.control_ratio.values()), 2),
            "torch.train.summary": f"`{out.strip().splitlines()[-1]}`",
            "torch.train.fault": f"`{fault.summary()}`",
            "torch.train.clean": f"`{accumcheck.train('shared-weight', steps=15, optimizer='adam').summary()}`"}


@group("your-model", needs="transformers")
def your_model_figures() -> dict[str, str]:
    """accumcheck check on examples/llama_window.py: the three loss normalisations of a window."""
    figures: dict[str, str] = {}
    setup = "examples/llama_window.py"
    command = ["check", f"{setup}:per_micro_batch_mean", "--full-batch", "--accum-steps", "4"]
    _, out = cli(*command)
    figures["your-model.mean.console"] = console(
        "accumcheck " + " ".join(command), out,
        lambda lines: with_wrapped(lines, lambda line: line.startswith(("model ", "full batch", "reproduce")))
        + ["...", lines[-1]])
    for name, reduction in (("token-count", "token_count"), ("twice", "mean")):
        _, out = cli("check", f"{setup}:token_count", "--full-batch", "--loss-reduction", reduction)
        wrapped = with_wrapped(out.splitlines(), lambda line: line.startswith("full batch"))
        full = " ".join(line.strip() for line in wrapped)
        figures[f"your-model.{name}.verdict"] = f"`{re.split(r'scale, at [^:]+: ', full)[1]}`"
        figures[f"your-model.{name}.summary"] = f"`{out.strip().splitlines()[-1]}`"
    return figures


@group("data-parallel", needs="torch")
def data_parallel_figures() -> dict[str, str]:
    import accumcheck

    def excerpt(lines: list[str]) -> list[str]:
        end = next(i for i, line in enumerate(lines) if line.startswith("    1 ")) + 1
        details = with_wrapped(lines, lambda line: line.lstrip().startswith(("Each rank's own total",
                                                                              "Single-process")))
        return lines[:end] + ["..."] + details + ["..."] + [lines[-1]]

    command = ["compare", "--world-size", "2", "--case", "shared-weight", "--inject", "scale", "--inject-rank", "1"]
    _, out = cli(*command)
    figures = {"dp.scale.console": console("accumcheck " + " ".join(command), out, excerpt)}

    bf16 = accumcheck.compare("embed-attention", framework="torch", world_size=2, accum_steps=32,
                              reduce_dtype="bfloat16")
    lost = [t for t in bf16.tensors if t.verdict == "precision-loss"]
    figures["dp.bf16.count"] = f"all {len(bf16.tensors)}" if len(lost) == len(bf16.tensors) else str(len(lost))
    figures["dp.bf16.own"] = sig(max(t.ratio_native for t in lost), 2)
    times = [t.precision_ratio for t in lost]  # native error over the float32 all-reduce's bound
    figures["dp.bf16.times"] = f"{thousands(min(times))} to {thousands(max(times))}"
    figures["dp.bf16.ulps"] = f"{e_notation(min(t.err_ulps_native for t in lost))} to " \
                              f"{e_notation(max(t.err_ulps_native for t in lost))}"
    figures["dp.bf16.manual-ulps"] = f"{min(t.err_ulps_manual for t in lost):.0f} to " \
                                     f"{max(t.err_ulps_manual for t in lost):.0f}"
    return figures


# ----------------------------------------------------------------------------- MXNet


def backend_run(case: str, framework: str, **options):
    """A backend's raw result (native, manual, E, S, O per parameter), as accumcheck.compare runs it."""
    import accumcheck
    from accumcheck.run.registry import get_backend

    return get_backend(framework).run(accumcheck.configure({"case": case, "framework": framework, **options}))


@group("mxnet", needs="mxnet==1.9.1")
def mxnet_figures() -> dict[str, str]:
    import numpy as np

    import accumcheck
    from accumcheck.bounds import UNIT_ROUNDOFF, ModeBound
    from accumcheck.judge.ratio import absum_rms as rms

    u = UNIT_ROUNDOFF["float32"]
    figures: dict[str, str] = {}
    _, out = cli("compare", "--framework", "mxnet", "--case", "shared-weight")
    figures["mxnet.191.ok"] = f"`{out.strip().splitlines()[-1]}`"
    report = accumcheck.compare("shared-weight", framework="mxnet")
    figures["mxnet.191.weight-ulps"] = f"{report.tensors[0].max_ulps:.0f}"

    # The kernel allowance c of grad_req='add': what each element needs beyond the plain sum's bound,
    # (|A - E| - bound without it) / (u * (S + S_rms)).
    need, where = 0.0, ""
    for case in cases():
        for hybridize in (True, False):
            for n in (1, 2, 4, 8, 16, 32, 64):
                plain = ModeBound.for_sum("float32", n)
                for p in backend_run(case, "mxnet", accum_steps=n, hybridize=hybridize).params:
                    s = p.absum.astype(np.float64)
                    excess = np.abs(p.native.astype(np.float64) - p.exact) - (plain.relative * s + plain.absolute)
                    needed = float((excess / (u * (s + rms(s)))).max(initial=0.0))
                    if needed > need:
                        need, where = needed, f"{case}'s {p.kind} at N = {n}"
    figures["mxnet.allowance.need"] = f"{sig(need, 2)} ({where})"

    # The cross-framework allowance: what the float64 models' difference needs, in u * (S + S_rms + model S_rms).
    worst, logits, need64 = 0.0, [], 0.0
    for case in cases():
        cross = accumcheck.compare_frameworks(case, ["torch", "mxnet"])
        worst = max(worst, max(a.ratio for a in cross.agreement))
        logits.append(cross.forward.in_float32_units)
        runs = [backend_run(case, framework, oracle=True) for framework in ("torch", "mxnet")]
        pairs = list(zip(runs[0].params, runs[1].params))
        model_rms = rms(np.concatenate([np.maximum(a.absum, b.absum).ravel() for a, b in pairs]))
        for a, b in pairs:
            s = np.maximum(a.absum, b.absum)
            need64 = max(need64, float((np.abs(a.oracle - b.oracle) / (u * (s + rms(s) + model_rms))).max()))
    # The erf inside MXNet's float64 GELU (LeakyReLU act_type='gelu', x * (1 + erf(x / sqrt 2)) / 2),
    # recovered from its output, against the exact one
    import mxnet as mx

    grid = np.linspace(-6.0, 6.0, 120_001)
    grid = grid[np.abs(grid) > 1e-3]
    gelu = mx.nd.LeakyReLU(mx.nd.array(grid, dtype="float64"), act_type="gelu").asnumpy()
    exact = np.array([math.erf(x / math.sqrt(2.0)) for x in grid])
    figures["mxnet.erf.error"] = e_notation(float(np.abs(2 * gelu / grid - 1 - exact).max()), 2)
    figures["mxnet.cross.need"] = f"{sig(need64, 2)}, so 16 leaves a factor of {16 / need64:.0f}"
    figures["mxnet.cross.worst"] = sig(worst, 2)
    figures["mxnet.cross.logits"] = f"{min(logits):.0f} to {max(logits):.0f}"
    return figures


@group("mxnet-train", needs="mxnet==1.9.1")
def mxnet_train_figures() -> dict[str, str]:
    """accumcheck train --framework mxnet: gluon.Trainer over grad_req='add' against the buffer."""
    import accumcheck

    shared = accumcheck.train("shared-weight", framework="mxnet", steps=15, optimizer="adam")
    sgd = accumcheck.train("shared-weight", framework="mxnet", steps=15, optimizer="sgd", lr=1e-2)
    fault = accumcheck.train("shared-weight", framework="mxnet", steps=15, optimizer="adam", inject="double-step")
    figures = {"mxnet.train.shared": f"`{shared.summary()}`",
               "mxnet.train.shared-first": str(min(shared.first_out_of_band.values())),
               "mxnet.train.shared-ulps": sig(max(max(v) for v in shared.band_ratio.values()), 2),
               "mxnet.train.shared-sgd": sig(max(max(v) for v in sgd.control_ratio.values()), 2),
               "mxnet.train.fault": f"`{fault.summary()}`"}
    plain = accumcheck.compare("transformer-small", framework="mxnet", dtype="float16")
    master = accumcheck.compare("transformer-small", framework="mxnet", dtype="float16", multi_precision=True)
    fixed = accumcheck.compare("transformer-small", framework="mxnet", dtype="float16", mode="compensated")
    figures["mxnet.fp16.flagged"] = f"{len(plain.flagged)} of {len(plain.tensors)}"
    figures["mxnet.fp16.ulps"] = times_ten(max(t.err_ulps_native for t in plain.flagged))
    same = [(t.name, t.verdict) for t in master.tensors] == [(t.name, t.verdict) for t in plain.tensors]
    figures["mxnet.fp16.master"] = "the same verdicts" if same else "other verdicts"
    figures["mxnet.fp16.compensated"] = f"exit code {fixed.exit_code}"
    return figures


@group("jax-train", needs="jax")
def jax_train_figures() -> dict[str, str]:
    """accumcheck train --framework jax: MultiSteps' running mean and running sum against the control."""
    import accumcheck

    mean = accumcheck.train("tiny-grads", framework="jax", steps=15, optimizer="adam")
    total = accumcheck.train("tiny-grads", framework="jax", steps=15, optimizer="adam", grad_mean=False)
    shared = accumcheck.train("shared-weight", framework="jax", steps=15, optimizer="adam")
    return {"jax.train.mean": f"`{mean.summary()}`", "jax.train.sum": f"`{total.summary()}`",
            "jax.train.mean-bias": e_notation(mean.max_diff["bias"][0]),
            "jax.train.shared": f"`{shared.summary()}`"}


@group("mxnet-1.6.0", needs="mxnet==1.6.0")
def mxnet_16708_figures() -> dict[str, str]:
    def excerpt(lines: list[str]) -> list[str]:
        start = next(i for i, line in enumerate(lines) if line.startswith("shared.bias ("))
        end = next(i for i, line in enumerate(lines) if line.startswith("FLAGGED"))
        return lines[:start + 1] + ["  ..."] + lines[end:]

    _, out = cli("compare", "--framework", "mxnet", "--case", "shared-weight")
    figures = {"mxnet.160.console": console("pip install mxnet==1.6.0 'numpy<1.24' && accumcheck compare "
                                            "--framework mxnet --case shared-weight", out, excerpt)}
    import accumcheck

    weight = accumcheck.compare("shared-weight", framework="mxnet").flagged[0]
    figures["mxnet.160.cause"] = f"“{weight.cause.detail}”"
    # accumcheck diff against MXNet 1.9.1's report (the accumcheck of another environment)
    fixed = os.environ.get("ACCUMCHECK_MX19", str(ROOT / ".venv" / "bin" / "accumcheck"))
    with tempfile.TemporaryDirectory() as folder:
        old, new = Path(folder) / "mxnet-1.6.0.json", Path(folder) / "mxnet-1.9.1.json"
        cli("compare", "--framework", "mxnet", "--case", "shared-weight", "--format", "json", "--output", str(old))
        subprocess.run([fixed, "compare", "--framework", "mxnet", "--case", "shared-weight", "--format", "json",
                        "--output", str(new)], capture_output=True, check=True, timeout=900)
        diff = subprocess.run([fixed, "diff", str(old), str(new)], capture_output=True, text=True, timeout=900)
    figures["mxnet.160.diff"] = f"`{diff.stdout.strip().splitlines()[-1]}`"
    split = accumcheck.train("shared-weight", framework="mxnet", steps=15, optimizer="adam")
    figures["mxnet.160.train"] = f"`{split.summary()}`"
    return figures


@group("stacks", needs="lightning")
def stack_figures() -> dict[str, str]:
    """The training stacks: accumcheck stack on the built-in case, and what the examples print (the
    programs themselves are shown from examples/ by the docs, never copied)."""
    figures: dict[str, str] = {}
    for stack, fault in (("transformers", None), ("transformers", "micro-batch-mean"), ("accelerate", "loss-over-n"),
                         ("lightning", None), ("gluon", "step-per-micro-batch")):
        args = ["stack", "--stack", stack, "--accum-steps", "4"] + (["--fault", fault] if fault else [])
        _, out = cli(*args)
        figures[f"stack.{stack}.{fault or 'correct'}"] = console("accumcheck " + " ".join(args), out)
    for name, flags in (("accelerate", []), ("lightning", ["--short-last-window"]), ("gluon", [])):
        path = f"examples/stack_{name}.py"
        out = example(path, *flags)
        figures[f"stack.example.{name}"] = console(" ".join(["python", path, *flags]), out)
        figures[f"stack.example.{name}.summary"] = f"`{summary_of(out)}`"
    for flag in ("", "--scheduler-every-micro-batch", "--step-every-micro-batch", "--keras-19990"):
        out = example("examples/loop_step.py", *([flag] if flag else []))
        figures[f"stack.step.{flag.removeprefix('--') or 'correct'}"] = f"`{summary_of(out)}`"
    truth = json.loads(subprocess.run([sys.executable, str(ROOT / "ci" / "ground_truth_step.py")], capture_output=True,
                                      text=True, check=True, timeout=900).stdout)
    figures["stack.step.ground-truth"] = e_notation(truth["correct"])
    figures["stack.step.ground-truth-fault"] = sig(truth["keras-19990"], 2)
    return figures


@group("trainer-releases", needs="transformers")
def trainer_release_figures() -> dict[str, str]:
    """examples/trainer_variable_length.py under this environment's transformers (4.45.2 and the
    current release run in the environments ci/transformers_releases.sh builds)."""
    from importlib.metadata import version

    release = version("transformers")
    out = example("examples/trainer_variable_length.py")
    summary = summary_of(out)
    return {f"trainer.{release}.console": console(f"pip install transformers=={release} && python "
                                                  "examples/trainer_variable_length.py", out),
            f"trainer.{release}.summary": f"`{summary}`"}


@group("trainer-models", needs="transformers")
def trainer_model_figures() -> dict[str, str]:
    """examples/trainer_models.py's three models under this environment's transformers (4.57.6 in
    the test environment, the current release in the one ci/transformers_releases.sh builds)."""
    from importlib.metadata import version

    release = version("transformers")
    figures = {}
    for name in ("bert-classification", "bert-masked-lm", "mixtral"):
        out = example("examples/trainer_models.py", name)
        figures[f"models.{release}.{name}.summary"] = f"`{summary_of(out)}`"
    return figures


@group("keras-releases", needs="keras")
def keras_release_figures() -> dict[str, str]:
    """examples/keras_accumulation.py under this environment's Keras (3.4.1 and the current release
    run in the environments ci/keras.sh builds)."""
    from importlib.metadata import version

    release = version("keras")
    out = example("examples/keras_accumulation.py")
    return {f"stack.keras.{release}.summary": f"`{summary_of(out)}`"}


def summary_of(out: str) -> str:
    """A stack report's summary line."""
    return next(line for line in out.splitlines() if line.startswith(("FAITHFUL", "FLAGGED", "DROPPED")))


def example(path: str, *flags: str) -> str:
    """What an example script prints (it exits 1 when it shows a flagged run)."""
    result = subprocess.run([sys.executable, path, *flags], capture_output=True, text=True, cwd=ROOT, timeout=900)
    if result.returncode not in (0, 1):
        raise RuntimeError(f"python {path} failed:\n{result.stderr}")
    return result.stdout


def torchrun(path: str, *flags: str, env: dict[str, str] | None = None) -> str:
    """What an example prints on rank 0 when torchrun starts it on 2 CPU ranks (from its report's
    first line: a library's start-up chatter before it is left out)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", path, *flags]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=900,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120", **(env or {})})
    lines = result.stdout.splitlines()
    first = next((i for i, line in enumerate(lines) if ", N = " in line), None)
    if result.returncode not in (0, 1) or first is None:
        raise RuntimeError(f"torchrun {path} failed:\n{result.stderr[-3000:]}")
    return "\n".join(lines[first:]) + "\n"


def launched(path: str, *flags: str, prefix: str = "") -> str:
    """The command line a reader types to start ``path`` on 2 ranks."""
    return " ".join([prefix + "torchrun --nproc_per_node 2", path, *flags]).strip()


@group("stacks-parallel", needs="lightning")
def parallel_stack_figures() -> dict[str, str]:
    """The data-parallel stacks on 2 CPU ranks: accumcheck stack --world-size 2, and the examples
    under torchrun (the Trainer's under this environment's transformers: trainer-ddp)."""
    figures: dict[str, str] = {}
    for stack, fault in (("loop", "rank-drops-micro-batch"), ("accelerate", "rank-loss-scaled")):
        args = ["stack", "--stack", stack, "--world-size", "2", "--accum-steps", "2", "--fault", fault]
        _, out = cli(*args)
        figures[f"parallel.stack.{stack}.{fault}"] = console("accumcheck " + " ".join(args), out)
    for name, path, flags in (("ddp-loop", "examples/ddp_loop.py", ()),
                              ("ddp-loop.forgot", "examples/ddp_loop.py", ("--forget-division",)),
                              ("fsdp2", "examples/fsdp2_loop.py", ()),
                              ("fsdp2.bf16", "examples/fsdp2_loop.py", ("--bf16-reduce",)),
                              ("accelerate", "examples/stack_accelerate.py", ()),
                              ("accelerate.mean", "examples/stack_accelerate.py", ("--mean",))):
        figures[f"parallel.{name}.summary"] = f"`{summary_of(torchrun(path, *flags))}`"
    synced = torchrun("examples/ddp_loop.py", "--sync-every-micro-step")
    figures["parallel.ddp-loop.sync.note"] = "`" + next(
        line for line in synced.splitlines() if line.startswith("DDP all-reduced")) + "`"
    out = example("examples/stack_lightning.py", "--short-last-window", "--devices", "2")
    figures["parallel.lightning"] = console("python examples/stack_lightning.py --short-last-window --devices 2", out)
    return figures


@group("gluon-contexts", needs="mxnet")
def gluon_contexts_figures() -> dict[str, str]:
    """The Gluon Trainer on 2 CPU contexts under a kvstore 'local': the stack command and the example."""
    args = ["stack", "--stack", "gluon", "--world-size", "2", "--accum-steps", "4", "--batches", "8", "--fault",
            "step-per-context-batch"]
    _, out = cli(*args)
    figures = {"gluon-contexts.stack.fault": console("accumcheck " + " ".join(args), out)}
    for name, flags in (("faithful", ()), ("per-context", ("--per-context",))):
        figures[f"gluon-contexts.{name}.summary"] = f"`{summary_of(example('examples/gluon_contexts.py', *flags))}`"
    return figures


@group("trainer-ddp", needs="transformers")
def trainer_ddp_figures() -> dict[str, str]:
    """examples/trainer_ddp.py on 2 ranks under this environment's transformers (4.57.6 in the test
    environment, the current release in the one ci/transformers_releases.sh builds)."""
    from importlib.metadata import version

    release = version("transformers")
    figures = {}
    for name, flags in (("global", ()), ("per-rank", ("--per-rank-tokens",))):
        out = torchrun("examples/trainer_ddp.py", *flags)
        figures[f"trainer-ddp.{release}.{name}.summary"] = f"`{summary_of(out)}`"
        if name == "global":
            figures[f"trainer-ddp.{release}.{name}"] = console(
                f"pip install transformers=={release} && " + launched("examples/trainer_ddp.py", *flags), out)
    return figures


@group("deepspeed", needs="deepspeed==0.19.8")
def deepspeed_figures() -> dict[str, str]:
    """examples/deepspeed_loop.py on 2 ranks (the environment ci/deepspeed.sh builds)."""
    figures = {}
    for name, flags in (("zero2", ()), ("zero1", ("--stage", "1")), ("fault", ("--fault",))):
        out = torchrun("examples/deepspeed_loop.py", *flags, env={"DS_ACCELERATOR": "cpu"})
        if name == "zero2":  # the whole output; the others, their summary line
            figures[f"deepspeed.{name}"] = console(launched("examples/deepspeed_loop.py", *flags,
                                                            prefix="DS_ACCELERATOR=cpu "), out)
        else:
            figures[f"deepspeed.{name}.summary"] = f"`{summary_of(out)}`"
    return figures


# ----------------------------------------------------------------------------- benchmarks


def _result(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


@group("benchmarks", needs="nothing")
def benchmark_figures() -> dict[str, str]:
    """The tables of the last measured runs (benchmarks/*.py --json benchmarks/results/NAME.json)."""
    from_files = {}
    if str(ROOT / "benchmarks") not in sys.path:  # the benchmarks import their neighbour machine_info
        sys.path.insert(0, str(ROOT / "benchmarks"))
    for path in sorted(RESULTS.glob("*.json")):
        module = importlib.util.spec_from_file_location(path.stem, ROOT / "benchmarks" / f"{path.stem}.py")
        bench = importlib.util.module_from_spec(module)
        module.loader.exec_module(bench)
        for name, text in bench.figures(_result(path.stem)).items():
            from_files[f"bench.{path.stem}.{name}"] = text
    return from_files


@group("mutation", needs="nothing")
def mutation_figures() -> dict[str, str]:
    """The scores of the last mutation run (python ci/mutation.py writes ci/mutation_scores.json)."""
    data = json.loads((ROOT / "ci" / "mutation_scores.json").read_text())
    rows = ["| module | mutants | killed | equivalent | score |", "|---|---:|---:|---:|---:|"]
    for path, module in sorted(data["modules"].items()):
        rows.append(f"| `{path}` | {module['total']} | {module['killed']} | {module['equivalent']} | "
                    f"{100 * module['score']:.1f} % |")
    return {"mutation.table": "\n" + "\n".join(rows) + "\n", "mutation.command": f"`{data['command']}`"}


# ----------------------------------------------------------------------------- the text


def marks() -> list[tuple[Path, str, str]]:
    return [(path, m.group(1), m.group(2)) for path in TEXTS for m in MARK.finditer(path.read_text())]


def compare_text(expected: str, found: str) -> bool:
    return TIMING.sub("· <time>", expected) == TIMING.sub("· <time>", found)


def regenerate(names: list[str]) -> dict[str, dict[str, str]]:
    return {name: GROUPS[name][0]() for name in names}


def check(generated: dict[str, dict[str, str]]) -> list[str]:
    """Differences between the text and the regenerated figures, one line each."""
    figures = {name: value for group_figures in generated.values() for name, value in group_figures.items()}
    problems = []
    quoted = set()
    for path, name, text in marks():
        quoted.add(name)
        if name in figures and not compare_text(figures[name], text):
            problems.append(f"{path.relative_to(ROOT)}: {name}: the text says {text!r}, a run gives {figures[name]!r}")
    problems += [f"{name}: computed but quoted nowhere" for name in figures if name not in quoted]
    return problems


def unknown_marks() -> list[str]:
    known_prefixes = {"torch", "your-model", "dp", "mxnet", "bench", "mutation", "stack", "trainer", "models", "parallel",
                      "trainer-ddp", "deepspeed", "gluon-contexts", "jax"}
    return [f"{path.relative_to(ROOT)}: {name}: no group makes it" for path, name, _ in marks()
            if name.split(".")[0] not in known_prefixes]


def write(generated: dict[str, dict[str, str]]) -> int:
    figures = {name: value for group_figures in generated.values() for name, value in group_figures.items()}
    changed = 0
    for path in TEXTS:
        text = path.read_text()
        new = MARK.sub(lambda m: f"<!--fig {m.group(1)}-->{figures.get(m.group(1), m.group(2))}<!--/fig-->", text)
        if new != text:
            path.write_text(new)
            changed += 1
    return changed


def main(argv: list[str] | None = None) -> int:
    hold_kernels()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--group", action="append", choices=sorted(GROUPS), help="only this group (repeatable)")
    parser.add_argument("--write", action="store_true", help="write the regenerated figures into the text")
    parser.add_argument("--list", action="store_true", help="list the groups and whether they can run here")
    parser.add_argument("--show", action="store_true", help="print the regenerated figures")
    args = parser.parse_args(argv)
    if args.list:
        for name, (_, needs) in GROUPS.items():
            print(f"{name:<14} needs {needs:<14} {'runs here' if can_run(needs) else 'cannot run here'}")
        return 0
    bad = unknown_marks()
    if bad:
        print("\n".join(bad))
        return 2
    names = args.group or [name for name, (_, needs) in GROUPS.items() if can_run(needs)]
    generated = regenerate(names)
    if args.show:
        for figures in generated.values():
            for name, value in figures.items():
                print(f"{name}: {value}")
    if args.write:
        print(f"wrote figures of {', '.join(names)} into {write(generated)} files")
        return 0
    problems = check(generated)
    print("\n".join(problems) if problems else f"every figure of {', '.join(names)} matches the text")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

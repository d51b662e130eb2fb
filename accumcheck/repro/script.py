"""The parts of a reproduction script (``accumcheck compare --repro``) that every framework shares:
its docstring and constants, the injected fault's lines, the judging against the round-off bound
and ``main``. A framework's generator (``accumcheck.<framework>.repro``) writes the model,
the loss and the two passes, and ``script`` puts the parts together.

Everything here is text: the script imports the framework and numpy alone. The model is written
out by walking the case's layers (``accumcheck.case.layers.run_layers``) with stand-ins for
tensors (``Var``) that write one line of code per primitive (``SourceWriter``), so the script's
model has exactly the layers, names and order of accumcheck's own.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from typing import Any, Callable

from ..case.definition import Case
from ..errors import AccumcheckError
from ..options.choices import FAULT_KINDS
from ..options.spec import command_line
from ..run.config import RunConfig
from ..run.faults import ROUNDOFF_BLOCK, SCALE_FACTOR, Fault

# ----------------------------------------------------------------------------- writing code


class Var:
    """A tensor of the script being written: the expression that names it. ``x + y`` writes the
    sum as a new line of the writer's."""

    def __init__(self, code: str, writer: "SourceWriter | None" = None, name: str = "") -> None:
        self.code, self.writer, self.name = code, writer, name

    def __add__(self, other: "Var") -> "Var":
        assert self.writer is not None
        return self.writer.assign(f"{self.code} + {other.code}")

    def __str__(self) -> str:
        return self.code


class SourceWriter:
    """Lines of code at an indentation, each result in a fresh variable (h1, h2, ...)."""

    def __init__(self, indent: int = 2) -> None:
        self.lines: list[str] = []
        self.indent = indent
        self.count = 0

    def line(self, text: str) -> None:
        self.lines.append("    " * self.indent + text)

    def assign(self, expr: str, comment: str = "") -> Var:
        self.count += 1
        var = Var(f"h{self.count}", self)
        self.line(f"{var.code} = {expr}" + (f"  # {comment}" if comment else ""))
        return var

    def text(self) -> str:
        return "\n".join(self.lines)


def attribute_names(names: list[str]) -> dict[str, str]:
    """An identifier for each canonical parameter name (``block0.attn.q.weight`` ->
    ``block0__attn__q__weight``); numbered (p0, p1, ...) where two would clash."""
    mapped = {name: re.sub(r"\W", "_", name.replace(".", "__")) for name in names}
    if len(set(mapped.values())) < len(mapped) or not all(a.isidentifier() for a in mapped.values()):
        return {name: f"p{i}" for i, name in enumerate(names)}
    return mapped


def params_source(attrs: dict[str, str]) -> str:
    """``PARAMS = {...}``, one parameter a line."""
    lines = "".join(f"    {name!r}: {attr!r},\n" for name, attr in attrs.items())
    return f"PARAMS = {{  # accumcheck's parameter name -> the model's attribute\n{lines}}}"


# ----------------------------------------------------------------------------- the injected fault

# Each fault kind of accumcheck.run.faults as the lines of ``contribution(k, grad, total)``: what the
# native accumulation adds at micro-step k instead of ``grad`` (``total``: the running total
# before it, None at k = 0). bf16 also rounds the total after every micro-step (``after_add``).
_CONTRIBUTIONS: dict[str, Callable[[Fault, int], list[str]]] = {
    "drop-step": lambda f, n: [f"if k == {f.step}:", "    return grad * 0  # micro-step dropped",
                               "return grad"],
    "repeat-step": lambda f, n: [f"if k == {f.step}:", "    return grad + grad  # micro-step added twice",
                                 "return grad"],
    "double-step": lambda f, n: [f"if k == {f.step} and total is not None:",
                                 "    return grad + total  # the running total counted again", "return grad"],
    "scale": lambda f, n: [f"if k == {f.step}:", f"    return grad * {SCALE_FACTOR!r}  # micro-step scaled",
                           "return grad"],
    "bf16": lambda f, n: ["return grad  # added as it is; after_add rounds the total"],
    "roundoff": lambda f, n: [
        f"# summed in blocks of {ROUNDOFF_BLOCK} micro-steps, each block added at once: another",
        "# valid summation order, inside the round-off bound (the positive control)",
        "BLOCK[0] = grad if BLOCK[0] is None else BLOCK[0] + grad",
        f"if (k + 1) % {ROUNDOFF_BLOCK} and k != N - 1:", "    return grad * 0",
        "block, BLOCK[0] = BLOCK[0], None", "return block"],
}
_WHAT = {
    "drop-step": "micro-step {step}'s gradient of {param} never reaches the native total",
    "repeat-step": "micro-step {step}'s gradient of {param} is added to the native total twice",
    "double-step": "at micro-step {step} the native running total of {param} is added a second time",
    "scale": "micro-step {step}'s gradient of {param} is scaled by " + repr(SCALE_FACTOR),
    "bf16": "the native running total of {param} is rounded to bfloat16 after every micro-step",
    "roundoff": "the native total of {param} is summed in blocks of " + str(ROUNDOFF_BLOCK) + " micro-steps",
}


def fault_kinds_written() -> tuple[str, ...]:
    """The fault kinds a script can carry, in FAULT_KINDS order."""
    return tuple(kind for kind in FAULT_KINDS if kind in _CONTRIBUTIONS and kind in _WHAT)


def check_fault_kind(kind: str) -> None:
    """Raise AccumcheckError for a fault kind the script writer has no lines for."""
    if kind not in fault_kinds_written():
        raise AccumcheckError(f"--repro: the script cannot carry the fault {kind!r} yet (it writes "
                              f"{', '.join(fault_kinds_written())}); drop --inject or choose one of those")


def fault_words(fault: Fault) -> str:
    check_fault_kind(fault.kind)
    return _WHAT[fault.kind].format(step=fault.step, param=fault.param)


def fault_source(fault: Fault | None, accum_steps: int, round_total: str) -> str:
    """``FAULT_PARAM``, ``contribution`` and ``after_add`` for ``fault`` (for none: no fault);
    ``round_total`` is the framework's expression rounding ``total`` to bfloat16."""
    if fault is None:
        return "FAULT_PARAM = None  # no fault injected: native accumulation is the framework's own\n"
    check_fault_kind(fault.kind)
    body = "\n".join("    " + line for line in _CONTRIBUTIONS[fault.kind](fault, accum_steps))
    after = f"return {round_total}  # rounded to bfloat16" if fault.kind == "bf16" else "return total"
    why = ("a valid summation order, which the check must pass" if fault.kind == "roundoff" else
           "to show that the check catches it")
    said = textwrap.fill(f"accumcheck ran with --inject {fault.target}: {fault_words(fault)}. The lines below put "
                         f"that fault into the native accumulation on purpose, {why}. Set FAULT_PARAM = None to "
                         "run without it.", 96, initial_indent="# ",
                         subsequent_indent="# ", break_on_hyphens=False)
    block = "\nBLOCK = [None]  # the block of micro-steps summed so far" if fault.kind == "roundoff" else ""
    return f'''# ------------------------------------------------------------------------ the injected fault
{said}
FAULT_PARAM = {fault.param!r}{block}


def contribution(k, grad, total):
    """What native accumulation adds at micro-step k instead of grad (total: the running total
    before it, None at k = 0)."""
{body}


def after_add(k, total):
    """The running total after micro-step k, as the fault leaves it."""
    {after}
'''


# ----------------------------------------------------------------------------- the script's head


@dataclass(frozen=True)
class FrameworkParts:
    """What a framework's generator writes: its imports, the words for its two modes, the
    model, the loss and the two passes (``native_pass()`` -> name -> array, ``manual_pass()`` ->
    (manual, E, S) dicts of numpy arrays), and the expression that rounds ``total`` to bfloat16."""

    imports: str  # import lines, and FRAMEWORK = "<name> <version>"
    device: str  # the device as the script names it
    native_words: str  # "PyTorch's own: .grad accumulating across backward()"
    manual_words: str
    setup: str  # lines after the imports (determinism, quiet logging)
    body: str  # model, loss, passes
    round_total: str
    kernel_allowance: float = 0.0
    details: str = ""  # more of the run's facts for the docstring


def _docstring_text(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')


def _verdict_line(report: Any) -> str:
    flagged = report.flagged
    if not flagged:
        worst = max(report.tensors, key=lambda t: t.ratio if t.ratio == t.ratio else 0.0)
        return (f"every tensor within the round-off bound (worst: {worst.name}, {worst.ratio:.3g} x its bound); "
                "exit status 0")
    parts = [f"{t.name} {t.verdict} (native {t.ratio_native:.3g} x its round-off bound, manual "
             f"{t.ratio_manual:.3g} x)" for t in flagged]
    return f"{len(flagged)} of {len(report.tensors)} tensors flagged: " + "; ".join(parts) + "; exit status 1"


def head(config: RunConfig, report: Any, parts: FrameworkParts, script_name: str, data_name: str,
         shrunk_from: str | None = None) -> str:
    """The docstring, imports and constants of the script ``script_name`` reading ``data_name``."""
    case: Case = config.case
    framework = report.framework
    version = report.versions.get(framework, "?")
    record = dict(report.config)
    command = command_line(record) if record else "accumcheck compare"
    allowance = ", and the allowance for kernels that add into the total" if parts.kernel_allowance else ""
    paragraphs = [
        f"{parts.native_words} against {parts.manual_words}.",
        f"Case {case.name}: {' '.join(case.description.split()) or 'no description'}",
        f"{len(case.parameters())} parameter tensors, N = {config.accum_steps} micro-steps accumulated, seed "
        f"{case.seed}, device {config.device}{parts.details}."
        + (f" Shrunk by accumcheck compare --shrink from {shrunk_from}." if shrunk_from else "")
        + (f" Fault injected on purpose (--inject {config.fault.target}): {fault_words(config.fault)}; see the "
           "injected fault below." if config.fault is not None else ""),
        f"accumcheck {report.versions.get('accumcheck', '?')} under {framework} {version} wrote it from:",
    ]
    doc = "\n\n".join(textwrap.fill(p, 96, break_on_hyphens=False, break_long_words=False) for p in paragraphs[:3]) + "\n\n" + paragraphs[3] + f"""
    {command} --repro {script_name}
{textwrap.fill("accumcheck's verdict: " + _verdict_line(report) + ".", 96, break_on_hyphens=False)}

Run it:  python {script_name}    (needs only {framework} and numpy; reads {data_name} beside it)
         python {script_name} --save grads.npz    (also saves every tensor's totals, E, S and ratios)

It builds the model from its initial weights and runs the N micro-batches twice: native
accumulation, then manual (each micro-step's gradient alone, added into a float32 buffer and
into the float64 sums E = sum(g) and S = sum(|g|)). Both totals of every tensor are judged
against the round-off bound of a float32 running sum of N terms (Higham, eq. 4.4):
    |total - E| <= gamma_(N-1)(u) * S + (N-1) * 2^-126,   gamma_k = k*u / (1 - k*u),  u = 2^-24
(plus the float64 error of E itself{allowance}). A ratio |total - E| / bound above 1 cannot be
round-off. Exit status 1: some tensor is beyond the bound; 0: every tensor is within it."""
    flagged = {t.name: (t.verdict, t.ratio_native, t.ratio_manual) for t in report.flagged}
    return f'''#!/usr/bin/env python3
"""accumcheck reproduction: case {_docstring_text(case.name)}, {framework} {version}, N = {config.accum_steps}, seed {case.seed}.

{_docstring_text(doc)}
"""

import argparse
import math
import os
import sys
from pathlib import Path

{parts.setup}
import numpy as np
{parts.imports}

# ----------------------------------------------------------------------------------- the run
CASE = {case.name!r}
N = {config.accum_steps}  # micro-steps accumulated
DEVICE = {parts.device!r}
CLASSES = {case.num_classes}  # the last layer's width: softmax cross-entropy over these
LOSS = {case.loss_reduction!r}  # mean: each micro-batch's mean loss; sum; token_count: sum / the N batches' tokens
KERNEL_ALLOWANCE = {parts.kernel_allowance!r}  # in units of u, for kernels that add into the native total
WRITTEN_UNDER = {f"{framework} {version}"!r}
# What accumcheck flagged: name -> (verdict, native's ratio to the bound, manual's).
FLAGGED = {flagged!r}
DATA = np.load(Path(__file__).with_suffix(".npz"))  # initial weights and the N micro-batches
'''


# ----------------------------------------------------------------------------- judging and main

JUDGE = '''
# ------------------------------------------------------------------ the round-off bound, judged
U, U64, TINY = 2.0 ** -24, 2.0 ** -53, 2.0 ** -126  # float32's unit round-off, float64's, float32's smallest normal


def gamma(k, u):
    """gamma_k = k*u / (1 - k*u): the relative error bound of a running sum of k + 1 terms."""
    return k * u / (1.0 - k * u) if k * u < 1.0 else math.inf


def ratios(total, exact, absum, allowance):
    """|total - E| / bound, element by element, where bound = relative * S + floor:
    relative = gamma_(N-1)(u) + gamma_(N-1)(u64) (E's own error) + allowance * u,
    floor = (N-1) * 2^-126 + allowance * u * rms(S)."""
    k = N - 1
    relative = gamma(k, U) + gamma(k, U64) + allowance * U
    s = absum.reshape(-1)
    rms = float(np.sqrt(np.dot(s, s) / s.size)) if allowance and s.size else 0.0
    floor = k * TINY + allowance * U * rms
    err = np.abs(np.asarray(total, np.float64).reshape(-1) - exact.reshape(-1))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = err / (relative * s + floor)
    return np.where(np.isnan(err), np.inf, np.nan_to_num(ratio, nan=0.0, posinf=np.inf))


def judge(native, manual, exact, absum):
    """Per tensor: max |native - manual| and where, and each mode's worst ratio to its bound."""
    rows = {}
    for name in exact:
        a = np.asarray(native[name], np.float64)
        b = np.asarray(manual[name], np.float64)
        diff = np.abs(a - b).reshape(-1)
        diff = np.where(np.isnan(diff), np.inf, diff)
        at = int(np.argmax(diff)) if diff.size else -1
        where = [int(i) for i in np.unravel_index(at, a.shape)] if at >= 0 and diff[at] > 0 else []
        finite = bool(np.isfinite(a).all() and np.isfinite(b).all() and np.isfinite(exact[name]).all())
        rows[name] = {"diff": float(diff[at]) if at >= 0 else 0.0, "where": where, "finite": finite,
                      "native": float(ratios(a, exact[name], absum[name], KERNEL_ALLOWANCE).max(initial=0.0)),
                      "manual": float(ratios(b, exact[name], absum[name], 0.0).max(initial=0.0))}
        rows[name]["beyond"] = not finite or max(rows[name]["native"], rows[name]["manual"]) > 1.0
    return rows


def tensors(n):
    return f"{n} tensor" + ("s" if n != 1 else "")


def show(rows):
    """Print the flagged tensors (accumcheck's and this run's), a summary and the verdict; the exit status."""
    beyond = [name for name, row in rows.items() if row["beyond"]]
    shown = [name for name in rows if name in FLAGGED or name in beyond]
    if not shown:  # nothing flagged: the tensor nearest its bound
        shown = [max(rows, key=lambda name: max(rows[name]["native"], rows[name]["manual"]))]
    print(f"{FRAMEWORK} on {DEVICE}: case {CASE}, N = {N} micro-steps, {tensors(len(rows))} "
          f"(script written under {WRITTEN_UNDER})")
    width = max(len(name) for name in shown) + 2
    print(f"{'tensor':<{width}}{'max|native-manual|':>20}  {'at':<12}{'native/bound':>14}{'manual/bound':>14}")
    for name in shown:
        row = rows[name]
        state = "beyond the bound" if row["beyond"] else "within the bound"
        if not row["finite"]:
            state = "non-finite values"
        print(f"{name:<{width}}{row['diff']:>20.3g}  {str(row['where'] or '-'):<12}{row['native']:>14.3g}"
              f"{row['manual']:>14.3g}  {state}")
        if name in FLAGGED:
            verdict, native, manual = FLAGGED[name]
            print(f"{'':<{width}}accumcheck under {WRITTEN_UNDER}: {verdict}, native {native:.3g}, manual {manual:.3g}")
    worst = max(rows, key=lambda name: rows[name]["native"])
    worst_manual = max(rows, key=lambda name: rows[name]["manual"])
    print(f"all {tensors(len(rows))}: {len(beyond)} beyond the round-off bound"
          f"{' (' + ', '.join(beyond) + ')' if beyond else ''}; worst native {rows[worst]['native']:.3g} x "
          f"({worst}), worst manual {rows[worst_manual]['manual']:.3g} x ({worst_manual})")
    if beyond:
        modes = sorted({mode for name in beyond for mode in ("native", "manual") if rows[name][mode] > 1.0})
        print(f"DIVERGED: {' and '.join(modes) or 'native'} accumulation is further from the float64 sum than "
              f"float32 round-off can explain in {len(beyond)} of {tensors(len(rows))} ({', '.join(beyond)})")
        return 1
    print(f"AGREE: native and manual accumulation are within the float32 round-off bound of the float64 sum "
          f"in all {tensors(len(rows))}")
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", metavar="FILE.npz", help="also save every tensor's native and manual totals, "
                        "E, S and ratios (keys native/NAME, manual/NAME, exact/NAME, absum/NAME, ratio/NAME)")
    args = parser.parse_args()
    native = native_pass()
    manual, exact, absum = manual_pass()
    rows = judge(native, manual, exact, absum)
    if args.save:
        arrays = {}
        for name in exact:
            arrays.update({f"native/{name}": native[name], f"manual/{name}": manual[name],
                           f"exact/{name}": exact[name], f"absum/{name}": absum[name],
                           f"ratio/{name}": np.array([rows[name]["native"], rows[name]["manual"]])})
        np.savez(args.save, **arrays)
    return show(rows)


if __name__ == "__main__":
    sys.exit(main())
'''


def script(config: RunConfig, report: Any, parts: FrameworkParts, script_name: str, data_name: str,
           shrunk_from: str | None = None) -> str:
    """The whole reproduction script."""
    sections = [head(config, report, parts, script_name, data_name, shrunk_from),
                fault_source(config.fault, config.accum_steps, parts.round_total), parts.body, JUDGE]
    return "\n\n\n".join(section.strip("\n") for section in sections) + "\n"

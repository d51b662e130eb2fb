"""Renderers for a Report: terminal table (rich), markdown, csv. Rendering never computes."""

from __future__ import annotations

import csv
import dataclasses
import io
import math

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from .crosscheck import CrossReport
from .report import KIND_ORDER, Report, TensorResult
from .sweep import SweepReport

FORMATS = ("table", "json", "markdown", "csv", "html")
_STYLE = {"identical": "green", "round-off": "cyan", "precision-loss": "bold yellow", "diverged": "bold red",
          "non-finite": "bold magenta"}


def num(x: float | None) -> str:
    """A number in 3 significant digits, scientific where that reads better."""
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    return f"{x:.3g}" if 1e-3 <= abs(x) < 1e5 else f"{x:.2e}"


def _shape(t: TensorResult) -> str:
    return "x".join(map(str, t.shape)) or "scalar"


def _index(index: list[int]) -> str:
    return "(" + ", ".join(map(str, index)) + ")"


def header_lines(report: Report) -> list[str]:
    versions = " ".join(f"{k} {v}" for k, v in report.versions.items())
    native = report.bound["native"]
    allowance = native.get("kernel_allowance", 0.0)
    notes = []
    if "hybridize" in report.settings:
        notes.append("hybridized" if report.settings["hybridize"] else "imperative")
    if report.settings.get("oracle"):
        notes.append(f"oracle {report.settings['oracle']}")
    settings = ", ".join(notes)
    lines = [
        f"case {report.case} · {report.framework} on {report.device} · N = {report.accum_steps} micro-steps · "
        f"seed {report.seed} · params {report.param_dtype}, manual buffer {report.accum_dtype}"
        + (f" · {settings}" if settings else ""),
        f"{versions} · {report.seconds:.2f}s",
    ]
    if report.data_parallel:
        lines += data_parallel_lines(report)
    else:
        lines += [
            f"bound per element: |mode - E| <= gamma_k(u) * S + k * 2^-126, k = {native['roundings']}"
            + (f"; native also + {allowance:g}u * (S + S_rms) for kAddTo kernels" if allowance else ""),
            "E, S: float64 sums of the micro-gradients and of their magnitudes",
        ]
    if report.inject:
        lines.append(f"injected fault: {report.inject}")
    if report.settings.get("full_batch"):
        lines.append(full_batch_line(report))
    lines.append(f"reproduce: {report.reproduce_command()}")
    return lines


def data_parallel_lines(report: Report) -> list[str]:
    """How a data-parallel run was set up, its bounds, and what the ranks and the single-process
    reference said."""
    p, bound = report.data_parallel, report.bound
    w, n = p["world_size"], report.accum_steps
    hosts = p.get("hosts", [])
    lines = [
        f"data parallel: {w} ranks ({p['backend']}, {p['launcher']}"
        + (f", {len(hosts)} hosts" if len(hosts) > 1 else "") + f"), {w * n} global micro-batches "
        f"(rank r, micro-step k: batch k*{w} + r)"
        + ("; find_unused_parameters=True" if p.get("find_unused_parameters") else ""),
        f"native: {p['native']}; manual: {p['manual']}",
        f"E, S: float64 sums of every rank's micro-gradients and of their magnitudes, all-reduced, divided by {w}",
        f"bound per element: |mode - E| <= rel * S + k * 2^-126: native {num(bound['native']['relative'])} "
        f"(N-1 roundings on the rank, then the {p['reduce_dtype']} all-reduce), manual "
        f"{num(bound['manual']['relative'])}, single process {num(bound['single_process']['relative'])}, "
        f"a rank's own total against its own E, S {num(bound['rank']['relative'])}",
    ]
    single = p.get("single_process")
    if single:
        verdict = "agrees" if single["agree"] else "DISAGREES"
        lines.append(f"single-process reference ({p['reference']}): native {verdict}, worst "
                     f"{num(single['worst_agreement'])}x the two bounds at {single['worst_tensor'] or '-'}")
    ranks = p.get("ranks", [])
    if ranks and p.get("ranks_agree"):
        lines.append(f"ranks: all {len(ranks)} agree (every rank's own total within round-off; the same gradient "
                     "on every rank after the all-reduce)")
    elif ranks:
        lines.append("ranks DISAGREE: " + "; ".join(
            f"rank {r['rank']}" + (f" ({r['host']})" if len(hosts) > 1 else "") + ": "
            + (f"FLAGGED {', '.join(r['flagged'])}" if r["flagged"] else "faithful") for r in ranks)
            + ("" if p.get("final_identical", True) else "; the ranks hold different gradients after the all-reduce"))
    return lines


def full_batch_line(report: Report) -> str:
    f = report.settings["full_batch"]
    verdict = "equivalent" if f["equivalent"] else "SEMANTIC MISMATCH (the loss normalisation, not round-off)"
    return (f"full batch: loss '{f['normalisation']}', accumulated sum x {f['accumulated_scaled_by']} against one "
            f"backward over the whole batch (float64): largest difference {num(f['max_relative_difference'])} of the "
            f"gradient's scale, at {f['worst_tensor']}: {verdict}")


def summary_line(report: Report) -> str:
    """One line: what was flagged (embeddings and weights first), or that all is faithful."""
    n = len(report.tensors)
    flagged = report.flagged
    if report.semantic_mismatch and not flagged:
        return (f"FLAGGED: the accumulated gradient is not the full batch's (loss '{report.loss_reduction}'; "
                f"every tensor is numerically faithful)")
    if flagged:
        named = ", ".join(f"{t.name} ({t.kind}, {t.verdict}" + (
            f", {num(t.ratio)}x bound" if t.verdict == "diverged" else
            f", {num(t.err_ulps_native)} float32 ulps" if t.verdict == "precision-loss" else "")
            + (f", rank {', '.join(map(str, t.flagged_ranks))}" if t.flagged_ranks else "") + ")" for t in flagged[:8])
        more = f" and {len(flagged) - 8} more" if len(flagged) > 8 else ""
        return f"FLAGGED {len(flagged)} of {n} tensors: {named}{more}"
    counts = {v: sum(t.verdict == v for t in report.tensors) for v in ("identical", "round-off")}
    ill = sum(t.ill_conditioned for t in report.tensors)
    parts = [f"{c} {v}" for v, c in counts.items() if c]
    text = f"OK: all {n} tensors faithful ({', '.join(parts)})"
    return text + (f"; {ill} ill-conditioned (heavy cancellation, judged by the bound)" if ill else "")


def tensor_details(t: TensorResult) -> list[str]:
    """torch.testing-style lines for one tensor, plus what the bound knows."""
    pct = 100.0 * t.mismatched / t.numel if t.numel else 0.0
    lines = [f"{t.name} ({t.kind}, {_shape(t)}, {t.dtype}): {t.label}"]
    if t.verdict == "non-finite":
        lines.append(f"  Non-finite elements: native {t.nonfinite_native}, manual {t.nonfinite_manual} of {t.numel}")
        return lines
    if t.mismatched:
        lines.append(f"  Mismatched elements: {t.mismatched} / {t.numel} ({pct:.1f}%) native vs manual; "
                     f"beyond the round-off bound: native {t.over_bound_native}, manual {t.over_bound_manual}")
    else:
        lines.append(f"  Native and manual agree in all {t.numel} elements")
    if t.mismatched:
        lines.append(f"  Greatest absolute difference: {num(t.max_abs_diff)} at index {_index(t.max_abs_diff_index)} "
                     f"(up to {t.classic_atol:g} allowed by torch.testing's atol)")
        lines.append(f"  torch.testing's defaults (rtol={t.classic_rtol:g}, atol={t.classic_atol:g}) "
                     f"reject {t.classic_mismatched} elements")
        lines.append(f"  Greatest relative difference: {num(t.max_rel_diff)}; greatest ulp distance: {num(t.max_ulps)}")
    if t.worst_index:
        lines.append(f"  Worst element {_index(t.worst_index)}: {t.worst_mode} is {num(t.ratio)}x its round-off "
                     f"bound {num(t.bound_at_worst)}")
    lines.append(f"  Error against the float64 sum E: native {num(t.err_native)} (ratio {num(t.ratio_native)}), "
                 f"manual {num(t.err_manual)} (ratio {num(t.ratio_manual)})"
                 + ("" if t.nearer == "tie" else f"; {t.nearer} is nearer"))
    if t.precision_ratio is None and t.err_ulps_native is not None:
        lines.append(f"  Error against E in float32 ulps: native {num(t.err_ulps_native)}, manual {num(t.err_ulps_manual)}")
    if t.precision_ratio is not None:
        lines.append(f"  Against float32's bound (what a float32 buffer keeps): native {num(t.precision_ratio)}x it; error against E in "
                     f"float32 ulps: native {num(t.err_ulps_native)}, manual {num(t.err_ulps_manual)}")
    if t.rank_local_ratios is not None:
        lines.append("  Each rank's own total against its own E and S (ratio to bound): "
                     + ", ".join(f"rank {r} {num(x)}" for r, x in enumerate(t.rank_local_ratios))
                     + "; after the all-reduce: " + ", ".join(f"rank {r} {num(x)}" for r, x in enumerate(t.rank_final_ratios or []))
                     + (f"; flagged: rank {', '.join(map(str, t.flagged_ranks))}" if t.flagged_ranks else ""))
    if t.single_agreement is not None:
        lines.append(f"  Single-process reference: {num(t.single_ratio)}x its bound; native against it "
                     f"{num(t.single_agreement)}x the two bounds")
    if t.oracle_err_native is not None:
        lines.append(f"  Error against the float64 model O: native {num(t.oracle_err_native)}, "
                     f"manual {num(t.oracle_err_manual)}, E {num(t.oracle_err_exact)}")
    lines.append(f"  Gradient magnitude max|E| {num(t.max_abs_grad)}, {100 * t.norm_share:.3g}% of the whole gradient's "
                 f"sum of squares; condition number S/|E| {num(t.condition)}"
                 + (" (ill-conditioned: cancellation, not a bug, while within the bound)" if t.ill_conditioned else ""))
    return lines


def rich_table(report: Report) -> Table:
    """The per-parameter table: one row a tensor, the verdict and the numbers behind it."""
    table = Table(box=box.SIMPLE_HEAVY, header_style="bold", pad_edge=False)
    table.add_column("tensor", no_wrap=True)
    table.add_column("kind", no_wrap=True)
    table.add_column("shape", no_wrap=True)
    # "ratio": worst |mode - E| / bound; "tol fails": elements outside torch.testing's rtol/atol.
    for title in ("max|g|", "verdict", "ratio", "max|A-B|", "ulps", "tol fails", "cond"):
        table.add_column(title, justify="left" if title == "verdict" else "right", no_wrap=title == "verdict")
    for t in report.tensors:
        table.add_row(t.name, t.kind, _shape(t), num(t.max_abs_grad), Text(t.label, style=_STYLE[t.verdict]),
                      num(t.ratio), num(t.max_abs_diff), num(t.max_ulps), str(t.classic_mismatched),
                      num(t.condition))
    return table


def rank_table(report: Report) -> Table:
    """One row a rank: its verdict, the tensors it is named for, its worst own-total ratio."""
    p = report.data_parallel
    table = Table(box=box.SIMPLE_HEAVY, header_style="bold", pad_edge=False, title="per rank")
    for title in ("rank", "host", "verdict", "own total, worst ratio", "flagged tensors"):
        table.add_column(title, justify="right" if title.startswith(("rank", "own")) else "left")
    for r in p["ranks"]:
        worst = max((t.rank_local_ratios[r["rank"]] for t in report.tensors if t.rank_local_ratios), default=0.0)
        verdict = Text("FLAGGED", style="bold red") if r["flagged"] else Text("faithful", style="green")
        table.add_row(str(r["rank"]), r["host"], verdict, num(worst), ", ".join(r["flagged"]) or "-")
    return table


def render_table(report: Report, console: Console) -> None:
    """Header, per-parameter table, details of flagged and ill-conditioned tensors, summary."""
    # soft_wrap: long lines (the reproduce command above all) stay whole, for copying.
    console.print(Text("\n".join(header_lines(report)), style="dim"), soft_wrap=True)
    console.print(rich_table(report))
    if report.data_parallel and not report.data_parallel.get("ranks_agree", True):
        console.print(rank_table(report))
    noteworthy = report.flagged + [t for t in report.tensors if t.ill_conditioned and not t.flagged]
    for t in noteworthy:
        console.print(Text("\n".join(tensor_details(t)), style="red" if t.flagged else ""), soft_wrap=True)
    style = "bold red" if report.exit_code else "bold green"
    console.print()
    console.print(Text(summary_line(report), style=style), soft_wrap=True)


def table_text(report: Report, width: int = 160) -> str:
    """The table rendering as plain text (for files)."""
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    render_table(report, console)
    return console.file.getvalue()


def markdown(report: Report) -> str:
    """A GitHub-flavoured markdown report: header, table, flagged details, summary."""
    out = [f"## accumcheck: {report.case} ({report.framework}, {report.device}, N = {report.accum_steps})", ""]
    out += [f"- {line}" for line in header_lines(report)] + [""]
    cols = ["tensor", "kind", "shape", "max abs grad", "verdict", "ratio to bound", "max abs diff", "ulps",
            "rtol/atol mismatches", "cond S/abs(E)", "err native", "err manual", "nearer"]
    out.append("| " + " | ".join(cols) + " |")
    out.append("|" + "|".join("---" if c in ("tensor", "kind", "shape", "verdict", "nearer") else "---:"
                              for c in cols) + "|")
    for t in report.tensors:
        verdict = f"**{t.label}**" if t.flagged else t.label
        row = [f"`{t.name}`", t.kind, _shape(t), num(t.max_abs_grad), verdict, num(t.ratio), num(t.max_abs_diff),
               num(t.max_ulps), str(t.classic_mismatched), num(t.condition), num(t.err_native), num(t.err_manual),
               t.nearer]
        out.append("| " + " | ".join(row) + " |")
    noteworthy = report.flagged + [t for t in report.tensors if t.ill_conditioned and not t.flagged]
    if noteworthy:
        out += ["", "```"] + [line for t in noteworthy for line in tensor_details(t)] + ["```"]
    out += ["", f"**{summary_line(report)}**", ""]
    return "\n".join(out)


def csv_text(report: Report) -> str:
    """One row per tensor with every statistic; run facts repeated on each row."""
    buffer = io.StringIO()
    tensor_fields = [f.name for f in dataclasses.fields(TensorResult)]
    run_fields = ["case", "framework", "device", "accum_steps", "seed", "inject"]
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(run_fields + tensor_fields)
    for t in report.tensors:
        values = [getattr(report, f) for f in run_fields] + [getattr(t, f) for f in tensor_fields]
        writer.writerow(["x".join(map(str, v)) if isinstance(v, list) else ("" if v is None else v) for v in values])
    return buffer.getvalue()


def cross_summary(cross: CrossReport) -> str:
    """One line: per-framework verdicts and whether the frameworks agree."""
    parts = [f"{r.framework}: {'FLAGGED ' + str(len(r.flagged)) if r.flagged else 'OK'}" for r in cross.reports]
    disagree = cross.flagged
    names = " vs ".join(cross.frameworks)
    if disagree:
        listed = ", ".join(f"{a.name} ({a.kind}, {num(a.ratio)}x bound)" for a in
                           sorted(disagree, key=lambda a: KIND_ORDER.index(a.kind) if a.kind in KIND_ORDER else 9))
        agree = f"{names}: DISAGREE on {len(disagree)} of {len(cross.agreement)} tensors: {listed}"
    else:
        agree = f"{names}: all {len(cross.agreement)} tensors agree within the bound"
    return "; ".join(parts) + "; " + agree


def forward_line(cross: CrossReport) -> str:
    f = cross.forward
    if not f:
        return "forward: not compared"
    return (f"forward (logits of micro-batch 0): max |difference| {num(f['max_abs_diff'])} at {_index(f['index'])}, "
            f"{num(f['relative'])} of max |logit| {num(f['max_abs_logit'])} = {num(f['in_float32_units'])} float32 "
            "unit round-offs")


def agreement_table(cross: CrossReport) -> Table:
    table = Table(box=box.SIMPLE_HEAVY, header_style="bold", pad_edge=False,
                  title=f"manual accumulation: {' vs '.join(cross.frameworks)}")
    for title in ("tensor", "kind", "verdict", "ratio", "max|diff|", "ulps", f"fp32 err {cross.frameworks[0]}",
                  f"fp32 err {cross.frameworks[1]}"):
        table.add_column(title, justify="left" if title in ("tensor", "kind", "verdict") else "right",
                         no_wrap=title in ("tensor", "kind", "verdict"))
    for a in cross.agreement:
        style = "bold red" if a.flagged else ("green" if a.verdict == "identical" else "cyan")
        table.add_row(a.name, a.kind, Text(a.verdict, style=style), num(a.ratio), num(a.max_abs_diff),
                      num(a.max_ulps), num(a.float32_err_a), num(a.float32_err_b))
    return table


def render_cross_table(cross: CrossReport, console: Console) -> None:
    for report in cross.reports:
        render_table(report, console)
        console.print()
    console.print(Text(f"bound: |B_a - B_b| <= e_a + e_b + {cross.allowance:g}u * (S + S_rms,tensor + S_rms,model), "
                       "e_f = |B_f - O_f| each framework's float32 error against its own float64 run", style="dim"))
    console.print(agreement_table(cross))
    console.print(Text(forward_line(cross)))
    console.print(Text(f"reproduce: {cross.reproduce_command()}", style="dim"))
    console.print(Group(Text(""), Text(cross_summary(cross), style="bold red" if cross.exit_code else "bold green")))


def cross_markdown(cross: CrossReport) -> str:
    out = [markdown(r) for r in cross.reports]
    out.append(f"## {' vs '.join(cross.frameworks)}: manual accumulations")
    out.append("")
    out.append(f"| tensor | kind | verdict | ratio to bound | max abs diff | ulps | float32 error "
               f"{cross.frameworks[0]} | float32 error {cross.frameworks[1]} |")
    out.append("|---|---|---|---:|---:|---:|---:|---:|")
    for a in cross.agreement:
        verdict = f"**{a.verdict}**" if a.flagged else a.verdict
        out.append(f"| `{a.name}` | {a.kind} | {verdict} | {num(a.ratio)} | {num(a.max_abs_diff)} | {num(a.max_ulps)} "
                   f"| {num(a.float32_err_a)} | {num(a.float32_err_b)} |")
    out += ["", f"- {forward_line(cross)}", "", f"**{cross_summary(cross)}**", ""]
    return "\n".join(out)


def sweep_table(sweep: SweepReport) -> Table:
    rows = sweep.rows()
    kinds = sorted({k for row in rows for k in row["kinds"]})
    first = sweep.reports[0]
    table = Table(box=box.SIMPLE_HEAVY, header_style="bold", pad_edge=False,
                  title=f"{first.case}, {first.framework}: worst error of each kind, in units of u·S")
    for title in ["N", "bound", "√N"] + [f"{k} {m}" for k in kinds for m in ("native", "manual", "|A-B|")] + ["flagged"]:
        table.add_column(title, justify="left" if title == "flagged" else "right")
    for row in rows:
        cells = [str(row["N"]), num(row["bound"]), num(row["sqrt_N"])]
        for k in kinds:
            entry = row["kinds"].get(k, {})
            cells += [num(entry.get(m)) for m in ("native", "manual", "difference")]
        cells.append(Text(", ".join(row["flagged"]) or "-", style="bold red" if row["flagged"] else ""))
        table.add_row(*cells)
    return table


def sweep_summary(sweep: SweepReport) -> str:
    if sweep.flagged:
        steps = sorted({n for n, _ in sweep.flagged})
        names = sorted({name for _, name in sweep.flagged})
        return f"FLAGGED at N = {', '.join(map(str, steps))}: {', '.join(names)}"
    rows = sweep.rows()
    below = all(entry[m] <= row["bound"] for row in rows for entry in row["kinds"].values() for m in ("native", "manual"))
    return (f"OK at every N ({', '.join(str(r.accum_steps) for r in sweep.reports)}); errors "
            + ("below the bound throughout" if below else "above the bound somewhere"))


def sweep_markdown(sweep: SweepReport) -> str:
    rows = sweep.rows()
    kinds = sorted({k for row in rows for k in row["kinds"]})
    first = sweep.reports[0]
    out = [f"## accumcheck sweep: {first.case} ({first.framework}, {first.device})", "",
           "Worst error of each tensor kind against the float64 sum E, in units of u·S "
           "(the bound is γ(N−1)/u ≈ N − 1; typical round-off grows like √N).", ""]
    cols = ["N", "bound", "√N"] + [f"{k} {m}" for k in kinds for m in ("native", "manual", "abs(A-B)")] + ["flagged"]
    out.append("| " + " | ".join(cols) + " |")
    out.append("|" + "|".join("---:" for _ in cols[:-1]) + "|---|")
    for row in rows:
        cells = [str(row["N"]), num(row["bound"]), num(row["sqrt_N"])]
        for k in kinds:
            entry = row["kinds"].get(k, {})
            cells += [num(entry.get(m)) for m in ("native", "manual", "difference")]
        out.append("| " + " | ".join(cells + [", ".join(row["flagged"]) or "-"]) + " |")
    out += ["", f"**{sweep_summary(sweep)}**", ""]
    return "\n".join(out)


def render_sweep_table(sweep: SweepReport, console: Console) -> None:
    console.print(sweep_table(sweep))
    console.print(Group(Text(""), Text(sweep_summary(sweep), style="bold red" if sweep.flagged else "bold green")))


def render(report: "Report | CrossReport | SweepReport", fmt: str) -> str:
    """The report (cross-framework report, sweep) as text in ``fmt`` (one of FORMATS)."""
    if fmt == "html":
        from .html import html_report

        return html_report(report)
    if isinstance(report, SweepReport):
        if fmt == "json":
            return report.to_json()
        if fmt == "markdown":
            return sweep_markdown(report)
        if fmt == "csv":
            return "".join(csv_text(r) if i == 0 else csv_text(r).split("\n", 1)[1]
                           for i, r in enumerate(report.reports))
        console = Console(file=io.StringIO(), width=160, color_system=None, force_terminal=False)
        render_sweep_table(report, console)
        return console.file.getvalue()
    if isinstance(report, CrossReport):
        if fmt == "json":
            return report.to_json()
        if fmt == "markdown":
            return cross_markdown(report)
        if fmt == "csv":  # every framework's tensor rows; the agreement lives in json and markdown
            return "".join(csv_text(r) if i == 0 else csv_text(r).split("\n", 1)[1]
                           for i, r in enumerate(report.reports))
        console = Console(file=io.StringIO(), width=160, color_system=None, force_terminal=False)
        render_cross_table(report, console)
        return console.file.getvalue()
    if fmt == "json":
        return report.to_json()
    if fmt == "markdown":
        return markdown(report)
    if fmt == "csv":
        return csv_text(report)
    return table_text(report)


def render_console(report: "Report | CrossReport | SweepReport", console: Console) -> None:
    """Draw the table format on a live console (colours where it has them)."""
    if isinstance(report, SweepReport):
        render_sweep_table(report, console)
    elif isinstance(report, CrossReport):
        render_cross_table(report, console)
    else:
        render_table(report, console)

"""Plain-text lines of every report kind, shared by the table, markdown, HTML and the assertion
message. Rendering never computes: every figure comes from the report. Each function that takes a
report reads it through ``names.shown``: a name in it is printed with its control characters
escaped, whoever calls."""

from __future__ import annotations

import math

from ..report import KIND_ORDER, MARGINAL_RATIO, CrossReport, Report, ReportDiff, StackReport, SweepReport, TensorResult
from ..report.cross import OddOneOut
from ..run.budget import budget_note
from .names import shown


def num(x: float | None) -> str:
    """A number in 3 significant digits, scientific where that reads better."""
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    return f"{x:.3g}" if 1e-3 <= abs(x) < 1e5 else f"{x:.2e}"


def shape_text(t: TensorResult) -> str:
    return "x".join(map(str, t.shape)) or "scalar"


def index_text(index: list[int]) -> str:
    return "(" + ", ".join(map(str, index)) + ")"


def header_lines(report: Report) -> list[str]:
    report = shown(report)
    versions = " ".join(f"{k} {v}" for k, v in report.versions.items())
    native = report.bound["native"]
    allowance = native.get("kernel_allowance", 0.0)
    settings = ", ".join(report.notes)
    what = f"model {report.case}" if "model" in report.config else f"case {report.case}"
    seed = f"seed {report.seed} · " if report.seed >= 0 else ""  # a user's model has no seed of accumcheck's
    lines = [
        f"{what} · {report.framework} on {report.device} · N = {report.accum_steps} micro-steps · "
        f"{seed}params {report.param_dtype}, manual buffer {report.accum_dtype}"
        + (f" · {settings}" if settings else ""),
        f"{versions} · {report.seconds:.2f}s",
    ]
    if report.data_parallel:
        lines += data_parallel_lines(report)
    else:
        lines += [
            f"bound per element: |mode - E| <= gamma_k(u) * S + k * 2^-126, k = {native['roundings']}"
            + (f"; native also + {allowance:g}u * (S + S_rms) "
               + report.settings.get("native_allowance", "for kAddTo kernels") if allowance else ""),
            "E, S: float64 sums of the micro-gradients and of their magnitudes",
        ]
    if report.groups > 1:
        lines.append(budget_note(report.groups, report.config.get("memory_budget")))
    if report.inject:
        lines.append(f"injected fault: {report.inject}")
    if report.full_batch is not None:
        lines.append(full_batch_line(report))
    lines.append(f"reproduce: {report.reproduce_command()}")
    return lines


def data_parallel_lines(report: Report) -> list[str]:
    """How a data-parallel run was set up, its bounds, and what the ranks and the single-process
    reference said."""
    report = shown(report)
    p, bound = report.data_parallel, report.bound
    setup = p.setup
    w, n = setup.world_size, report.accum_steps
    hosts = setup.hosts
    lines = [
        f"data parallel: {w} ranks ({setup.backend}, {setup.launcher}"
        + (f", {len(hosts)} hosts" if len(hosts) > 1 else "") + f"), {w * n} global micro-batches "
        f"(rank r, micro-step k: batch k*{w} + r)"
        + ("; find_unused_parameters=True" if setup.find_unused_parameters else ""),
        f"native: {setup.native}; manual: {setup.manual}",
        f"E, S: float64 sums of every rank's micro-gradients and of their magnitudes, all-reduced, divided by {w}",
        f"bound per element: |mode - E| <= rel * S + k * 2^-126: native {num(bound['native']['relative'])} "
        f"(N-1 roundings on the rank, then the {setup.reduce_dtype} all-reduce), manual "
        f"{num(bound['manual']['relative'])}, single process {num(bound['single_process']['relative'])}, "
        f"a rank's own total against its own E, S {num(bound['rank']['relative'])}",
    ]
    single = p.single_process
    verdict = "agrees" if single.agree else "DISAGREES"
    lines.append(f"single-process reference ({setup.reference}): native {verdict}, worst "
                 f"{num(single.worst_agreement)}x the two bounds at {single.worst_tensor or '-'}")
    ranks = p.ranks
    if ranks and p.ranks_agree:
        lines.append(f"ranks: all {len(ranks)} agree (every rank's own total within round-off; the same gradient "
                     "on every rank after the all-reduce)")
    elif ranks:
        lines.append("ranks DISAGREE: " + "; ".join(
            f"rank {r.rank}" + (f" ({r.host})" if len(hosts) > 1 else "") + ": "
            + (f"FLAGGED {', '.join(r.flagged)}" if r.flagged else "faithful") for r in ranks)
            + ("" if p.final_identical else "; the ranks hold different gradients after the all-reduce"))
    return lines


def full_batch_line(report: Report) -> str:
    report = shown(report)
    f = report.full_batch
    verdict = "equivalent" if f.equivalent else (
        "DIFFERENT BY DESIGN (the model computes over the batch), not the accumulation" if f.faithful else
        "SEMANTIC MISMATCH (the loss normalisation, not round-off)")
    if f.explanation:  # what the accumulated gradient is (reports of earlier versions have no explanation)
        verdict = f.explanation if f.equivalent else f"{verdict}: {f.explanation}"
    return (f"full batch: loss '{f.normalisation}', accumulated sum x {f.accumulated_scaled_by} against one "
            f"backward over the whole batch (float64): largest difference {num(f.max_relative_difference)} of the "
            f"gradient's scale, at {f.worst_tensor}: {verdict}")


def _kind_rank(t: TensorResult) -> int:
    return KIND_ORDER.index(t.kind) if t.kind in KIND_ORDER else 9


def decisive(report: Report) -> list[TensorResult]:
    """The flagged tensors that are not marginal (severity diverged, or none recorded), in
    ``report.flagged``'s order."""
    return [t for t in report.flagged if t.severity != "marginal"]


def marginal(report: Report) -> list[TensorResult]:
    """The flagged tensors of severity marginal: within MARGINAL_RATIO times their bound with no
    single-step explanation."""
    return [t for t in report.flagged if t.severity == "marginal"]


def suspicious(report: Report) -> list[TensorResult]:
    """The suspicious tensors, embeddings and weights first, then by fault score."""
    hits = [t for t in report.tensors if t.verdict == "suspicious"]
    return sorted(hits, key=lambda t: (_kind_rank(t), -(t.fault_score or 0.0)))


def noteworthy(report: Report) -> list[TensorResult]:
    """The tensors whose details are printed: the flagged ones (decisive, then marginal), the
    suspicious ones, then the ill-conditioned others."""
    shown = decisive(report) + marginal(report) + suspicious(report)
    seen = {id(t) for t in shown}
    return shown + [t for t in report.tensors if t.ill_conditioned and id(t) not in seen]


def has_causes(report: Report) -> bool:
    """Some tensor's difference has a cause fitted: the tables get a cause column."""
    return any(t.cause is not None for t in report.tensors)


def cause_words(t: TensorResult) -> str:
    """The cause in a table's few words, "-" where none was fitted."""
    return t.cause.words if t.cause is not None and t.cause.words else "-"


def _named(tensors: list[TensorResult], item, most: int) -> str:
    more = f" and {len(tensors) - most} more" if len(tensors) > most else ""
    return ", ".join(item(t) for t in tensors[:most]) + more


def _flagged_item(t: TensorResult) -> str:
    figure = (f", {num(t.ratio)}x bound" if t.verdict == "diverged" else
              f", {num(t.err_ulps_native)} float32 ulps" if t.verdict == "precision-loss" else "")
    cause = f", {t.cause.words}" if t.cause is not None and t.cause.words else ""
    ranks = f", rank {', '.join(map(str, t.flagged_ranks))}" if t.flagged_ranks else ""
    return f"{t.name} ({t.kind}, {t.verdict}{figure}{cause}{ranks})"


def _suspicious_item(t: TensorResult) -> str:
    if t.cause is not None and t.cause.words:
        return f"{t.name} ({t.kind}, {t.cause.words})"
    if t.fault_score is not None:
        return f"{t.name} ({t.kind}, fault score {num(t.fault_score)} against {num(t.fault_score_threshold)})"
    return f"{t.name} ({t.kind})"


def _its(n: int) -> str:
    return "its" if n == 1 else "their"


def marginal_words(tensors: list[TensorResult], failing: bool) -> str:
    """The marginal tensors in a summary: "1 marginal, within 10x its bound: name (...)"."""
    return (f"{len(tensors)} marginal, within {MARGINAL_RATIO:g}x {_its(len(tensors))} bound"
            + ("" if failing else ", not failing") + ": " + _named(tensors, _flagged_item, 4))


def suspicious_words(tensors: list[TensorResult], failing: bool) -> str:
    """The suspicious tensors in a summary: "1 suspicious, inside its bound but shaped like a
    fault, not failing: name (...)"."""
    return (f"{len(tensors)} suspicious, inside {_its(len(tensors))} bound but shaped like a fault"
            + ("" if failing else ", not failing") + ": " + _named(tensors, _suspicious_item, 4))


def summary_line(report: Report) -> str:
    """One line: what was flagged (decisive tensors first, embeddings and weights first among
    them, then the marginal ones), what is suspicious, or that all is faithful."""
    report = shown(report)
    n = len(report.tensors)
    flagged, hard, soft, odd = report.flagged, decisive(report), marginal(report), suspicious(report)
    failing = {id(t) for t in report.failing}  # under the run's fail_on policy
    soft_fails, odd_fails = (any(id(t) in failing for t in group) for group in (soft, odd))
    tail = f"; {suspicious_words(odd, odd_fails)}" if odd else ""
    if report.semantic_mismatch and not flagged:
        headline = report.full_batch.headline
        return (f"FLAGGED: the accumulated gradient is not the full batch's (loss '{report.full_batch.normalisation}'; "
                f"every tensor is numerically faithful)" + (f": {headline}" if headline else "") + tail)
    counts = {v: sum(t.verdict == v for t in report.tensors)
              for v in ("identical", "round-off", "suspicious", "no-gradient")}
    parts = [f"{c} {'no gradient' if v == 'no-gradient' else v}" for v, c in counts.items() if c]
    if hard or soft_fails:
        groups = ([_named(hard, _flagged_item, 8)] if hard else []) + ([marginal_words(soft, soft_fails)] if soft else [])
        return f"FLAGGED {len(flagged)} of {n} tensors: {'; '.join(groups)}{tail}"
    if soft:
        return f"OK: no tensor diverged ({', '.join(parts)}); {marginal_words(soft, False)}{tail}"
    overflow = [t.name for t in report.tensors if t.verdict == "overflow"]
    if overflow:
        return (f"SKIPPED STEP: the loss-scaled micro-gradients overflowed in {len(overflow)} of {n} tensors "
                f"({', '.join(overflow[:4])}{' ...' if len(overflow) > 4 else ''}): the GradScaler skips this "
                f"optimizer step and lowers its scale; the others are faithful ({', '.join(parts)})")
    if odd_fails:
        return (f"SUSPICIOUS {len(odd)} of {n} tensors, inside {_its(len(odd))} bound but shaped like a fault: "
                f"{_named(odd, _suspicious_item, 8)} ({', '.join(parts)})")
    ill = sum(t.ill_conditioned for t in report.tensors)
    text = (f"OK: all {n} tensors within their bounds ({', '.join(parts)})" if odd else
            f"OK: all {n} tensors faithful ({', '.join(parts)})")
    return text + (f"; {ill} ill-conditioned (heavy cancellation, judged by the bound)" if ill else "") + tail


def tensor_details(t: TensorResult) -> list[str]:
    """torch.testing-style lines for one tensor, plus what the bound knows."""
    t = shown(t)
    pct = 100.0 * t.mismatched / t.numel if t.numel else 0.0
    lines = [f"{t.title} ({t.kind}, {shape_text(t)}, {t.dtype}): {t.label}"]
    if t.cause is not None and t.cause.detail:
        lines.append(f"  Cause: {t.cause.detail}")
    if t.severity == "marginal":
        lines.append(f"  Marginal: {num(t.ratio)}x its round-off bound, within {MARGINAL_RATIO:g}x, and no single "
                     "micro-step explains it")
    if t.verdict == "suspicious":
        lines.append("  Inside the worst-case bound, but its error lines up with a fault's pattern far beyond what "
                     "round-off does under the probabilistic model")
    if t.verdict == "no-gradient":
        lines.append("  No gradient in any micro-step: the parameter is unused by these batches (nothing to judge)")
        return lines
    if t.verdict == "overflow":
        lines.append(f"  The loss-scaled micro-gradients overflowed (inf or nan in {t.nonfinite_native} elements): "
                     "a GradScaler skips this optimizer step and lowers its scale; not an accumulation fault")
        return lines
    if t.steps_with_grad is not None:
        lines.append(f"  A gradient in {t.steps_with_grad} of the micro-steps only (a conditional parameter); "
                     "zeros in the others")
    if t.verdict == "non-finite":
        lines.append(f"  Non-finite elements: native {t.nonfinite_native}, manual {t.nonfinite_manual} of {t.numel}")
        return lines
    if t.mismatched:
        lines.append(f"  Mismatched elements: {t.mismatched} / {t.numel} ({pct:.1f}%) native vs manual; "
                     f"beyond the round-off bound: native {t.over_bound_native}, manual {t.over_bound_manual}")
    else:
        lines.append(f"  Native and manual agree in all {t.numel} elements")
    if t.mismatched:
        lines.append(f"  Greatest absolute difference: {num(t.max_abs_diff)} at index {index_text(t.max_abs_diff_index)} "
                     f"(up to {t.classic_atol:g} allowed by torch.testing's atol)")
        lines.append(f"  torch.testing's defaults (rtol={t.classic_rtol:g}, atol={t.classic_atol:g}) "
                     f"reject {t.classic_mismatched} elements")
        lines.append(f"  Greatest relative difference: {num(t.max_rel_diff)}; greatest ulp distance: {num(t.max_ulps)}")
    if t.worst_index:
        lines.append(f"  Worst element {index_text(t.worst_index)}: {t.worst_mode} is {num(t.ratio)}x its round-off "
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
    lines += statistics_lines(t)
    lines.append(f"  Gradient magnitude max|E| {num(t.max_abs_grad)}, {100 * t.norm_share:.3g}% of the whole gradient's "
                 f"sum of squares; condition number S/|E| {num(t.condition)}"
                 + (" (ill-conditioned: cancellation, not a bug, while within the bound)" if t.ill_conditioned else ""))
    return lines


def statistics_lines(t: TensorResult) -> list[str]:
    """The statistical tier's figures: the round-off spreads and the fault-pattern score, where it
    looked at the tensor."""
    lines = []
    if t.spread_predicted is not None:
        lines.append(f"  Round-off spread (root mean square): predicted {num(t.spread_predicted)} by the probabilistic "
                     f"model; measured native {num(t.spread_native)}, manual {num(t.spread_manual)}")
    if t.fault_score is not None:
        lines.append(f"  Fault-pattern score: {num(t.fault_score)}, against the threshold {num(t.fault_score_threshold)}")
    return lines


def cross_summary(cross: CrossReport) -> str:
    """One line: per-framework verdicts and whether the frameworks agree; with three or more, which
    framework disagrees with all the others on each tensor some pair disagrees on."""
    cross = shown(cross)
    parts = [f"{r.framework}: {'FLAGGED ' + str(len(r.flagged)) if r.flagged else 'OK'}" for r in cross.reports]
    names = " vs ".join(cross.frameworks)
    tensors = len({a.name for a in cross.agreement})
    disagree = [(a, pair) for a, pair in zip(cross.agreement, cross.pairs()) if a.flagged]
    if cross.odd_one_out:
        agree = (f"{names}: DISAGREE on {len(cross.odd_one_out)} of {tensors} tensors: "
                 + "; ".join(odd_one_out_sentences(cross.odd_one_out)))
    elif disagree:
        labelled = len(cross.frameworks) > 2
        listed = ", ".join(f"{a.name} ({a.kind}, {' vs '.join(pair) + ', ' if labelled else ''}{num(a.ratio)}x bound)"
                           for a, pair in sorted(disagree, key=lambda d: _kind_order(d[0].kind)))
        agree = f"{names}: DISAGREE on {len({a.name for a, _ in disagree})} of {tensors} tensors: {listed}"
    else:
        every = " in every pair" if len(cross.frameworks) > 2 else ""
        agree = f"{names}: all {tensors} tensors agree within the bound{every}"
    return "; ".join(parts) + "; " + agree


def _kind_order(kind: str) -> int:
    return KIND_ORDER.index(kind) if kind in KIND_ORDER else 9


def odd_one_out_sentence(odd: OddOneOut) -> str:
    """The framework that alone disagrees with all the others on a tensor, or that none does."""
    if odd.framework is not None:
        return f"{odd.framework} disagrees with {_and(odd.others())} on {odd.name} (worst ratio {num(odd.ratio)})"
    return (f"{_and([' vs '.join(pair) for pair in odd.disagreeing])} disagree on {odd.name} (worst ratio "
            f"{num(odd.ratio)}): no one framework disagrees with all the others")


def odd_one_out_sentences(odd_ones: list[OddOneOut]) -> list[str]:
    """One sentence a framework singled out, naming its tensors; then one a tensor that singles out no one."""
    named: dict[str, list[OddOneOut]] = {}
    for odd in odd_ones:
        if odd.framework is not None:
            named.setdefault(odd.framework, []).append(odd)
    sentences = [odd_one_out_sentence(found[0]) if len(found) == 1 else
                 f"{framework} disagrees with {_and(found[0].others())} on {len(found)} tensors (worst ratio "
                 f"{num(worst.ratio)} on {worst.name}): {', '.join(o.name for o in found)}"
                 for framework, found in named.items() for worst in [max(found, key=lambda o: o.ratio)]]
    return sentences + [odd_one_out_sentence(odd) for odd in odd_ones if odd.framework is None]


def _and(items: list[str]) -> str:
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else "".join(items)


def forward_lines(cross: CrossReport) -> list[str]:
    """Each pair's logits of micro-batch 0 compared, the pair named."""
    cross = shown(cross)
    if not cross.forwards():
        return ["forward: not compared"]
    return [f"forward (logits of micro-batch 0), {' vs '.join(cross.forward_pair(f))}: "
            f"max |difference| {num(f.max_abs_diff)} at {index_text(f.index)}, {num(f.relative)} of max |logit| "
            f"{num(f.max_abs_logit)} = {num(f.in_float32_units)} float32 unit round-offs" for f in cross.forwards()]


def sweep_summary(sweep: SweepReport) -> str:
    sweep = shown(sweep)
    if sweep.flagged:
        steps = sorted({n for n, _ in sweep.flagged})
        names = sorted({name for _, name in sweep.flagged})
        return f"FLAGGED at N = {', '.join(map(str, steps))}: {', '.join(names)}"
    rows = sweep.rows()
    below = all(entry[m] <= row["bound"] for row in rows for entry in row["kinds"].values() for m in ("native", "manual"))
    return (f"OK at every N ({', '.join(str(r.accum_steps) for r in sweep.reports)}); errors "
            + ("below the bound throughout" if below else "above the bound somewhere"))


def describe(a: Report) -> str:
    a = shown(a)
    versions = " ".join(f"{k} {v}" for k, v in a.versions.items() if k != "accumcheck")
    return f"{a.case}, {a.framework} ({versions}) on {a.device}, N = {a.accum_steps}" + (
        f", injected {a.inject}" if a.inject else "")


def diff_summary(diff: ReportDiff) -> str:
    """One line: which tensors changed verdict, or that none did."""
    diff = shown(diff)
    changed = diff.changed
    if changed:
        return (f"{len(changed)} of {len(diff.common)} tensors changed verdict: "
                + ", ".join(f"{c.name} ({c.verdict_a} -> {c.verdict_b})" for c in changed))
    return f"no verdict changed ({len(diff.common)} tensors in both)"


def diff_extra_lines(diff: ReportDiff) -> list[str]:
    """The tensors found in one report only."""
    diff = shown(diff)
    return (([f"only in A: {', '.join(diff.only_a)}"] if diff.only_a else [])
            + ([f"only in B: {', '.join(diff.only_b)}"] if diff.only_b else []))


def one_line(report: Report | CrossReport | SweepReport | StackReport) -> str:
    """The summary line of any comparison report kind."""
    report = shown(report)
    if isinstance(report, StackReport):
        return report.summary()
    if isinstance(report, SweepReport):
        return sweep_summary(report)
    if isinstance(report, CrossReport):
        return cross_summary(report)
    return summary_line(report)

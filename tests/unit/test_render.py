"""What the renderers say of a tensor's cause, severity and the statistical tier, from reports built
by hand: the terminal table, the summary line, the details, markdown, HTML and the pictures."""

from __future__ import annotations

import csv
import dataclasses
import io
import math

import pytest
from matplotlib.text import Text

from accumcheck.render.csvfile import csv_rows
from accumcheck.render.html import html_report
from accumcheck.render.markdown import markdown
from accumcheck.render.plots import FLAGGED_COLOUR, SUSPICIOUS_COLOUR, growth, heatmaps, scatter, trajectory
from accumcheck.render.table import rich_table, table_text
from accumcheck.render.wording import summary_line, tensor_details
from accumcheck.report import Cause, Report, TensorResult, TrajectoryReport


def tensor(name: str, kind: str = "weight", verdict: str = "round-off", ratio: float = 0.2, **fields) -> TensorResult:
    base = dict(name=name, kind=kind, shape=[4, 8], dtype="float32", verdict=verdict, ill_conditioned=False, numel=32,
                max_abs_grad=1.0, mismatched=0, max_abs_diff=0.0, max_abs_diff_index=[0, 0], max_rel_diff=0.0,
                max_ulps=0.0, classic_mismatched=0, classic_rtol=1.3e-6, classic_atol=1e-5, ratio=ratio,
                worst_mode="native", worst_index=[1, 2], bound_at_worst=1e-6, ratio_native=ratio, ratio_manual=0.1,
                over_bound_native=0, over_bound_manual=0, err_native=ratio * 1e-6, err_manual=1e-7, rel_err_native=1e-7,
                rel_err_manual=1e-7, condition=1.5, nearer="manual", nonfinite_native=0, nonfinite_manual=0)
    return TensorResult(**{**base, **fields})


def cause(words: str, detail: str, kind: str = "repeat-step", step: int | None = 8) -> Cause:
    return Cause(kind=kind, mode="native", words=words, detail=detail, fit=1.0, residual_ratio=0.5, step=step,
                 factor=1.0)


def report(tensors: list[TensorResult], **config) -> Report:
    return Report(case="toy", case_source="case toy", case_fingerprint="f", case_toml="", framework="torch",
                  versions={"accumcheck": "0", "torch": "2"}, device="cpu", param_dtype="float32",
                  accum_dtype="float32", accum_steps=16, seed=0, oracle=False, inject=None,
                  bound={"native": {"roundings": 15, "relative": 1e-6}, "manual": {"roundings": 15, "relative": 1e-6}},
                  settings={}, losses={"mean_loss": 1.0}, seconds=0.5, created="now", tensors=tensors,
                  config={"model": "MyNet", **config})


def mixed(**config) -> Report:
    """One decisive flagged tensor, one marginal, one suspicious, one clean; the marginal one first in
    the report's own order (a norm would sort after weights anyway: it is put first on purpose)."""
    return report([
        tensor("ln.weight", "norm", "diverged", 3.2, severity="marginal",
               cause=cause("unexplained", "native: no single fault explains it (best fit 0.12)", "unexplained", None)),
        tensor("embed.weight", "embedding", "diverged", 9.3e5, severity="diverged",
               cause=cause("step 8 counted twice", "native: micro-step 8 counted twice (fit 1.000)")),
        tensor("attn.weight", "weight", "suspicious", 0.4, fault_score=41.0, fault_score_threshold=6.2,
               spread_predicted=5e-8, spread_native=9e-8, spread_manual=4e-8,
               cause=cause("step 3 counted twice", "native: micro-step 3 counted twice (fit 0.970)")),
        tensor("out.bias", "bias"),
    ], **config)


def plain() -> Report:
    """A report of an earlier version: no cause, no severity."""
    return report([tensor("embed.weight", "embedding", "diverged", 12.0), tensor("out.bias", "bias")])


def header(text: str) -> str:
    return next(line for line in text.splitlines() if line.lstrip().startswith("tensor"))


# ----------------------------------------------------------------------------- the table


def test_the_cause_column_holds_each_cause_in_words_and_a_dash_where_none():
    text = table_text(mixed(), width=200)
    assert header(text).split()[:6] == ["tensor", "kind", "shape", "max|g|", "verdict", "cause"]
    rows = [line.split("  ") for line in text.splitlines() if line.startswith((" ln.", " embed.", " attn.", " out."))]
    assert [[cell.strip() for cell in row if cell.strip()][5] for row in rows] == [
        "unexplained", "step 8 counted twice", "step 3 counted twice", "-"]


def test_without_a_cause_the_table_has_no_cause_column():
    assert "cause" not in header(table_text(plain(), width=200))
    assert "cause" not in markdown(plain())
    page = html_report(plain())
    assert "<th" in page and ">cause</th>" not in page and 'class="text cause' not in page


def test_the_verdict_cell_says_marginal_and_suspicious_has_its_own_colour():
    table = rich_table(mixed())
    verdicts = next(c for c in table.columns if c.header == "verdict")._cells
    assert [v.plain for v in verdicts] == ["diverged (marginal)", "diverged", "suspicious", "round-off"]
    assert verdicts[1].style == "bold red" and verdicts[0].style == "red"  # marginal: red, not bold
    assert verdicts[2].style == "yellow" and verdicts[2].style not in (verdicts[0].style, verdicts[1].style)


# ----------------------------------------------------------------------------- the summary line


def test_the_summary_names_decisive_tensors_first_then_the_marginal_ones_then_the_suspicious():
    line = summary_line(mixed())
    assert line.startswith("FLAGGED 2 of 4 tensors: embed.weight (embedding, diverged, 9.30e+05x bound, "
                           "step 8 counted twice); 1 marginal, within 10x its bound: ln.weight (norm, diverged, "
                           "3.2x bound, unexplained); 1 suspicious")
    assert line.index("embed.weight") < line.index("marginal") < line.index("ln.weight") < line.index("attn.weight")
    assert line.endswith("1 suspicious, inside its bound but shaped like a fault, not failing: attn.weight "
                         "(weight, step 3 counted twice)")


def test_a_report_without_severities_is_summed_up_as_before():
    assert summary_line(plain()) == "FLAGGED 1 of 2 tensors: embed.weight (embedding, diverged, 12x bound)"
    clean = report([tensor("out.bias", "bias"), tensor("out.weight", verdict="identical")])
    assert summary_line(clean) == "OK: all 2 tensors faithful (1 identical, 1 round-off)"


def test_the_summary_follows_the_fail_on_policy():
    both = summary_line(mixed(fail_on="diverged"))
    assert "embed.weight (embedding, diverged" in both and "1 marginal, within 10x its bound, not failing: ln.weight" in both
    only_marginal = mixed(fail_on="diverged")
    only_marginal.tensors.pop(1)  # no decisive tensor left
    line = summary_line(only_marginal)
    assert line.startswith("OK: no tensor diverged (1 round-off, 1 suspicious); 1 marginal, within 10x its bound, "
                           "not failing: ln.weight")
    suspicious = report([mixed().tensors[2], tensor("out.bias", "bias")], fail_on="suspicious")
    assert summary_line(suspicious).startswith("SUSPICIOUS 1 of 2 tensors, inside its bound but shaped like a "
                                               "fault: attn.weight (weight, step 3 counted twice)")
    quiet = report([mixed().tensors[2], tensor("out.bias", "bias")])
    assert summary_line(quiet) == ("OK: all 2 tensors within their bounds (1 round-off, 1 suspicious); 1 suspicious, "
                                   "inside its bound but shaped like a fault, not failing: attn.weight (weight, "
                                   "step 3 counted twice)")


# ----------------------------------------------------------------------------- the details


def test_the_details_tell_the_cause_the_severity_and_the_statistical_tier():
    marginal, decisive, odd, _ = mixed().tensors
    lines = tensor_details(decisive)
    assert lines[1] == "  Cause: native: micro-step 8 counted twice (fit 1.000)"
    assert "  Marginal: 3.2x its round-off bound, within 10x, and no single micro-step explains it" in \
        tensor_details(marginal)
    odd_lines = tensor_details(odd)
    assert odd_lines[0].endswith(": suspicious") and "  Cause: native: micro-step 3 counted twice (fit 0.970)" in odd_lines
    assert ("  Round-off spread (root mean square): predicted 5.00e-08 by the probabilistic model; measured native "
            "9.00e-08, manual 4.00e-08") in odd_lines
    assert "  Fault-pattern score: 41, against the threshold 6.2" in odd_lines
    assert not any("spread" in line or "score" in line for line in tensor_details(plain().tensors[0]))


def test_every_format_prints_the_details_of_flagged_and_suspicious_tensors_decisive_first():
    for text in (table_text(mixed(), width=200), markdown(mixed()), html_report(mixed())):
        firsts = [text.index(f"{name} ({kind}, 4x8, float32)") for name, kind in
                  (("embed.weight", "embedding"), ("ln.weight", "norm"), ("attn.weight", "weight"))]
        assert firsts == sorted(firsts)
        assert "out.bias (bias, 4x8" not in text


# ----------------------------------------------------------------------------- markdown and HTML


def test_markdown_has_the_cause_column_marginal_in_bold_and_suspicious_in_italics():
    lines = markdown(mixed()).splitlines()
    head = next(line for line in lines if line.startswith("| tensor"))
    assert head.split(" | ")[4:6] == ["verdict", "cause"]
    rows = {line.split(" | ")[0][3:-1]: line.split(" | ") for line in lines if line.startswith("| `")}
    assert rows["embed.weight"][4:6] == ["**diverged**", "step 8 counted twice"]
    assert rows["ln.weight"][4:6] == ["**diverged (marginal)**", "unexplained"]
    assert rows["attn.weight"][4:6] == ["*suspicious*", "step 3 counted twice"]
    assert rows["out.bias"][4:6] == ["round-off", "-"]
    assert len({line.count(" | ") for line in lines if line.startswith("| ")}) == 1  # every row has each column


def test_html_has_the_cause_column_and_styles_marginal_and_suspicious_apart():
    page = html_report(mixed())
    assert '<th class="text">cause</th>' in page
    assert '<td class="text flagged">diverged</td><td class="text cause marginal">step 8 counted twice</td>' in page
    assert '<td class="text flagged marginal">diverged (marginal)</td>' in page
    assert '<td class="text suspicious">suspicious</td><td class="text cause suspicious">step 3 counted twice</td>' \
        in page
    assert ".suspicious {" in page and ".marginal {" in page


def test_csv_writes_the_cause_in_columns_of_its_own():
    rows = list(csv.DictReader(io.StringIO(csv_rows(mixed()))))
    assert "cause" not in rows[0]  # no record's repr in a cell
    assert [row["cause_words"] for row in rows] == ["unexplained", "step 8 counted twice", "step 3 counted twice", ""]
    assert rows[1]["cause_kind"] == "repeat-step" and rows[1]["cause_step"] == "8" and rows[0]["cause_step"] == ""
    assert [row["severity"] for row in rows] == ["marginal", "diverged", "", ""]


def test_csv_of_three_frameworks_says_how_each_agrees_and_which_is_odd():
    from accumcheck.judge.agreement import odd_one_out
    from accumcheck.report import Agreement, CrossReport

    def record(name, pair, ratio):
        return Agreement(name=name, kind="weight", shape=[2], verdict="agree" if ratio <= 1 else "disagree",
                         max_abs_diff=0.0, max_abs_diff_index=[0], max_ulps=0.0, ratio=ratio, worst_index=[0],
                         bound_at_worst=1e-7, float32_err_a=0.0, float32_err_b=0.0, frameworks=pair)

    frameworks = ["torch", "mxnet", "jax"]
    # jax alone disagrees on embed.weight; every pair agrees on the other tensors
    ratios = {("torch", "jax"): 7.0, ("mxnet", "jax"): 9.0}
    pairs = [["torch", "mxnet"], ["torch", "jax"], ["mxnet", "jax"]]
    agreement = [record(t.name, pair, ratios.get(tuple(pair), 0.25) if t.name == "embed.weight" else 0.5)
                 for pair in pairs for t in mixed().tensors]
    reports = [dataclasses.replace(mixed(), framework=f) for f in frameworks]
    cross = CrossReport(frameworks=frameworks, reports=reports, agreement=agreement, forward=None, allowance=16.0,
                        odd_one_out=odd_one_out(frameworks, agreement))
    rows = {(row["framework"], row["name"]): row for row in csv.DictReader(io.StringIO(csv_rows(cross)))}
    assert len(rows) == 12
    columns = ("agreement_verdict", "agreement_ratio", "agreement_worst_with", "odd_one_out")
    assert [rows["jax", "embed.weight"][c] for c in columns] == ["disagree", "9.0", "mxnet", "jax"]
    assert [rows["torch", "embed.weight"][c] for c in columns] == ["disagree", "7.0", "jax", "jax"]
    assert [rows["mxnet", "out.bias"][c] for c in columns] == ["agree", "0.5", "torch", ""]
    assert "agreement_verdict" not in next(csv.DictReader(io.StringIO(csv_rows(mixed()))))  # one framework


# ----------------------------------------------------------------------------- the pictures


def _texts(fig) -> dict[str, object]:
    return {t.get_text(): t for ax in fig.axes for t in ax.texts}


def test_the_scatter_labels_flagged_tensors_with_their_cause_and_suspicious_ones_in_another_colour():
    fig = scatter(mixed())
    texts = _texts(fig)
    assert texts["embed.weight: step 8 counted twice"].get_color() == FLAGGED_COLOUR
    assert texts["ln.weight: unexplained (marginal)"].get_color() == FLAGGED_COLOUR
    assert texts["attn.weight: step 3 counted twice (suspicious)"].get_color() == SUSPICIOUS_COLOUR
    assert FLAGGED_COLOUR != SUSPICIOUS_COLOUR
    assert "out.bias" not in " ".join(texts)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "flagged" in legend and "suspicious" in legend


def test_the_scatter_labels_never_overlap_nor_leave_the_axes():
    crowd = report([tensor(f"block{i}.weight", verdict="diverged", ratio=3.0 + 0.01 * i, severity="diverged",
                           bound_at_worst=1e-6 * (1 + 0.001 * i), cause=cause("sum kept in bfloat16", "d"))
                    for i in range(14)])
    fig = scatter(crowd)
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    frame = ax.get_window_extent(renderer)
    labels = [t for t in ax.texts if "bfloat16" in t.get_text()]
    for label in labels:
        label.update_positions(renderer)
    boxes = [Text.get_window_extent(t, renderer) for t in labels]  # the text alone, not its leader line
    assert boxes and all(frame.x0 <= b.x0 and b.x1 <= frame.x1 and frame.y0 <= b.y0 and b.y1 <= frame.y1
                         for b in boxes)
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    left = 14 - len(boxes)
    assert left and f"{left} more ringed\ntensor(s) not\nlabelled: see\nthe table" in _texts(fig)


def _trajectory(band: dict[str, list[float]], steps: int = 4, **fields) -> TrajectoryReport:
    # losses that differ in the 8th digit: matplotlib would write them as 1e-7 + 6.9314e-1
    losses = {mode: [0.69314718 + 1e-7 * k for k in range(steps)] for mode in ("native", "manual")}
    fields.setdefault("max_diff", band)
    return TrajectoryReport(case="toy", optimizer="adam", lr=1e-3, accum_steps=4, steps=steps, inject=None,
                            versions={}, losses=losses, band_ratio=band, first_out_of_band={}, **fields)


def test_the_trajectory_writes_the_loss_plainly_ticks_whole_steps_and_marks_identical_steps():
    fig = trajectory(_trajectory({"weight": [0.0, 0.5, 0.0, 4.0], "bias": [0.0, 0.0, 0.0, 0.0]}))
    fig.canvas.draw()
    loss, distance, identical = fig.axes
    assert loss.yaxis.get_offset_text().get_text() == ""
    assert all(0.69 < float(t.get_text().replace("−", "-")) < 0.7 for t in loss.get_yticklabels() if t.get_text())
    low, high = identical.get_xlim()
    ticks = [t for t in identical.get_xticks() if low <= t <= high]
    assert ticks and all(float(t).is_integer() for t in ticks)
    assert identical.get_xlabel() == "optimizer step (counted from 0)"
    assert [t.get_text() for t in identical.get_yticklabels()] == ["identical"]
    marked = sorted((x, line.get_color()) for line in identical.get_lines() for x in line.get_xdata())
    assert [x for x, _ in marked] == [0, 0, 1, 2, 2, 3]  # weight at 0 and 2, bias at every step
    drawn = {x for line in distance.get_lines() for x, y in zip(line.get_xdata(), line.get_ydata())
             if math.isfinite(y) and y != 1.0}
    assert drawn == {1, 3}  # nothing drawn at a floor on the log scale
    assert distance.get_ylim()[0] > 1e-2


def test_a_trajectory_without_identical_steps_has_no_identical_row_and_a_non_finite_one_is_shaded():
    fig = trajectory(_trajectory({"weight": [0.5, 2.0, math.nan, math.nan]}, non_finite={"loss (native)": 2}))
    assert len(fig.axes) == 2
    legend = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert "inf or nan: not compared" in legend


def _controlled(**fields) -> TrajectoryReport:
    """Three steps of one kind with the control: native's gap 1e-6 then 5e-4 (past 100 x the
    control's 1e-6 at step 2), identical at step 0."""
    return _trajectory({"weight": [0.0, 8.0, 4000.0]}, steps=3, max_diff={"weight": [0.0, 1e-6, 5e-4]},
                       control_diff={"weight": [1e-6, 1e-6, 1e-6]}, control_ratio={"weight": [0.0, 1.0, 500.0]},
                       margin=100.0, first_out_of_control={"w": 2}, **fields)


def test_a_trajectory_with_a_control_draws_both_gaps_and_shades_the_controls_band_up_to_the_margin():
    fig = trajectory(_controlled())
    fig.canvas.draw()
    loss, gaps, judged, identical = fig.axes
    gap_lines = {line.get_label(): line for line in gaps.get_lines()}
    assert set(gap_lines) == {"weight: native", "weight: control"}
    assert list(gap_lines["weight: control"].get_ydata()) == [1e-6, 1e-6, 1e-6]
    legend = [t.get_text() for t in judged.get_legend().get_texts()]
    assert "margin (100×): flagged above" in legend
    assert "within 100× the control's band: as two valid orders differ" in legend
    assert any(line.get_ydata()[0] == 100.0 for line in judged.get_lines() if line.get_label().startswith("margin"))
    shaded = [patch for patch in judged.patches if patch.get_label().startswith("within")]
    assert shaded and shaded[0].get_extents().height > 0
    ticks = [t.get_text() for t in judged.get_yticklabels() if t.get_text()]
    assert ticks and all("$" not in t for t in ticks)  # powers of ten as text, not mathtext source
    assert [t.get_text() for t in identical.get_yticklabels()] == ["identical"]


def test_the_trajectory_table_shows_the_control_gap_beside_native_and_marks_a_flagged_step():
    from accumcheck.render.table import trajectory_columns, trajectory_legend

    columns = {column.header: column for column in trajectory_columns(_controlled())}
    assert {"weight gap", "weight control", "weight ×control", "weight ulps"} <= set(columns)
    assert [cell.plain for cell in columns["weight control"].cells] == ["1.00e-06"] * 3
    assert [cell.style for cell in columns["weight ×control"].cells] == ["", "", "bold red"]
    assert "past 100: flagged" in trajectory_legend(_controlled())["KIND ×control"]
    old = {column.header for column in trajectory_columns(_trajectory({"weight": [0.0, 2.0]}, steps=2))}
    assert "weight control" not in old and "weight ulps" in old  # a report from before the control


def test_the_heatmap_titles_carry_the_label_and_cause_and_its_ticks_the_tensor_indices():
    maps = dataclasses.replace(mixed(), tensors=[
        dataclasses.replace(t, ratio_map=[[0.0, 2.0], [1.0, 0.5]], ratio_map_cell=[1, 64]) for t in mixed().tensors[:3]])
    fig = heatmaps(maps)
    fig.canvas.draw()
    titles = [ax.get_title() for ax in fig.axes[:3]]
    assert titles == ["ln.weight: diverged (marginal)\nunexplained", "embed.weight: diverged\nstep 8 counted twice",
                      "attn.weight: suspicious\nstep 3 counted twice"]
    # two cells of 64 columns: the ticks name columns, at their place (column v at v / 64 - 1/2 on the cells)
    ticks = [(tick, int(label.get_text().replace(",", ""))) for tick, label in
             zip(fig.axes[0].get_xticks(), fig.axes[0].get_xticklabels())]
    assert len(ticks) >= 2 and max(v for _, v in ticks) > 1
    assert all(tick == pytest.approx(v / 64 - 0.5) for tick, v in ticks)
    bar = fig.axes[-1]
    assert "≤ −3 or exact" in [t.get_text() for t in bar.get_yticklabels()]


def test_the_growth_plot_ticks_the_n_that_ran_and_says_what_was_exact():
    reports = []
    for n, error in ((1, 0.0), (4, 0.5), (16, 2.0)):
        r = report([tensor("w", ratio=error, ratio_manual=error)])
        r.accum_steps = n
        r.bound = {mode: {"relative": (n - 1) * 2.0**-24, "roundings": n - 1} for mode in ("native", "manual")}
        reports.append(r)
    fig = growth(reports)
    fig.canvas.draw()
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "4", "16"]
    assert any(t.get_text() == "exact (no error), not drawn:\nN = 1" for t in ax.texts)


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")

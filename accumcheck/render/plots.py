"""Pictures of a report (matplotlib, drawn off-screen): where each tensor sits against its bound,
where in a tensor the differences sit, and how errors grow with the number of micro-steps. Names in
titles and labels are drawn as ``names.shown`` prints them, never read as mathtext."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..files import check_replaceable, safe_file_name
from ..report import Report, TensorResult, TrajectoryReport, growth_rows
from .names import shown
from .wording import decisive, marginal, suspicious

KIND_COLOURS = {"embedding": "#d62728", "weight": "#1f77b4", "bias": "#2ca02c", "norm": "#9467bd"}
FLAGGED_COLOUR = "#8b0000"
SUSPICIOUS_COLOUR = "#b07000"
LABELLED = 10  # tensors labelled on the scatter at most; the table names the rest


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    # parse_math off: a name's $...$ is drawn as it is, not read as mathtext (which a name could break)
    plt.rcParams.update({"font.size": 11, "axes.titlesize": 12, "axes.labelsize": 11, "legend.fontsize": 9,
                         "text.parse_math": False})
    return plt


def _point_label(t: TensorResult) -> str:
    """A tensor's label on the scatter: its name, its cause in a few words, and (marginal) or
    (suspicious) where it is so."""
    words = t.cause.words if t.cause is not None and t.cause.words else ""
    text = f"{t.name}: {words}" if words else t.name
    return text + (" (marginal)" if t.severity == "marginal" else " (suspicious)" if t.verdict == "suspicious" else "")


def _label_offsets() -> list[tuple[float, float]]:
    """Where a label may sit, in points from its point to the middle of the label's near edge,
    nearest first: beside the point, then up or down a line at a time, then further aside."""
    near = [(dx, dy) for dy in range(-14 * 8, 14 * 8 + 1, 14) for dx in (8, -8, 40, -40, 80, -80)]
    return sorted(near, key=lambda o: (o[0] ** 2 + o[1] ** 2, o[0] < 0, o[1] > 0))


def _unlabelled(n: int) -> str:
    return f"{n} more ringed\ntensor(s) not\nlabelled: see\nthe table"


def _place_labels(fig: Any, ax: Any, labels: list[tuple[float, float, str, str]], points: list[tuple[float, float]],
                  obstacles: Sequence[Any] = ()) -> int:
    """Annotate each (x, y, text, colour) where the text overlaps no other label, nor ``obstacles``, stays
    inside the axes and, if it can, covers no drawn point; a label set off its point gets a leader
    line. Returns how many found no such place (they are left out, not drawn over one another)."""
    from matplotlib.path import Path
    from matplotlib.transforms import Bbox

    fig.canvas.draw()  # the layout settles first: the labels are placed in its final coordinates
    fig.set_layout_engine("none")
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    taken = [artist.get_window_extent(renderer) for artist in obstacles]
    dots = [Bbox.from_extents(x - 5, y - 5, x + 5, y + 5) for x, y in ax.transData.transform(points)] if points else []
    scale = fig.dpi / 72.0
    lines: list[Any] = []  # the leader lines drawn
    left_out = 0
    for x, y, text, colour in labels:
        probe = ax.text(0, 0, text, fontsize=9)
        box = probe.get_window_extent(renderer)
        width, height = box.width, box.height
        probe.remove()
        px, py = ax.transData.transform((x, y))
        own = Bbox.from_extents(px - 5, py - 5, px + 5, py + 5)

        def where(dx: float, dy: float) -> Any:
            x0 = px + dx * scale - (width if dx < 0 else 0)
            y0 = py + dy * scale - height / 2
            return Bbox.from_extents(x0 - 1, y0 - 1, x0 + width + 1, y0 + height + 1)

        def leader(dx: float, dy: float) -> Any:
            return Path([(px, py), (px + dx * scale, py + dy * scale)])

        def fits(dx: float, dy: float, spare_dots: bool) -> bool:
            b, line = where(dx, dy), leader(dx, dy)
            return (frame.x0 <= b.x0 and b.x1 <= frame.x1 and frame.y0 <= b.y0 and b.y1 <= frame.y1
                    and not any(b.overlaps(t) for t in taken) and not b.overlaps(own)
                    and not any(line.intersects_bbox(t) for t in taken)  # no leader line through a label
                    and not any(other.intersects_bbox(b) for other in lines)
                    and (spare_dots or not any(b.overlaps(d) for d in dots)))

        chosen = next((o for spare in (False, True) for o in _label_offsets() if fits(*o, spare)), None)
        if chosen is None:
            left_out += 1
            continue
        dx, dy = chosen
        far = abs(dx) > 8 or dy != 0
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), ha="right" if dx < 0 else "left",
                    va="center", fontsize=9, color=colour,
                    arrowprops=dict(arrowstyle="-", color=colour, linewidth=0.6, shrinkA=0, shrinkB=5) if far else None)
        taken.append(where(dx, dy))
        if far:
            lines.append(leader(dx, dy))
    return left_out


def scatter(report: Report) -> Any:
    """Each tensor's worst element: its distance from E against its round-off bound, log-log.
    Above the diagonal cannot be round-off; flagged tensors (ringed in dark red) are labelled with
    their cause, suspicious ones (ringed in amber) too."""
    report = shown(report)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 6), constrained_layout=True)
    points = [(t.bound_at_worst, t.ratio * t.bound_at_worst, t) for t in report.tensors
              if t.bound_at_worst > 0 and t.ratio > 0 and math.isfinite(t.ratio)]
    drawn = {id(t) for _, _, t in points}
    zero = [t for t in report.tensors if t.ratio == 0]
    endless = [t for t in report.tensors if not math.isfinite(t.ratio)]
    for kind, colour in KIND_COLOURS.items():
        xs = [x for x, _, t in points if t.kind == kind]
        ys = [y for _, y, t in points if t.kind == kind]
        if xs:
            ax.scatter(xs, ys, s=36, c=colour, label=kind, alpha=0.8, edgecolors="none")
    for name, colour, chosen in (("flagged", FLAGGED_COLOUR, [t for _, _, t in points if t.flagged]),
                                 ("suspicious", SUSPICIOUS_COLOUR,
                                  [t for _, _, t in points if t.verdict == "suspicious"])):
        if chosen:
            ax.scatter([t.bound_at_worst for t in chosen], [t.ratio * t.bound_at_worst for t in chosen], s=110,
                       facecolors="none", edgecolors=colour, linewidths=1.5, label=name)
    notes = []
    if points:
        low = min(min(x, y) for x, y, _ in points) / 10
        high = max(max(x, y) for x, y, _ in points) * 10
        ax.plot([low, high], [low, high], color="black", linewidth=1, linestyle="--", label="error = bound")
        ax.fill_between([low, high], [low, high], [high, high], color="#d62728", alpha=0.06, label="not round-off")
        ax.set_xlim(low, high)
        ax.set_ylim(low, high)
    if zero:
        notes.append(f"{len(zero)} exact tensor(s) not drawn")
    if endless:
        notes.append(f"{len(endless)} non-finite tensor(s) not drawn")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("round-off bound at the worst element (gradient units)")
    ax.set_ylabel("|mode − E| at that element (gradient units)")
    ax.set_title(f"{report.case}, {report.framework}, N = {report.accum_steps}: error against bound"
                 + (f"\n{'; '.join(notes)}" if notes else ""))
    ax.grid(True, which="major", alpha=0.3)
    if points:  # every tensor exact: nothing drawn, nothing to label (matplotlib would warn on stderr)
        # beside the axes, not over them: the flagged points sit in the upper left
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
        wanted = [t for t in decisive(report) + marginal(report) + suspicious(report) if id(t) in drawn]
        labels = [(t.bound_at_worst, t.ratio * t.bound_at_worst, _point_label(t),
                   FLAGGED_COLOUR if t.flagged else SUSPICIOUS_COLOUR) for t in wanted[:LABELLED]]
        # what was left unlabelled is said under the legend, off the points; the layout keeps room for
        # the note before the labels are placed, its count comes after
        note = ax.text(1.02, 0.0, _unlabelled(len(wanted)), ha="left", va="bottom", transform=ax.transAxes,
                       fontsize=9, color="#444444")
        unlabelled = len(wanted) - len(labels) + _place_labels(fig, ax, labels, [(x, y) for x, y, _ in points])
        if unlabelled:
            note.set_text(_unlabelled(unlabelled))
        else:
            note.remove()
    return fig


def heatmaps(report: Report) -> Any | None:
    """Where in each mapped tensor the modes sit furthest from E, as log10(ratio to the bound),
    one colour scale for all; None when no tensor has a map."""
    report = shown(report)
    plt = _pyplot()
    mapped = [t for t in report.tensors if t.ratio_map]
    if not mapped:
        return None
    cols = min(3, len(mapped))
    rows = -(-len(mapped) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols + 1, 4.3 * rows), constrained_layout=True,
                             squeeze=False)
    for ax in axes.flat[len(mapped):]:
        ax.axis("off")
    logs = [np.log10(np.maximum(np.nan_to_num(np.asarray(t.ratio_map, dtype=float), posinf=1e30), 1e-6))
            for t in mapped]
    top = max(1.0, max(float(v.max()) for v in logs))  # one colour scale for every panel
    image = None
    for ax, t, values in zip(axes.flat, mapped, logs):
        image = ax.imshow(values, aspect="auto", cmap="magma", vmin=-3, vmax=top, interpolation="nearest")
        per_row, per_col = t.ratio_map_cell or [1, 1]
        vector = len(t.shape) <= 1  # one row of cells: the elements in order
        _cell_ticks(ax.xaxis, values.shape[1], per_col)
        if vector:
            ax.set_yticks([])
        else:
            _cell_ticks(ax.yaxis, values.shape[0], per_row)
        colour = FLAGGED_COLOUR if t.flagged else SUSPICIOUS_COLOUR if t.verdict == "suspicious" else "black"
        words = f"\n{t.cause.words}" if t.cause is not None and t.cause.words else ""
        ax.set_title(f"{t.name}: {t.label}{words}", color=colour, fontsize=11)
        ax.set_xlabel("element" if vector else "column")
        ax.set_ylabel("" if vector else "row")
    from matplotlib.ticker import FuncFormatter

    bar = fig.colorbar(image, ax=list(axes.flat[:len(mapped)]), extend="min", label="log10(|mode − E| / bound)")
    # the darkest colour holds everything at 10⁻³ of the bound or below, exact elements too
    bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: "≤ −3 or exact" if v <= -3 else f"{v:g}".replace("-", "−")))
    fig.suptitle(f"{report.case}, {report.framework}, N = {report.accum_steps}: where the worst ratios sit "
                 "(above 0 = beyond the bound)")
    return fig


def _cell_ticks(axis: Any, cells: int, per_cell: int) -> None:
    """Ticks in the tensor's own indices: cell i covers indices i·per_cell onwards, so index v
    sits at v / per_cell − ½ on the cells' axis."""
    from matplotlib.ticker import MaxNLocator

    if per_cell == 1:
        axis.set_major_locator(MaxNLocator(integer=True, nbins=min(cells, 8)))
        return
    size = cells * per_cell
    picks = [int(v) for v in MaxNLocator(integer=True, nbins=6, steps=[1, 2, 5, 10]).tick_values(0, size)
             if 0 <= v <= size]
    axis.set_ticks([v / per_cell - 0.5 for v in picks], [f"{v:,}" for v in picks])


def growth(reports: Sequence[Report]) -> Any:
    """Error against E, worst tensor of each kind, in units of u·S, against N (log-log), with the
    bound (N − 1) and the typical √N growth. An N with no error at all (N = 1) is said in words,
    not drawn."""
    reports = shown(list(reports))
    plt = _pyplot()
    from matplotlib.ticker import NullFormatter, NullLocator

    fig, ax = plt.subplots(figsize=(10, 6), constrained_layout=True)
    steps = [r.accum_steps for r in reports]
    rows = growth_rows(reports)
    for kind, colour in KIND_COLOURS.items():
        native = [row["kinds"].get(kind, {}).get("native") for row in rows]
        manual = [row["kinds"].get(kind, {}).get("manual") for row in rows]
        if any(v for v in native if v):
            ax.plot(steps, [v or np.nan for v in native], "o-", color=colour, label=f"{kind}: native")
        if any(v for v in manual if v):
            ax.plot(steps, [v or np.nan for v in manual], "s--", color=colour, alpha=0.6, label=f"{kind}: manual")
    bounded = [(row["N"], row["bound"]) for row in rows if row["bound"] > 0]  # N = 1 is exact: no bound
    if bounded:
        ax.plot(*zip(*bounded), color="black", linewidth=2, label="bound γ(N−1)/u ≈ N − 1")
    grid = np.array(sorted(set(steps)), dtype=float)
    ax.plot(grid, np.sqrt(grid), color="grey", linewidth=1.5, linestyle=":", label="typical growth √N")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted(set(steps)), [str(n) for n in sorted(set(steps))])  # the N that ran, as numbers
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())
    exact = []  # what had no error at all: a zero has no place on the log scale, so it is said in words
    for row in rows:
        kinds = [k for k, entry in row["kinds"].items() if not entry.get("native") and not entry.get("manual")]
        if kinds:
            exact.append(f"N = {row['N']}" if len(kinds) == len(row["kinds"]) else f"{', '.join(kinds)} at N = {row['N']}")
    if exact:
        ax.text(1.02, 0.0, "exact (no error), not drawn:\n" + "\n".join(exact), ha="left", va="bottom",
                transform=ax.transAxes, fontsize=9, color="#444444")  # under the legend, off the lines
    ax.set_xlabel("accumulation steps N")
    ax.set_ylabel("worst |mode − E| / (u·S)   (u: unit round-off)")
    first = reports[0]
    ax.set_title(f"{first.case}, {first.framework}: error growth with N")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)  # beside the lines, never over them
    return fig


def figures(report: Report) -> dict[str, Any]:
    """The pictures of one report, by name."""
    out = {"scatter": scatter(report)}
    maps = heatmaps(report)
    if maps is not None:
        out["heatmaps"] = maps
    return out


def save(figs: dict[str, Any], folder: str | Path, stem: str) -> list[Path]:
    """Write each figure as PNG and SVG into ``folder`` (``stem`` made a safe file name: it may
    come from a case file); returns the paths written."""
    plt = _pyplot()
    stem = safe_file_name(stem)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in figs.items():
        for ext in ("png", "svg"):
            path = folder / f"{stem}-{name}.{ext}"
            check_replaceable(path)
            fig.savefig(path, dpi=120)
            written.append(path)
        plt.close(fig)
    return written


def png_bytes(fig: Any) -> bytes:
    plt = _pyplot()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def trajectory(report: TrajectoryReport) -> Any:
    """Loss curves of each mode; each tensor kind's largest parameter difference from manual, native's
    (solid) and the control's (dashed); and native's over the control's band (the control's
    difference, or one float32 ulp where wider) against the margin, the region below it shaded: the
    verdict. A report from before the control draws native's difference in float32 ulps against
    the one-ulp band instead. Steps are counted from 0, as the table and the summary count them. A
    step where native and manual parameters are identical is marked on a row of its own,
    "identical", below the log scales (a zero has no place on them); the steps after a loss or
    parameter went inf or nan are shaded."""
    report = shown(report)
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator, ScalarFormatter

    steps = list(range(report.steps))
    controlled = report.margin is not None
    zeros = {kind: [k for k, v in zip(steps, values) if v == 0] for kind, values in report.band_ratio.items()}
    identical = any(zeros.values())
    heights = ([4, 4, 4] if controlled else [4, 4]) + ([1] if identical else [])
    fig, panels = plt.subplots(len(heights), 1, figsize=(8, (2.9 if controlled else 4) * len(heights) - 3 * identical
                                                         + 0.6 * identical),
                               sharex=True, constrained_layout=True, height_ratios=heights)
    top, bottom = panels[0], panels[len(heights) - 1 - identical]
    alone = "native" not in report.losses  # native and the control fed manual's micro-gradients: its training
    for mode, style in (("native", "-"), ("manual", "-" if alone else "--"), ("control", "-."), ("float64", ":")):
        if mode in report.losses:
            top.plot(steps, report.losses[mode], style, linewidth=2,
                     label="manual: the training whose micro-gradients every mode takes" if alone and mode == "manual"
                     else mode)
    plain = ScalarFormatter(useOffset=False)  # the loss as it is, not "1e-7 + 6.9314e-1"
    plain.set_scientific(False)
    top.yaxis.set_major_formatter(plain)
    top.set_ylabel("mean micro-batch loss")
    top.set_title(f"{report.case}: {report.optimizer} lr {report.lr:g}, N = {report.accum_steps}"
                  + (f", injected {report.inject}" if report.inject else ""))
    top.legend(loc="best")
    top.grid(True, alpha=0.3)
    if controlled:
        _gaps(panels[1], report, steps)
        drawn = _judged(bottom, report, steps)
        bottom.set_ylabel("native's difference /\nthe control's band")
    else:
        drawn = False
        for kind, values in report.band_ratio.items():
            positive = [v if v > 0 else np.nan for v in values]  # a zero is drawn on the "identical" row
            drawn = drawn or any(v > 0 for v in values)
            bottom.plot(steps, positive, "o-", color=KIND_COLOURS.get(kind, "grey"), label=kind)
        bottom.axhline(1.0, color="black", linewidth=1.5, linestyle="--", label="round-off band (1 float32 ulp)")
        bottom.set_ylabel("max |θ native − θ manual| / ulp(max |θ|)")
    bottom.set_yscale("log")
    for ax in panels[1:len(panels) - identical]:
        _powers(ax)
    if not drawn and identical:  # nothing above zero: say so, rather than leave the panel blank
        compared = " compared" if report.non_finite else ""
        bottom.text(0.5, 0.3, f"native and manual parameters identical at every step{compared}", ha="center",
                    transform=bottom.transAxes, color="#444444")
    bottom.grid(True, alpha=0.3)
    if identical:
        row = panels[-1]
        kinds = list(report.band_ratio)
        for i, kind in enumerate(kinds):  # each kind a little apart, so that none hides another
            offset = (i - (len(kinds) - 1) / 2) * 0.25
            row.plot(zeros[kind], [offset] * len(zeros[kind]), "o", color=KIND_COLOURS.get(kind, "grey"))
        row.set_ylim(-0.6, 0.6)
        row.set_yticks([0], ["identical"])
        row.grid(True, axis="x", alpha=0.3)
    if report.non_finite:  # shaded from the first step that went inf or nan; named in the legend
        first = min(report.non_finite.values())
        for ax in panels:
            ax.axvspan(first - 0.5, report.steps - 0.5, color="grey", alpha=0.15, linewidth=0,
                       label="inf or nan: not compared" if ax is bottom else None)
    bottom.legend(loc="lower left", bbox_to_anchor=(0, 1.0), ncol=2 if controlled else 4, frameon=False, fontsize=9)
    last = panels[-1]
    last.xaxis.set_major_locator(MaxNLocator(integer=True))
    last.set_xlabel("optimizer step (counted from 0)")
    last.set_xlim(-0.5, max(report.steps - 0.5, 0.5))
    return fig


def _gaps(ax: Any, report: TrajectoryReport, steps: list[int]) -> None:
    """Each kind's largest parameter difference from manual: native's solid, the control's dashed."""
    for kind, values in report.max_diff.items():
        colour = KIND_COLOURS.get(kind, "grey")
        ax.plot(steps, [v if v > 0 else np.nan for v in values], "o-", color=colour, label=f"{kind}: native")
        ax.plot(steps, [v if v > 0 else np.nan for v in report.control_diff.get(kind, [])] or [np.nan] * len(steps),
                "--", color=colour, alpha=0.8, label=f"{kind}: control")
    ax.set_yscale("log")
    ax.set_ylabel("max |θ − θ manual|")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower left", bbox_to_anchor=(0, 1.0), ncol=4, frameon=False, fontsize=9,
              title="the control: manual's micro-batches summed last to first", title_fontsize=9, alignment="left")


def _powers(ax: Any) -> None:
    """A log axis ticked at powers of ten written as text (10⁻⁵): mathtext is off for names."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    digits = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")
    ax.yaxis.set_major_locator(LogLocator(base=10, numticks=8))
    ax.yaxis.set_major_formatter(FuncFormatter(
        lambda v, _: "1" if v == 1 else "10" + str(round(math.log10(v))).translate(digits) if v > 0 else ""))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _judged(ax: Any, report: TrajectoryReport, steps: list[int]) -> bool:
    """Native's difference over the control's band per kind, the margin and the region below it;
    whether anything above zero was drawn."""
    margin = report.margin or 1.0
    drawn = False
    for kind, values in report.control_ratio.items():
        drawn = drawn or any(v > 0 for v in values)
        ax.plot(steps, [v if v > 0 else np.nan for v in values], "o-", color=KIND_COLOURS.get(kind, "grey"), label=kind)
    ax.axhspan(0, margin, color="#2ca02c", alpha=0.08, linewidth=0,
               label=f"within {margin:g}× the control's band: as two valid orders differ")
    ax.axhline(margin, color="#8b0000", linewidth=1.5, linestyle="--", label=f"margin ({margin:g}×): flagged above")
    ax.axhline(1.0, color="black", linewidth=1, linestyle=":", label="the control's band")
    peak = max((v for values in report.control_ratio.values() for v in values if math.isfinite(v)), default=1.0)
    low = min((v for values in report.control_ratio.values() for v in values if math.isfinite(v) and v > 0),
              default=0.1)
    ax.set_ylim(min(low, 0.1) / 2, max(peak, margin) * 4)
    return drawn


def save_plot(report: TrajectoryReport, path: str | Path) -> Path:
    """Draw ``plot(report)`` into ``path`` (PNG)."""
    path = Path(path)
    check_replaceable(path)
    fig = trajectory(report)
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path

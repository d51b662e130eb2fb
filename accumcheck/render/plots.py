"""Pictures of a report (matplotlib, drawn off-screen): where each tensor sits against its bound,
where in a tensor the differences sit, and how errors grow with the number of micro-steps."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..files import check_replaceable, safe_file_name
from ..report import Report, TrajectoryReport, growth_rows

KIND_COLOURS = {"embedding": "#d62728", "weight": "#1f77b4", "bias": "#2ca02c", "norm": "#9467bd"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 11, "axes.titlesize": 12, "axes.labelsize": 11, "legend.fontsize": 9})
    return plt


def scatter(report: Report) -> Any:
    """Each tensor's worst element: its distance from E against its round-off bound, log-log.
    Above the diagonal cannot be round-off; flagged tensors are labelled."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 6), constrained_layout=True)
    points = [(t.bound_at_worst, t.ratio * t.bound_at_worst, t) for t in report.tensors
              if t.bound_at_worst > 0 and t.ratio > 0 and math.isfinite(t.ratio)]
    zero = [t for t in report.tensors if t.ratio == 0]
    for kind, colour in KIND_COLOURS.items():
        xs = [x for x, _, t in points if t.kind == kind]
        ys = [y for _, y, t in points if t.kind == kind]
        if xs:
            ax.scatter(xs, ys, s=36, c=colour, label=kind, alpha=0.8, edgecolors="none")
    if points:
        low = min(min(x, y) for x, y, _ in points) / 10
        high = max(max(x, y) for x, y, _ in points) * 10
        ax.plot([low, high], [low, high], color="black", linewidth=1, linestyle="--", label="error = bound")
        ax.fill_between([low, high], [low, high], [high, high], color="#d62728", alpha=0.06, label="not round-off")
        ax.set_xlim(low, high)
        ax.set_ylim(low, high)
        for x, y, t in points:
            if t.flagged:
                ax.annotate(t.name, (x, y), textcoords="offset points", xytext=(6, -12), fontsize=9, color="#8b0000")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("round-off bound at the worst element (gradient units)")
    ax.set_ylabel("|mode − E| at that element (gradient units)")
    extra = f"; {len(zero)} exact tensor(s) not drawn" if zero else ""
    ax.set_title(f"{report.case}, {report.framework}, N = {report.accum_steps}: error against bound{extra}")
    ax.grid(True, which="major", alpha=0.3)
    if points:  # every tensor exact: nothing drawn, nothing to label (matplotlib would warn on stderr)
        ax.legend(loc="upper left")
    return fig


def heatmaps(report: Report) -> Any | None:
    """Where in each mapped tensor the modes sit furthest from E, as log10(ratio to the bound);
    None when no tensor has a map."""
    plt = _pyplot()
    mapped = [t for t in report.tensors if t.ratio_map]
    if not mapped:
        return None
    cols = min(3, len(mapped))
    rows = -(-len(mapped) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4.3 * rows), constrained_layout=True, squeeze=False)
    for ax in axes.flat[len(mapped):]:
        ax.axis("off")
    from matplotlib.ticker import MaxNLocator

    logs = [np.log10(np.maximum(np.nan_to_num(np.asarray(t.ratio_map, dtype=float), posinf=1e30), 1e-6))
            for t in mapped]
    top = max(1.0, max(float(v.max()) for v in logs))  # one colour scale for every panel
    for ax, t, values in zip(axes.flat, mapped, logs):
        image = ax.imshow(values, aspect="auto", cmap="magma", vmin=-3, vmax=top, interpolation="nearest")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if values.shape[0] <= 8:  # a handful of rows: one tick each
            ax.set_yticks(range(values.shape[0]))
        per_row, per_col = t.ratio_map_cell or [1, 1]
        ax.set_title(f"{t.name} ({t.verdict})", color="#8b0000" if t.flagged else "black")
        ax.set_xlabel(f"columns (× {per_col} per cell)" if per_col > 1 else "columns")
        ax.set_ylabel(f"rows (× {per_row} per cell)" if per_row > 1 else "rows")
        fig.colorbar(image, ax=ax, label="log10(|mode − E| / bound)")
    fig.suptitle(f"{report.case}, {report.framework}, N = {report.accum_steps}: where the worst ratios sit "
                 "(above 0 = beyond the bound)")
    return fig


def growth(reports: Sequence[Report]) -> Any:
    """Error against E, worst tensor of each kind, in units of u·S, against N (log-log), with the
    bound (N − 1) and the typical √N growth."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 6), constrained_layout=True)
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
    ax.set_xlabel("accumulation steps N")
    ax.set_ylabel("worst |mode − E| / (u·S)   (u: unit round-off)")
    first = reports[0]
    ax.set_title(f"{first.case}, {first.framework}: error growth with N")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="upper left", ncol=2)
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
    """Loss curves of each mode, and each tensor kind's native/manual parameter difference in
    units of its round-off band (one float32 ulp), per step."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 8), constrained_layout=True, sharex=True)
    steps = list(range(report.steps))
    for mode, style in (("native", "-"), ("manual", "--"), ("float64", ":")):
        if mode in report.losses:
            top.plot(steps, report.losses[mode], style, linewidth=2, label=mode)
    top.set_ylabel("mean micro-batch loss")
    top.set_title(f"{report.case}: {report.optimizer} lr {report.lr:g}, N = {report.accum_steps}"
                  + (f", injected {report.inject}" if report.inject else ""))
    top.legend()
    top.grid(True, alpha=0.3)
    for kind, values in report.band_ratio.items():
        bottom.plot(steps, np.maximum(values, 1e-3), "o-", color=KIND_COLOURS.get(kind, "grey"), label=kind)
    bottom.axhline(1.0, color="black", linewidth=1.5, linestyle="--", label="round-off band (1 float32 ulp)")
    bottom.set_yscale("log")
    bottom.set_xlabel("optimizer step")
    bottom.set_ylabel("max |θ native − θ manual| / ulp(max |θ|)")
    bottom.legend(loc="upper left")
    bottom.grid(True, alpha=0.3)
    return fig


def save_plot(report: TrajectoryReport, path: str | Path) -> Path:
    """Draw ``plot(report)`` into ``path`` (PNG)."""
    path = Path(path)
    check_replaceable(path)
    fig = trajectory(report)
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path

"""``accumcheck train``: K optimizer steps with native and manual accumulation from the same start.

Per-step gradient differences that are pure round-off can still grow: Adam divides by the square
root of tiny second moments, so on ~1e-10 gradients a one-ulp difference becomes a difference in
the update itself (what apache/mxnet#16686 saw: 16 accumulation steps trained, 32 diverged).
This runs the case for K steps three ways — native (``.grad`` accumulating, with any injected
fault), manual (a float32 buffer), optionally the whole model in float64 — and records, per step,
each loss and each tensor's largest parameter difference between native and manual, against a
round-off band of one float32 ulp of the tensor's largest parameter. PyTorch only.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import AccumcheckError
from .report import _encode

OPTIMIZERS = ("adam", "sgd")


@dataclass
class TrajectoryReport:
    case: str
    optimizer: str
    lr: float
    accum_steps: int
    steps: int
    inject: str | None
    versions: dict[str, str]
    losses: dict[str, list[float]]  # mode -> loss per step
    max_diff: dict[str, list[float]]  # tensor kind -> max |native - manual| over its tensors, per step
    band_ratio: dict[str, list[float]]  # tensor kind -> that difference over the round-off band, per step
    first_out_of_band: dict[str, int]  # tensor -> first step whose difference left the band
    oracle_diff: dict[str, list[float]] = field(default_factory=dict)  # kind -> max |native - float64|
    kind: str = "trajectory"
    schema_version: int = 1

    @property
    def exit_code(self) -> int:
        """1 when some tensor left the round-off band, else 0."""
        return 1 if self.first_out_of_band else 0

    def to_json(self) -> str:
        return json.dumps(_encode(dataclasses.asdict(self)), indent=1, allow_nan=False) + "\n"

    def summary(self) -> str:
        if not self.first_out_of_band:
            return (f"native and manual stay within one float32 ulp of each other for all {self.steps} "
                    f"{self.optimizer} steps")
        first = min(self.first_out_of_band.values())
        names = [n for n, s in self.first_out_of_band.items() if s == first]
        return (f"LEFT THE ROUND-OFF BAND at step {first} ({', '.join(names[:4])}{' ...' if len(names) > 4 else ''}); "
                f"{len(self.first_out_of_band)} tensor(s) by step {self.steps - 1}")


def train(case: Any, steps: int = 20, optimizer: str = "adam", lr: float = 1e-3, accum_steps: int | None = None,
          seed: int | None = None, inject: str | None = None, oracle: bool = False, device: str = "cpu",
          progress: Any = None) -> TrajectoryReport:
    """Run ``steps`` optimizer steps of ``case`` natively and manually (and in float64 with
    ``oracle``). Raises AccumcheckError for bad input."""
    import torch

    from .api import _prepare
    from .backends.torch_backend import _inputs, accumulate, build_model, case_loss, deterministic, resolve_device

    if optimizer not in OPTIMIZERS:
        raise AccumcheckError(f"--optimizer: {optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    if not isinstance(steps, int) or steps < 1:
        raise AccumcheckError(f"--steps: {steps!r} is not a positive integer")
    if not (isinstance(lr, (int, float)) and lr > 0 and math.isfinite(lr)):
        raise AccumcheckError(f"--lr: {lr!r} is not a positive number")
    the_case, n, fault = _prepare(case, accum_steps, seed, inject)
    dev = resolve_device(device)
    weights = the_case.weights()
    kinds = {p.name: p.kind for p in the_case.parameters()}
    make = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}[optimizer]
    total = the_case.token_count(n) if the_case.loss_reduction == "token_count" else None

    def step_loss(model: Any, outer: int) -> Any:
        dtype = next(model.parameters()).dtype

        def run(micro: int) -> Any:
            batch = the_case.batch(outer * n + micro)
            labels = torch.from_numpy(batch.labels).to(dev)
            return case_loss(the_case, model(_inputs(batch.inputs, dev, dtype), batch.index), labels, total)
        return run

    losses: dict[str, list[float]] = {"native": [], "manual": []}
    diffs: dict[str, list[float]] = {k: [] for k in sorted(set(kinds.values()))}
    ratios: dict[str, list[float]] = {k: [] for k in diffs}
    oracle_diff: dict[str, list[float]] = {k: [] for k in diffs} if oracle else {}
    first_out: dict[str, int] = {}
    with deterministic(dev), torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        native = build_model(the_case, weights, torch.float32, dev)
        manual = build_model(the_case, weights, torch.float32, dev)
        twin = build_model(the_case, weights, torch.float64, dev) if oracle else None
        opt_native, opt_manual = make(native.parameters(), lr=lr), make(manual.parameters(), lr=lr)
        opt_twin = make(twin.parameters(), lr=lr) if twin is not None else None
        for k in range(steps):
            # An injected fault hits micro-step N//2 of every optimizer step.
            result = accumulate(native.canonical, step_loss(native, k), n, fault, None, "native")
            losses["native"].append(result["loss"])
            opt_native.step()
            losses["manual"].append(_manual_step(manual, step_loss(manual, k), n))
            opt_manual.step()
            if twin is not None:
                losses.setdefault("float64", []).append(
                    accumulate(twin.canonical, step_loss(twin, k), n, None, None, "float64")["loss"])
                opt_twin.step()
            per_kind: dict[str, float] = {}
            per_ratio: dict[str, float] = {}
            per_oracle: dict[str, float] = {}
            for name, p in native.canonical.items():
                a, b = p.detach().double(), manual.canonical[name].detach().double()
                diff = float((a - b).abs().max())
                band = float(np.spacing(np.float32(a.abs().max())))
                kind = kinds[name]
                per_kind[kind] = max(per_kind.get(kind, 0.0), diff)
                per_ratio[kind] = max(per_ratio.get(kind, 0.0), diff / band if band else 0.0)
                if diff > band and name not in first_out:
                    first_out[name] = k
                if twin is not None:
                    gap = float((a - twin.canonical[name].detach()).abs().max())
                    per_oracle[kind] = max(per_oracle.get(kind, 0.0), gap)
            for kind in diffs:
                diffs[kind].append(per_kind.get(kind, 0.0))
                ratios[kind].append(per_ratio.get(kind, 0.0))
                if twin is not None:
                    oracle_diff[kind].append(per_oracle.get(kind, 0.0))
            if progress is not None:
                progress("train", k + 1, steps)
    versions = {"torch": torch.__version__}
    return TrajectoryReport(case=the_case.name, optimizer=optimizer, lr=lr, accum_steps=n, steps=steps,
                            inject=None if fault is None else str(fault), versions=versions, losses=losses,
                            max_diff=diffs, band_ratio=ratios, first_out_of_band=first_out, oracle_diff=oracle_diff)


def _manual_step(model: Any, step_loss: Any, accum_steps: int) -> float:
    """zero_grad each micro-step, add into a float32 buffer, hand the sum to the optimizer."""
    import torch

    params = list(model.canonical.values())
    buffers = [torch.zeros_like(p) for p in params]
    total = 0.0
    for micro in range(accum_steps):
        for p in params:
            p.grad = None
        loss = step_loss(micro)
        loss.backward()
        total += float(loss.detach())
        for buf, p in zip(buffers, params):
            if p.grad is not None:
                buf.add_(p.grad)
    for buf, p in zip(buffers, params):
        p.grad = buf
    return total / accum_steps


def plot(report: TrajectoryReport) -> Any:
    """Loss curves of each mode, and each tensor kind's native/manual parameter difference in
    units of its round-off band (one float32 ulp), per step."""
    from .plots import KIND_COLOURS, _pyplot

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
    from .plots import _pyplot

    path = Path(path)
    fig = plot(report)
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path

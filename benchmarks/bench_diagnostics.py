"""Cost of the gradient diagnostics in a training step, as ratios from one run (CPU or GPU).

A small transformer (the divergence example's 2-layer encoder, widened) trains with AdamW;
one step is forward + backward + clipping + optimizer step. Variants of the clipping part:

  plain       torch.nn.utils.clip_grad_norm_(params, 1.0)
  monitor     GradMonitor.clip_grad_norm_(1.0), default logging (every 100 steps)
  monitor+    the same with per-layer statistics computed and logged every step (the default
              layers 0, 1, n//2, -2, -1 of the encoder's blocks)
  lightning   clip_grad_norm_ plus every parameter's norm copied to the host (Lightning's grad_norm)
  icefall     clip_grad_norm_ plus the total norm read with .item() every step (ScaledAdam)

Each variant runs the same seeded steps; the timings are interleaved and the median of --reps is
taken. Aim: monitor / plain and monitor+ / plain <= 1.03. On a CPU a host copy is cheap, so
lightning and icefall show their Python and copying cost there, not the device synchronisation
they cost on a GPU (--device cuda, where each variant's time ends with a synchronisation).

Every run writes its figures to benchmarks/results/bench_diagnostics.json (or --json FILE);
``figures`` renders from that file the text docs/performance.md quotes. Importing this module
runs nothing and imports no framework.

    python benchmarks/bench_diagnostics.py [--steps 30] [--reps 7] [--device cuda] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

VOCAB, WIDTH, LAYERS = 512, 128, 4
STEPS, REPS = 30, 7  # the defaults of --steps and --reps
AIM = 1.03  # the most the monitor may cost, as a ratio over plain clipping
VARIANTS = ("plain", "monitor", "monitor+", "lightning", "icefall")
RESULT = Path(__file__).resolve().parent / "results" / "bench_diagnostics.json"


def make_model(device: str = "cpu"):
    import torch

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(WIDTH, nhead=4, dim_feedforward=512, dropout=0.0, batch_first=True)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, WIDTH),
                               torch.nn.TransformerEncoder(layer, num_layers=LAYERS, enable_nested_tensor=False),
                               torch.nn.Linear(WIDTH, VOCAB)).to(device)


class NullWriter:
    def add_scalar(self, tag: str, value: float, step: int) -> None:
        pass


def run(variant: str, steps: int, device: str = "cpu") -> float:
    import torch
    from accumcheck.diagnostics.torch import GradMonitor

    model = make_model(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = list(model.parameters())
    named = list(model.named_parameters())
    monitor = None
    if variant == "monitor":
        monitor = GradMonitor(model)
    elif variant == "monitor+":
        monitor = GradMonitor(model, writer=NullWriter(), log_every=1)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (8, 32), generator=gen).to(device) for _ in range(steps)]
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    sync()
    started = time.perf_counter()
    for tokens in batches:
        loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), tokens.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        if monitor is not None:
            monitor.clip_grad_norm_(1.0)
        else:
            total = torch.nn.utils.clip_grad_norm_(params, 1.0)
            if variant == "lightning":
                {f"grad_2.0_norm/{n}": p.grad.norm(2).item() for n, p in named}
            elif variant == "icefall":
                total.item()
        optimizer.step()
    sync()
    return time.perf_counter() - started


def model_figures() -> dict:
    """The model's size, and what monitor+ computes each step: its layers and min/max passes."""
    from accumcheck.diagnostics.torch import GradMonitor

    model = make_model()
    monitor = GradMonitor(model)
    return {"encoder_layers": LAYERS, "parameter_tensors": len(list(model.parameters())),
            "values": sum(p.numel() for p in model.parameters()), "monitored_layers": len(monitor.layers),
            "minmax_passes": len({i for indices in monitor.layers.values() for i in indices})}


def machine(device: str) -> dict:
    import torch
    from machine_info import cpu_model  # benchmarks/ is the script's folder

    model = cpu_model()
    return {"cpu": model, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(device) if device != "cpu" else None}


# ----------------------------------------------------------------------------- the docs' text


def command(result: dict) -> str:
    flags = ([f"--steps {result['steps']}"] if result["steps"] != STEPS else []) + [f"--reps {result['reps']}"] + (
        [f"--device {result['device']}"] if result.get("device", "cpu") != "cpu" else [])
    return "`" + " ".join(["python benchmarks/bench_diagnostics.py", *flags]) + "`"


def table(result: dict) -> str:
    """docs/performance.md's table: each variant's ratio over plain clipping, and the aims."""
    v, model, aim_ = result["variants"], result["model"], result.get("aim", AIM)

    def aim(variant: str, why: str = "") -> str:
        missed = round(v[variant]["ratio"], 3) > aim_  # as the reader sees the ratio
        return f"≤ {aim_:g}" + (f" — missed{f' ({why})' if why else ''}" if missed else "")

    rows = [
        ("`GradMonitor.clip_grad_norm_`, statistics logged every 100 steps", v["monitor"]["ratio"], aim("monitor")),
        (f"the same with per-layer statistics (norm, min, max, share of {model['monitored_layers']} layers) computed "
         "and logged every step", v["monitor+"]["ratio"],
         aim("monitor+", f"{model['minmax_passes']} min/max passes per step")),
        ("Lightning-style: every parameter's norm copied to the host each step", v["lightning"]["ratio"], ""),
        ("icefall-style: the total norm read with `.item()` each step", v["icefall"]["ratio"], ""),
    ]
    lines = ["| per training step, over plain `clip_grad_norm_` | ratio | aim |", "|---|---|---|"]
    lines += [f"| {what} | {ratio:.3f} | {aim_text} |".replace("|  |", "| |") for what, ratio, aim_text in rows]
    return "\n" + "\n".join(lines) + "\n"


def figures(result: dict) -> dict[str, str]:
    """The text docs/performance.md quotes from a run (the JSON this script writes), by name:
    ``command`` (the command line, as code), ``model`` (its layers, tensors and values),
    ``plain-step`` (the time of a step with plain clipping) and ``table``."""
    model = result["model"]
    return {"command": command(result),
            "model": f"{model['encoder_layers']}-layer transformer encoder, {model['parameter_tensors']} parameter "
                     f"tensors, {model['values'] / 1000:.0f}k values",
            "plain-step": f"{result['variants']['plain']['ms_per_step']:.1f} ms",
            "table": table(result)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--reps", type=int, default=REPS)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", default=str(RESULT),
                        help="where to write the figures as JSON (default: benchmarks/results/bench_diagnostics.json)")
    args = parser.parse_args()
    for variant in VARIANTS:
        run(variant, 3, args.device)  # warm up
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.reps):
        for variant in VARIANTS:
            times[variant].append(run(variant, args.steps, args.device))
    median = {v: statistics.median(t) for v, t in times.items()}
    info, model = machine(args.device), model_figures()
    where = info["gpu"] or f"{info['torch_threads']} threads"
    print(f"torch {info['torch']}, {where}; {model['parameter_tensors']} parameter tensors, {model['values']:,} "
          f"values; {args.steps} steps, median of {args.reps}")
    print(f"{'variant':<11} {'ms/step':>8} {'ratio':>7}")
    variants = {}
    for v in VARIANTS:
        ratio = median[v] / median["plain"]
        variants[v] = {"median_s": median[v], "ms_per_step": median[v] / args.steps * 1e3, "ratio": ratio}
        mark = f"  aim <= {AIM:g}: " + ("PASS" if ratio <= AIM else "MISS") if v in ("monitor", "monitor+") else ""
        print(f"{v:<11} {variants[v]['ms_per_step']:8.2f} {ratio:7.3f}{mark}")
    result = {"machine": info, "device": args.device, "steps": args.steps, "reps": args.reps, "model": model,
              "variants": variants, "aim": AIM}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cost of the gradient diagnostics in a training step, as ratios from one run (CPU or GPU).

A small transformer (the divergence example's 2-layer encoder, widened) trains with AdamW; one
step is forward + backward + clipping + optimizer step. Variants of the clipping part:

  plain       torch.nn.utils.clip_grad_norm_(params, 1.0)
  monitor     GradMonitor.clip_grad_norm_(1.0), default logging (every 100 steps)
  monitor+    the same with per-layer statistics computed and logged every step (5 layers)
  lightning   clip_grad_norm_ plus every parameter's norm copied to the host (Lightning's grad_norm)
  icefall     clip_grad_norm_ plus the total norm read with .item() every step (ScaledAdam)

Each variant runs the same seeded steps; the timings are interleaved and the median of --reps is
taken. Aim: monitor+ / plain <= 1.03. On a CPU a host copy is cheap, so lightning and icefall
show their Python and copying cost there, not the device synchronisation they cost on a GPU
(--device cuda, where each variant's time ends with a synchronisation).

    python benchmarks/bench_diagnostics.py [--steps 30] [--reps 7] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from accumcheck.diagnostics.torch import GradMonitor

VOCAB, WIDTH = 512, 128


def make_model(device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(WIDTH, nhead=4, dim_feedforward=512, dropout=0.0, batch_first=True)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, WIDTH),
                               torch.nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False),
                               torch.nn.Linear(WIDTH, VOCAB)).to(device)


class NullWriter:
    def add_scalar(self, tag: str, value: float, step: int) -> None:
        pass


def run(variant: str, steps: int, device: str = "cpu") -> float:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    args = parser.parse_args()
    variants = ("plain", "monitor", "monitor+", "lightning", "icefall")
    for variant in variants:
        run(variant, 3, args.device)  # warm up
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.reps):
        for variant in variants:
            times[variant].append(run(variant, args.steps, args.device))
    median = {v: statistics.median(t) for v, t in times.items()}
    params = sum(p.numel() for p in make_model().parameters())
    where = torch.cuda.get_device_name(args.device) if args.device != "cpu" else f"{torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}; {len(list(make_model().parameters()))} "
          f"parameter tensors, {params:,} values; {args.steps} steps, median of {args.reps}")
    print(f"{'variant':<11} {'ms/step':>8} {'ratio':>7}")
    for v in variants:
        ratio = median[v] / median["plain"]
        mark = ("  aim <= 1.03: " + ("PASS" if ratio <= 1.03 else "MISS")) if v == "monitor+" else ""
        print(f"{v:<11} {median[v] / args.steps * 1e3:8.2f} {ratio:7.3f}{mark}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

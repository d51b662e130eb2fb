"""Cost of the gradient diagnostics in a training step, as ratios from one run (CPU or GPU).

A small transformer (the divergence example's 2-layer encoder, widened) trains with AdamW;
one step is forward + backward + clipping + optimizer step. Variants of the clipping part:

  plain       torch.nn.utils.clip_grad_norm_(params, 1.0)
  every-100   GradMonitor.clip_grad_norm_(1.0) with a real torch.utils.tensorboard.SummaryWriter
              (in a temporary folder) and the default log_every=100: per-layer statistics
              computed and written at one step in 100, the dominance check at every step
  every-step  the same with log_every=1: per-layer statistics (norm, min, max, abs-max, share
              of the default layers 0, 1, n//2, -2, -1 of the encoder's blocks) computed and
              written to the SummaryWriter at every step
  lightning   clip_grad_norm_ plus every parameter's norm copied to the host (Lightning's grad_norm)
  icefall     clip_grad_norm_ plus the total norm read with .item() every step (ScaledAdam)

Each variant keeps one model, optimizer, writer and monitor for the whole run. A round gives
every variant --steps steps (default 100, so every-100 writes once per round, at its real rate)
in chunks of --chunk steps, the variants taking turns chunk by chunk (the order rotating), so a
burst of load elsewhere on the machine falls on all of them alike; each variant's round ends
with the monitor's flush, which waits for the writer's queue, so the writer's own thread works
inside the time. A variant's ratio is the median over --reps rounds of its round time over
plain's in the same round. Aim: every-100 / plain and every-step / plain <= 1.03. On a CPU a
host copy is cheap, so lightning and icefall show their Python and copying cost there, not the
device synchronisation they cost on a GPU (--device cuda, where each chunk's time ends with a
synchronisation). The load average is recorded before and after: other processes on the
machine move the ratios.

Every run writes its figures to benchmarks/results/bench_diagnostics.json (or --json FILE);
``figures`` renders from that file the text docs/performance.md quotes. Importing this module
runs nothing and imports no framework.

    python benchmarks/bench_diagnostics.py [--steps 100] [--chunk 10] [--reps 9] [--device cuda] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

VOCAB, WIDTH, LAYERS = 512, 128, 4
STEPS, CHUNK, REPS = 100, 10, 9  # the defaults of --steps, --chunk and --reps
AIM = 1.03  # the most the monitor may cost, as a ratio over plain clipping
VARIANTS = ("plain", "every-100", "every-step", "lightning", "icefall")
LOG_EVERY = {"every-100": 100, "every-step": 1}
RESULT = Path(__file__).resolve().parent / "results" / "bench_diagnostics.json"


def make_model(device: str = "cpu"):
    import torch

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(WIDTH, nhead=4, dim_feedforward=512, dropout=0.0, batch_first=True)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, WIDTH),
                               torch.nn.TransformerEncoder(layer, num_layers=LAYERS, enable_nested_tensor=False),
                               torch.nn.Linear(WIDTH, VOCAB)).to(device)


class Trainer:
    """One variant's training loop: its own model, optimizer, data, writer (in a temporary folder)
    and monitor, kept from chunk to chunk."""

    def __init__(self, variant: str, device: str = "cpu") -> None:
        import torch
        from torch.utils.tensorboard import SummaryWriter

        from accumcheck.torch import GradMonitor

        self.torch, self.variant, self.device = torch, variant, device
        self.model = make_model(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.params = list(self.model.parameters())
        self.named = list(self.model.named_parameters())
        self.logdir = tempfile.TemporaryDirectory()
        self.writer = SummaryWriter(self.logdir.name) if variant in LOG_EVERY else None
        self.monitor = (GradMonitor(self.model, writer=self.writer, log_every=LOG_EVERY[variant])
                        if self.writer else None)
        gen = torch.Generator().manual_seed(1)
        self.batches = [torch.randint(0, VOCAB, (8, 32), generator=gen).to(device) for _ in range(STEPS)]
        self.done = 0

    def steps(self, n: int, flush: bool = False) -> float:
        """Seconds for the next ``n`` steps (and the monitor's flush after them, with ``flush``)."""
        torch = self.torch
        batches = [self.batches[(self.done + k) % len(self.batches)] for k in range(n)]
        self.done += n
        sync = torch.cuda.synchronize if self.device != "cpu" else (lambda: None)
        sync()
        started = time.perf_counter()
        for tokens in batches:
            loss = torch.nn.functional.cross_entropy(self.model(tokens).reshape(-1, VOCAB), tokens.reshape(-1))
            self.optimizer.zero_grad()
            loss.backward()
            if self.monitor is not None:
                self.monitor.clip_grad_norm_(1.0)
            else:
                total = torch.nn.utils.clip_grad_norm_(self.params, 1.0)
                if self.variant == "lightning":
                    {f"grad_2.0_norm/{n}": p.grad.norm(2).item() for n, p in self.named}
                elif self.variant == "icefall":
                    total.item()
            self.optimizer.step()
        if flush and self.monitor is not None:
            self.monitor.flush()
        sync()
        return time.perf_counter() - started

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.logdir.cleanup()


def rounds(reps: int, steps: int, chunk: int, device: str = "cpu") -> dict[str, list[float]]:
    """Each variant's time for ``steps`` steps in each of ``reps`` rounds, the variants taking
    turns every ``chunk`` steps."""
    from interleaved import rounds as interleaved  # benchmarks/ is the script's folder

    return interleaved({v: Trainer(v, device) for v in VARIANTS}, reps, steps, chunk)


def model_figures() -> dict:
    """The model's size, and what every-step computes and writes each step: its layers, the
    gradient tensors (and values) its min/max pass reads, and the scalars it writes."""
    from accumcheck.torch import GradMonitor

    model = make_model()
    monitor = GradMonitor(model)
    params = list(model.parameters())
    watched = sorted({i for indices in monitor.layers.values() for i in indices})
    return {"encoder_layers": LAYERS, "parameter_tensors": len(params), "values": sum(p.numel() for p in params),
            "monitored_layers": len(monitor.layers), "minmax_tensors": len(watched),
            "minmax_values": sum(params[i].numel() for i in watched), "scalars_per_step": len(monitor.tags)}


def machine(device: str) -> dict:
    import torch
    from machine_info import cpu_model  # benchmarks/ is the script's folder

    model = cpu_model()
    return {"cpu": model, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(device) if device != "cpu" else None}



# ----------------------------------------------------------------------------- the docs' text


def command(result: dict) -> str:
    flags = ([f"--steps {result['steps']}"] if result["steps"] != STEPS else []) + (
        [f"--chunk {result['chunk']}"] if result.get("chunk", CHUNK) != CHUNK else []) + (
        [f"--reps {result['reps']}"]) + ([f"--device {result['device']}"] if result.get("device", "cpu") != "cpu" else [])
    return "`" + " ".join(["python benchmarks/bench_diagnostics.py", *flags]) + "`"


def where(result: dict) -> str:
    """The machine, as the text quotes it."""
    from machine_info import cpu_family  # benchmarks/ is the script's folder

    info = result["machine"]
    text = f"on a {info['cores']}-core {cpu_family(info['cpu'])} machine" + (f" with an {info['gpu']}" if info["gpu"] else "")
    text += f" (torch {info['torch']}, {info['torch_threads']} threads"
    loads = result.get("load") or {}
    if loads.get("before") is not None:
        text += f"; load average {loads['before']:.2f} before the run, {loads['after']:.2f} after"
    return text + ")"


def table(result: dict) -> str:
    """docs/performance.md's table: each variant's ratio over plain clipping, and the aims."""
    v, model, aim_ = result["variants"], result["model"], result.get("aim", AIM)

    def aim(variant: str) -> str:
        missed = round(v[variant]["ratio"], 3) > aim_  # as the reader sees the ratio
        return f"≤ {aim_:g}" + (" — missed" if missed else "")

    scalars = (f"{model['scalars_per_step']} scalars: norm, min, max, abs-max and share of "
               f"{model['monitored_layers']} layers")
    rows = [
        (f"`GradMonitor.clip_grad_norm_` with a TensorBoard `SummaryWriter`, log_every=100: per-layer statistics "
         f"({scalars}) computed and written every 100th step", v["every-100"]["ratio"], aim("every-100")),
        (f"the same with log_every=1: the statistics computed and written every step (min/max over "
         f"{model['minmax_tensors']} gradient tensors, {model['minmax_values'] / 1000:.0f}k values)",
         v["every-step"]["ratio"], aim("every-step")),
        ("Lightning-style: every parameter's norm copied to the host each step", v["lightning"]["ratio"], ""),
        ("icefall-style: the total norm read with `.item()` each step", v["icefall"]["ratio"], ""),
    ]
    lines = ["| per training step, over plain `clip_grad_norm_` | ratio | aim |", "|---|---|---|"]
    lines += [f"| {what} | {ratio:.3f} | {aim_text} |".replace("|  |", "| |") for what, ratio, aim_text in rows]
    return "\n" + "\n".join(lines) + "\n"


def figures(result: dict) -> dict[str, str]:
    """The text docs/performance.md quotes from a run (the JSON this script writes), by name:
    ``command`` (the command line, as code), ``machine`` (where it ran, and the load),
    ``model`` (its layers, tensors and values), ``plain-step`` (the time of a step with plain
    clipping), ``steps`` (a variant's steps in a round, and its turns) and ``table``."""
    model = result["model"]
    return {"command": command(result), "machine": where(result),
            "model": f"{model['encoder_layers']}-layer transformer encoder, {model['parameter_tensors']} parameter "
                     f"tensors, {model['values'] / 1000:.0f}k values",
            "plain-step": f"{result['variants']['plain']['ms_per_step']:.1f} ms",
            "steps": f"{result['steps']} steps, in turns of {result.get('chunk', CHUNK)}", "table": table(result)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS, help="steps per variant and round (default: %(default)s)")
    parser.add_argument("--chunk", type=int, default=CHUNK, help="steps per turn (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=REPS, help="rounds (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", default=str(RESULT),
                        help="where to write the figures as JSON (default: benchmarks/results/bench_diagnostics.json)")
    args = parser.parse_args()
    from machine_info import load  # benchmarks/ is the script's folder

    before = load()
    times = rounds(args.reps, args.steps, args.chunk, args.device)
    after = load()
    info, model = machine(args.device), model_figures()
    threads = f"{info['torch_threads']} threads"
    print(f"torch {info['torch']}, {info['gpu'] or threads}; "
          f"{model['parameter_tensors']} parameter tensors, {model['values']:,} values; {args.steps} steps a round "
          f"in turns of {args.chunk}, median of {args.reps} rounds; load average {before:.2f} before, "
          f"{after:.2f} after")
    from interleaved import summary  # benchmarks/ is the script's folder

    variants = summary({v: times[v] for v in VARIANTS}, args.steps, AIM, tuple(LOG_EVERY))
    result = {"machine": info, "device": args.device, "steps": args.steps, "chunk": args.chunk, "reps": args.reps,
              "model": model,
              "load": {"before": before, "after": after}, "variants": variants, "aim": AIM}
    from machine_info import write_result  # benchmarks/ is the script's folder

    return write_result(args.json, result)


if __name__ == "__main__":
    sys.exit(main())

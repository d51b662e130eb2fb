"""Cost of Gluon's GradMonitor in a training step, as ratios from one interleaved run (CPU).

A small Gluon model (an embedding, 4 blocks of two Dense layers and a LayerNorm, a head; hybridized)
trains with Adam; one step is forward + backward + clipping + trainer.step, its time ending with
mx.nd.waitall() so that the engine's work is inside it. Variants of the clipping part:

  plain       gluon.utils.clip_global_norm(grads, 1.0, check_isfinite=False) (Gluon's clipping,
              without its default wait for the norm)
  every-100   GradMonitor.clip_global_norm(1.0) writing to a TensorBoard event file (a log
              directory in a temporary folder) with the default log_every=100: per-layer
              statistics computed and written at one step in 100, the dominance check at every step
  every-step  the same with log_every=1: the statistics computed and written at every step

Each variant keeps one model, trainer and monitor for the whole run. A round gives every variant
--steps steps in turns of --chunk steps (the order rotating), so a burst of load elsewhere falls
on all of them alike; each monitor's round ends with its flush, so the writing is inside the time.
A variant's ratio is the median over --reps rounds of its round time over plain's in the same
round. Aim: <= 1.03. The load average is recorded before and after the run.

Every run writes its figures to benchmarks/results/bench_diagnostics_mxnet.json (or --json FILE);
``figures`` renders from that file the text docs/diagnostics.md quotes. Importing
this module runs nothing and imports no framework.

    python benchmarks/bench_diagnostics_mxnet.py [--steps 100] [--chunk 10] [--reps 9] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

VOCAB, WIDTH, HIDDEN, BLOCKS = 512, 128, 512, 4
STEPS, CHUNK, REPS = 100, 10, 9  # the defaults of --steps, --chunk and --reps
AIM = 1.03  # the most the monitor may cost, as a ratio over plain clipping
VARIANTS = ("plain", "every-100", "every-step")
LOG_EVERY = {"every-100": 100, "every-step": 1}
RESULT = Path(__file__).resolve().parent / "results" / "bench_diagnostics_mxnet.json"


def make_net():
    import mxnet as mx
    from mxnet import gluon

    mx.random.seed(0)
    net = gluon.nn.HybridSequential(prefix="")
    net.add(gluon.nn.Embedding(VOCAB, WIDTH, prefix="embed."))
    for i in range(BLOCKS):
        block = gluon.nn.HybridSequential(prefix=f"blocks.{i}.")
        with block.name_scope():
            block.add(gluon.nn.Dense(HIDDEN, in_units=WIDTH, activation="relu", flatten=False, prefix="up."),
                      gluon.nn.Dense(WIDTH, in_units=HIDDEN, flatten=False, prefix="down."),
                      gluon.nn.LayerNorm(in_channels=WIDTH, prefix="norm."))
        net.add(block)
    net.add(gluon.nn.Dense(VOCAB, in_units=WIDTH, flatten=False, prefix="head."))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    return net


class Trainer:
    """One variant's training loop: its own net, trainer, data and monitor (writing into a
    temporary folder), kept from chunk to chunk."""

    def __init__(self, variant: str) -> None:
        import mxnet as mx
        from mxnet import gluon

        from accumcheck.mxnet import GradMonitor

        self.mx, self.gluon, self.variant = mx, gluon, variant
        self.net = make_net()
        self.trainer = gluon.Trainer(self.net.collect_params(), "adam", {"learning_rate": 1e-4})
        self.grads = [p.grad() for p in self.net.collect_params().values() if p.grad_req != "null"]
        self.loss = gluon.loss.SoftmaxCrossEntropyLoss()
        self.logdir = tempfile.TemporaryDirectory()
        self.monitor = (GradMonitor(self.net, writer=self.logdir.name, log_every=LOG_EVERY[variant])
                        if variant in LOG_EVERY else None)
        rng = __import__("numpy").random.RandomState(1)
        self.batches = [mx.nd.array(rng.randint(0, VOCAB, (8, 32))) for _ in range(STEPS)]
        self.done = 0

    def steps(self, n: int, flush: bool = False) -> float:
        """Seconds for the next ``n`` steps (and the monitor's flush after them, with ``flush``)."""
        mx = self.mx
        batches = [self.batches[(self.done + k) % len(self.batches)] for k in range(n)]
        self.done += n
        mx.nd.waitall()
        started = time.perf_counter()
        for tokens in batches:
            with mx.autograd.record():
                loss = self.loss(self.net(tokens).reshape((-1, VOCAB)), tokens.reshape((-1,))).mean()
            loss.backward()
            if self.monitor is not None:
                self.monitor.clip_global_norm(1.0)
            else:
                self.gluon.utils.clip_global_norm(self.grads, 1.0, check_isfinite=False)
            self.trainer.step(1)
        if flush and self.monitor is not None:
            self.monitor.flush()
        mx.nd.waitall()
        return time.perf_counter() - started

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
        self.logdir.cleanup()


def rounds(reps: int, steps: int, chunk: int) -> dict[str, list[float]]:
    """Each variant's time for ``steps`` steps in each of ``reps`` rounds, the variants taking
    turns every ``chunk`` steps."""
    from interleaved import rounds as interleaved  # benchmarks/ is the script's folder

    return interleaved({v: Trainer(v) for v in VARIANTS}, reps, steps, chunk)


def model_figures() -> dict:
    from accumcheck.mxnet import GradMonitor

    net = make_net()
    monitor = GradMonitor(net)
    params = [p for p in net.collect_params().values() if p.grad_req != "null"]
    return {"blocks": BLOCKS, "parameter_tensors": len(params), "values": sum(p.data().size for p in params),
            "monitored_layers": len(monitor.layers), "scalars_per_step": len(monitor.tags)}


def machine() -> dict:
    import mxnet as mx
    from machine_info import cpu_model  # benchmarks/ is the script's folder

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "mxnet": mx.__version__}



# ----------------------------------------------------------------------------- the docs' text


def command(result: dict) -> str:
    flags = ([f"--steps {result['steps']}"] if result["steps"] != STEPS else []) + (
        [f"--chunk {result['chunk']}"] if result["chunk"] != CHUNK else []) + [f"--reps {result['reps']}"]
    return "`" + " ".join(["python benchmarks/bench_diagnostics_mxnet.py", *flags]) + "`"


def where(result: dict) -> str:
    from machine_info import cpu_family  # benchmarks/ is the script's folder

    info, loads = result["machine"], result.get("load") or {}
    text = f"on a {info['cores']}-core {cpu_family(info['cpu'])} machine (mxnet {info['mxnet']}"
    if loads.get("before") is not None:
        text += f"; load average {loads['before']:.2f} before the run, {loads['after']:.2f} after"
    return text + ")"


def table(result: dict) -> str:
    v, model, aim_ = result["variants"], result["model"], result.get("aim", AIM)

    def aim(variant: str) -> str:
        return f"≤ {aim_:g}" + (" — missed" if round(v[variant]["ratio"], 3) > aim_ else "")

    scalars = (f"{model['scalars_per_step']} scalars: norm, min, max, abs-max and share of "
               f"{model['monitored_layers']} layers")
    rows = [(f"`GradMonitor.clip_global_norm` writing TensorBoard events, log_every=100: per-layer statistics "
             f"({scalars}) computed and written every 100th step", v["every-100"]["ratio"], aim("every-100")),
            ("the same with log_every=1: the statistics computed and written every step", v["every-step"]["ratio"],
             aim("every-step"))]
    lines = ["| per training step, over plain `gluon.utils.clip_global_norm` | ratio | aim |", "|---|---|---|"]
    lines += [f"| {what} | {ratio:.3f} | {aim_text} |" for what, ratio, aim_text in rows]
    return "\n" + "\n".join(lines) + "\n"


def figures(result: dict) -> dict[str, str]:
    """The text docs/diagnostics.md quotes from a run (the JSON this script
    writes), by name: ``command``, ``machine``, ``model``, ``plain-step`` (a step's time with
    plain clipping), ``steps`` (a variant's steps in a round, and its turns), ``table`` and
    ``summary`` (every-100's and every-step's ratios)."""
    model, v = result["model"], result["variants"]
    return {"command": command(result), "machine": where(result),
            "model": f"{model['blocks']} blocks, {model['parameter_tensors']} parameter tensors, "
                     f"{model['values'] / 1000:.0f}k values",
            "plain-step": f"{v['plain']['ms_per_step']:.1f} ms",
            "steps": f"{result['steps']} steps, in turns of {result['chunk']}", "table": table(result),
            "summary": f"{v['every-100']['ratio']:.2f}× Gluon's clipping, logging every 100 steps; "
                       f"{v['every-step']['ratio']:.2f}× every step"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS, help="steps per variant and round (default: %(default)s)")
    parser.add_argument("--chunk", type=int, default=CHUNK, help="steps per turn (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=REPS, help="rounds (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", default=str(RESULT),
                        help="where to write the figures as JSON (default: %(default)s)")
    args = parser.parse_args()
    from machine_info import load  # benchmarks/ is the script's folder

    before = load()
    times = rounds(args.reps, args.steps, args.chunk)
    after = load()
    info, model = machine(), model_figures()
    print(f"mxnet {info['mxnet']}; {model['parameter_tensors']} parameter tensors, {model['values']:,} values; "
          f"{args.steps} steps a round in turns of {args.chunk}, median of {args.reps} rounds; load average "
          f"{before:.2f} before, {after:.2f} after")
    from interleaved import summary  # benchmarks/ is the script's folder

    variants = summary({v: times[v] for v in VARIANTS}, args.steps, AIM, tuple(LOG_EVERY))
    result = {"machine": info, "steps": args.steps, "chunk": args.chunk, "reps": args.reps, "model": model,
              "load": {"before": before, "after": after}, "variants": variants, "aim": AIM}
    from machine_info import write_result  # benchmarks/ is the script's folder

    return write_result(args.json, result)


if __name__ == "__main__":
    sys.exit(main())

"""The stack check beside a real Trainer run: a Llama of about 100M parameters (built from a config,
random weights), the Hugging Face Trainer with gradient_accumulation_steps = 8 and AdamW, each run
in a fresh child process, the children interleaved round by round.

    plain      ``trainer.train()`` for S optimizer steps: the run the check is set beside
    check      ``accumcheck.integrations.transformers.check(trainer, steps=S)``: the float64 check
    budget     the same with ``memory_budget`` = a quarter of plain's peak memory (so the check may
               add at most 25 %): the reference in the model's own dtype, in groups of tensors
    wide       the same with twice that budget, half of plain's peak: fewer groups, each one pass
               over the window less (the trade of memory for time)
    sampled    ``with watch(trainer, every=K): trainer.train()`` for S_s optimizer steps
    plain_s    ``trainer.train()`` for the same S_s steps, beside it

Peak memory is each child's ``VmHWM`` (``/proc/self/status``; imports, model and data included, as
plain training holds them too); time is the child's training or check alone (imports and the model's
build apart). The ratios are each against plain in the same round (sampled against plain_s), their
median over the rounds.

The sampled check's cost at K = 100: a run of S_s steps judges step 0 (``one step in K``), so its
measured ratio is (S_s plain steps + one reference) / S_s. Two runs' steps differ by more than the
recording of a step costs, so the cost of one step in K judged is taken from the check's own time,
timed inside the run (``StackRecorder.own_seconds``: recording each micro-batch, capturing or
letting go each window): (K x plain's median step + (K - 1) x its median time on a step it lets go
+ its time on the judged step) / (K x plain's median step), as a run of K steps would pay it. The two
runs' median steps are reported beside it.

Aims: with a budget, peak memory <= 1.25 x plain and time <= 3 x plain; sampled at K = 100 <= 1.03.
Every run writes benchmarks/results/bench_stacks.json (or --json FILE); ``figures`` renders the
text docs/performance.md quotes. Importing this module runs nothing and imports no framework.

    python benchmarks/bench_stacks.py            # ~100M parameters, 2 rounds (~20 min on 2 cores)
    python benchmarks/bench_stacks.py --quick    # ~10M parameters, 1 round
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from machine_info import cpu_family, cpu_model, load, write_result  # benchmarks/ is the script's folder

RESULT = Path(__file__).resolve().parent / "results" / "bench_stacks.json"
SHARE = 0.25  # the budget: what the check may add to plain training's peak (--quick: 0.5, a small model's
# largest tensor needs more than a quarter of its run); ``wide`` twice that
EVERY = 100

CHILD = """
import json, sys, tempfile, time
import torch, transformers
from accumcheck.integrations.transformers import check, watch

shape, what, steps, budget = json.loads(sys.argv[1])
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                                  intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
                                  num_attention_heads=shape["heads"], num_key_value_heads=shape["heads"],
                                  max_position_embeddings=shape["length"], tie_word_embeddings=False)
model = transformers.LlamaForCausalLM(config)
gen = torch.Generator().manual_seed(1)
n = shape["length"]
data = []
for _ in range(shape["accum"] * shape["batch"] * steps):
    ids = torch.randint(1, shape["vocab"], (n,), generator=gen).tolist()
    data.append({"input_ids": ids, "attention_mask": [1] * n, "labels": [-100] + ids[1:]})

def collate(features):
    return {k: torch.tensor([f[k] for f in features]) for k in ("input_ids", "attention_mask", "labels")}

times = []
class Clock(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        times.append(time.perf_counter())
    def on_step_end(self, args, state, control, **kwargs):
        times[-1] = time.perf_counter() - times[-1]

with tempfile.TemporaryDirectory() as folder:
    args = transformers.TrainingArguments(
        output_dir=folder, per_device_train_batch_size=shape["batch"], gradient_accumulation_steps=shape["accum"],
        learning_rate=1e-4, optim="adamw_torch", max_steps=steps, report_to="none", logging_strategy="no",
        save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collate,
                                   callbacks=[Clock()])
    out = {}
    started = time.perf_counter()
    if what in ("plain", "plain_s"):
        trainer.train()
    elif what == "sampled":
        with watch(trainer, every=shape["every"]) as sampled:
            trainer.train()
        report, own = sampled.report, sampled.recorder.own_seconds
        out.update(exit_code=report.exit_code, judged=[s.step for s in report.steps],
                   own_let_go=[t for step, t in own.items() if step not in sampled.recorder.judged_why],
                   own_judged=[t for step, t in own.items() if step in sampled.recorder.judged_why])
    else:
        report = check(trainer, steps=steps, memory_budget=budget)
        from accumcheck.torch.stacks.owndtype import float64_need
        out["float64_need"] = float64_need(model, [trainer.optimizer])
        out.update(exit_code=report.exit_code, verdicts=[s.verdict for s in report.steps],
                   reference_dtype=report.reference_dtype, notes=[n for n in report.notes if "budget" in n])
    out["seconds"] = time.perf_counter() - started
out["steps"] = times
out["parameters"] = sum(p.numel() for p in model.parameters())
out["peak"] = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps(out))
"""


def child(shape: dict, what: str, steps: int, budget: int | None = None) -> dict:
    """One fresh child: the plain run, the check (with ``budget``), or the sampled run; its figures."""
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps([shape, what, steps, budget])],
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"the {what} child failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine() -> dict:
    import torch
    import transformers

    import accumcheck

    return {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "accumcheck": accumcheck.__version__, "load": load(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}


def measure(shape: dict, rounds: int, share: float) -> dict:
    order = ["plain", "check", "budget", "wide", "plain_s", "sampled"]
    runs: dict[str, list[dict]] = {name: [] for name in order}
    budgets: dict[str, int] = {}
    for r in range(rounds):
        names = order[r % len(order):] + order[:r % len(order)]
        if not budgets:  # the budgets come from plain's peak: plain runs first in the first round
            names = ["plain"] + [n for n in names if n != "plain"]
        for name in names:
            steps = shape["sampled_steps"] if name in ("plain_s", "sampled") else shape["steps"]
            if not budgets and runs["plain"]:
                budgets = {"budget": int(share * runs["plain"][0]["peak"]),
                           "wide": int(2 * share * runs["plain"][0]["peak"])}
            found = child(shape, "check" if name in budgets else name, steps, budgets.get(name))
            runs[name].append(found)
            print(f"  round {r + 1} {name:8s} {found['seconds']:8.1f} s  peak {found['peak'] / 2**30:6.2f} GiB"
                  f"{'  ' + str(found.get('verdicts') or found.get('judged') or '') }", flush=True)
    ratios = {}
    for name, base in (("check", "plain"), ("budget", "plain"), ("wide", "plain"), ("sampled", "plain_s")):
        ratios[name] = {
            "time": statistics.median(a["seconds"] / b["seconds"] for a, b in zip(runs[name], runs[base])),
            "peak": statistics.median(a["peak"] / b["peak"] for a, b in zip(runs[name], runs[base]))}
    k = shape["every"]
    plain_step = statistics.median(t for run in runs["plain_s"] for t in run["steps"][1:])
    unjudged = statistics.median(t for run in runs["sampled"] for t in run["steps"][1:])
    own_let_go = statistics.median(t for run in runs["sampled"] for t in run["own_let_go"])
    own_judged = statistics.median(t for run in runs["sampled"] for t in run["own_judged"])
    ratios["sampled"]["at_every"] = at_every(k, plain_step, own_let_go, own_judged)
    ratios["sampled"].update(plain_step=plain_step, unjudged_step=unjudged, own_let_go=own_let_go,
                             own_judged=own_judged)
    return {"budget": budgets["budget"], "wide_budget": budgets["wide"], "runs": runs, "ratios": ratios,
            "parameters": runs["plain"][0]["parameters"]}


def at_every(k: int, plain_step: float, own_let_go: float, own_judged: float) -> float:
    """What one step in ``k`` judged costs against plain training: ``k`` plain steps, the check's own
    time on each of the ``k - 1`` steps it lets go and on the one it judges (timed inside the run,
    ``StackRecorder.own_seconds``), over the ``k`` plain steps."""
    return (k * plain_step + (k - 1) * own_let_go + own_judged) / (k * plain_step)


def figures(result: dict) -> dict[str, str]:
    """The text docs/performance.md quotes from a run (the JSON this script writes): ``machine``,
    ``table`` and ``summary``."""
    m, info, shape = result["measured"], result["machine"], result["shape"]
    r = m["ratios"]
    gib = 2**30
    plain = m["runs"]["plain"][0]
    rows = ["| fresh child process | time | × plain | peak RSS | × plain | verdicts |", "|---|---:|---:|---:|---:|---|",
            f"| plain training, {shape['steps']} steps | {plain['seconds']:.1f} s | 1 | {plain['peak'] / gib:.2f} GiB | 1 "
            "| — |"]
    for name, words in (("check", "`check(trainer)`"),
                        ("budget", f"`check(trainer, memory_budget=...)`, {m['budget'] / gib:.2f} GiB"),
                        ("wide", f"the same, {m['wide_budget'] / gib:.2f} GiB")):
        run = m["runs"][name][0]
        rows.append(f"| {words} | {run['seconds']:.1f} s | {r[name]['time']:.2f} | {run['peak'] / gib:.2f} GiB | "
                    f"{r[name]['peak']:.2f} | {', '.join(sorted(set(run['verdicts'])))}, reference in "
                    f"{run['reference_dtype']} |")
    s = r["sampled"]
    sampled = m["runs"]["sampled"][0]
    rows.append(f"| `watch(trainer, every={shape['every']})`, {shape['sampled_steps']} steps | {sampled['seconds']:.1f} s | "
                f"{s['time']:.3f} (plain: {m['runs']['plain_s'][0]['seconds']:.1f} s) | {sampled['peak'] / gib:.2f} GiB | "
                f"{s['peak']:.2f} | steps judged: {', '.join(map(str, sampled['judged']))} |")
    return {
        "machine": (f"From one run of `python benchmarks/bench_stacks.py{' --quick' * result['quick']}` on this "
                    f"{info['cores']}-core {cpu_family(info['cpu'])} machine (torch {info['torch']}, transformers "
                    f"{info['transformers']}): a Llama of {m['parameters'] / 1e6:.0f}M parameters, the Trainer with "
                    f"gradient_accumulation_steps = {shape['accum']}, micro-batches of {shape['batch']} x "
                    f"{shape['length']} tokens, AdamW, {shape['steps']} optimizer steps; the median of "
                    f"{result['rounds']} interleaved round{'s' * (result['rounds'] != 1)}:"),
        "table": "\n" + "\n".join(rows) + "\n",
        "summary": (f"with a budget of {result['share']:.0%} of plain training's peak, the check's peak is {r['budget']['peak']:.2f}× "
                    f"plain training's (aim 1.25) and its time {r['budget']['time']:.2f}× (aim 3; {_groups(m)}); "
                    f"with twice that budget, {r['wide']['peak']:.2f}× the memory and {r['wide']['time']:.2f}× the time "
                    f"({_groups(m, 'wide')}); the float64 check added {_added(m):.2f} GiB to plain training's peak, "
                    f"where it counts {m['runs']['check'][0]['float64_need'] / gib:.2f} GiB (`float64_need`, its "
                    "activations apart), the count that decides whether a budget holds it; "
                    f"the sampled check at K = {shape['every']} costs "
                    f"{s['at_every']:.3f}× plain training per step (aim 1.03; plain's median step {s['plain_step']:.2f} s, "
                    f"the check's own time, timed inside the run, {1e3 * s['own_let_go']:.2g} ms on a step it lets go "
                    f"and {s['own_judged']:.2f} s on the one it judges; two runs' median steps, with and without the "
                    f"check, {s['unjudged_step']:.2f} s and {s['plain_step']:.2f} s)"),
    }


def _added(measured: dict) -> float:
    """What the float64 check added to plain training's peak, in GiB (the median over the rounds)."""
    runs = measured["runs"]
    return statistics.median(c["peak"] - p["peak"] for c, p in zip(runs["check"], runs["plain"])) / 2**30


def _groups(measured: dict, name: str = "budget") -> str:
    """How many groups of tensors a budgeted check ran, from its report's note; for the quarter's
    budget, also the fewest any grouping could run (``least_groups``)."""
    found = re.search(r"in (\d+) groups? of tensors", " ".join(measured["runs"][name][0]["notes"]))
    if not found:
        return "the float64 check: its count fits the budget"
    groups = int(found.group(1))
    ran = f"{groups} group{'s' * (groups != 1)} of tensors, each one more pass over the window"
    if name != "budget":
        return ran
    least, sums, room = least_groups(measured["parameters"], measured["budget"])
    return (f"{ran}; no grouping can "
            f"run fewer than {least}: the window's float64 sums alone, with the allocator's margin, are "
            f"{sums / 2**30:.2f} GiB against the {room / 2**30:.2f} GiB the budget leaves beside accumcheck's code")


def least_groups(parameters: int, budget: int) -> tuple[int, int, int]:
    """The fewest groups any plan within ``budget`` runs, counting only what cannot be left out: each
    parameter's float64 sum over the window (``owndtype.SUMS_BYTES``, with ``run.budget.ALLOCATOR``'s
    margin) in the room beside ``run.budget.FIXED_BYTES``; with those bytes and that room."""
    from accumcheck.run.budget import ALLOCATOR, FIXED_BYTES
    from accumcheck.torch.stacks.owndtype import SUMS_BYTES

    sums, room = math.ceil(parameters * SUMS_BYTES * ALLOCATOR), budget - FIXED_BYTES
    return max(1, math.ceil(sums / room)), sums, room


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a ~10M-parameter Llama and one round")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 2, --quick 1)")
    parser.add_argument("--json", metavar="FILE", default=str(RESULT),
                        help="where to write the figures as JSON (default: benchmarks/results/bench_stacks.json)")
    args = parser.parse_args()
    shape = ({"vocab": 8000, "hidden": 256, "intermediate": 688, "layers": 4, "heads": 4} if args.quick else
             {"vocab": 16000, "hidden": 768, "intermediate": 2048, "layers": 12, "heads": 12})
    shape.update(length=64 if args.quick else 128, batch=1, accum=8, steps=3, sampled_steps=8 if args.quick else 12,
                 every=EVERY)
    share = 0.5 if args.quick else SHARE
    rounds = args.rounds or (1 if args.quick else 2)
    started = time.perf_counter()
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB, load {info['load']}; "
          f"torch {info['torch']}, transformers {info['transformers']}")
    measured = measure(shape, rounds, share)
    result = {"machine": info, "quick": args.quick, "rounds": rounds, "shape": shape, "share": share,
              "measured": measured, "seconds": time.perf_counter() - started}
    text = figures(result)
    print(text["machine"])
    print(text["table"])
    print(text["summary"])
    return write_result(args.json, result)


if __name__ == "__main__":
    sys.exit(main())

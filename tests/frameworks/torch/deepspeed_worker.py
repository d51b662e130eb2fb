"""One rank of the DeepSpeed stack tests (test_deepspeed_stack.py), started by torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node 2 deepspeed_worker.py OUT_DIR SCENARIO ...

Each SCENARIO runs on every rank in turn and this rank writes what it found to OUT_DIR/rank-R.json,
by scenario: the report's exit code, step verdicts, summary and windows, or the AccumcheckError's
line (exit 2), and for a user's loop whether the engine was left as found. Scenarios:

    case:STAGE[:FAULT]    accumcheck.integrations.deepspeed.run_case on padded-tokens, N = 2
    user:STAGE[:KIND]     a loop of the user's own over zoo's TinyLM (dropout 0.2), N = 4, two steps:
                          KIND "equal" (micro-batches of one length: each one's mean is the window's),
                          "variable" (lengths differ: the mean of the means is not), "bf16" (the engine
                          in bf16), "raises" (the loop raises in the middle of its second window; a
                          second check of one step follows, whose report is the one kept)
    zero3                 an engine under ZeRO stage 3 given to the check
    without-check         rank 0 runs the check, rank 1 the same loop without it (rank 0 exits 2)

AGREE_TIMEOUT_S: how long the ranks wait for each other at the check's start (default 120 s).
"""

import gc
import json
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from zoo import TinyLM, lm_batches  # noqa: E402

from accumcheck.errors import AccumcheckError  # noqa: E402
from accumcheck.integrations import deepspeed as integration  # noqa: E402

N = 4


def engine_for(stage, bf16=False, model=None):
    model = model or TinyLM()
    world = dist.get_world_size()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": N, "train_batch_size": 2 * N * world,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 2 ** 31,
              "gradient_clipping": 1.0}
    if bf16:
        config["bf16"] = {"enabled": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine


def state_of(engine):
    """What a check must leave as it found: the module's weights, the master weights and optimizer
    state, the step counters, the learning rate, the dropout rate, the random state."""
    inner = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    tensors = [p.detach().clone() for p in engine.module.parameters()]
    tensors += [p.detach().clone() for g in inner.param_groups for p in g["params"]]
    tensors += [v.detach().clone() for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    counters = (engine.global_steps, engine.global_samples, engine.micro_steps, engine.get_lr(),
                engine.module.drop.p, engine.module.training)
    return tensors, counters, torch.get_rng_state()


def same_state(a, b):
    return len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and a[1] == b[1] and \
        torch.equal(a[2], b[2])


def user_loop(check, engine, batches, raises=False):
    for i, batch in enumerate(check.batches(batches)):
        loss = engine(**batch)["loss"]
        engine.backward(loss)
        engine.step()
        if raises and i == N + 1:
            raise KeyboardInterrupt("the loop stopped in the middle of a window")


def train_a_window(engine, batches):
    """A window of training after the check: the engine still steps (its counters move on from
    where they were)."""
    for batch in batches[:N]:
        engine.backward(engine(**batch)["loss"])
        engine.step()
    return engine.global_steps


def summary(report):
    return {"exit": report.exit_code, "verdicts": [s.verdict for s in report.steps], "summary": report.summary(),
            "windows": [s.micro_batches for s in report.steps], "seen": report.micro_batches_seen,
            "precision": [None if s.precision is None else [s.precision.error, s.precision.float32_bound,
                                                             s.precision.bound] for s in report.steps],
            "largest": [s.result.max_relative_difference for s in report.steps], "notes": report.notes}


def user(stage, kind="equal"):
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = engine_for(stage, bf16=kind == "bf16")
    stream = lm_batches(2 * N * world, variable=kind == "variable")
    mine = stream[rank::world]
    before = state_of(engine)
    check = integration.AccumulationCheck(engine, steps=2)
    try:
        with check:
            user_loop(check, engine, mine, raises=kind == "raises")
    except KeyboardInterrupt:
        pass
    found = {"as_found": same_state(before, state_of(engine)), "step": engine.step.__func__ is type(engine).step}
    if kind == "raises":  # a second check from there: the unfinished window's gradient is gone
        check = integration.AccumulationCheck(engine, steps=1)
        with check:
            user_loop(check, engine, mine)
    else:
        found["trained_after"] = train_a_window(engine, mine)
    found.update(summary(check.report))
    return found


def case(stage, fault=None):
    report = integration.run_case("padded-tokens", 2, fault=fault, world_size=dist.get_world_size(),
                                  zero_stage=stage)
    return summary(report)


def zero3():
    engine = engine_for(3)
    integration.AccumulationCheck(engine)
    return {"exit": 0}


def without_check():
    rank = dist.get_rank()
    engine = engine_for(1)
    mine = lm_batches(2 * N * dist.get_world_size())[rank::dist.get_world_size()]
    if rank == 0:
        check = integration.AccumulationCheck(engine, steps=1)
        with check:
            user_loop(check, engine, mine)
        return summary(check.report)
    for batch in mine[:N]:
        engine.backward(engine(**batch)["loss"])
        engine.step()
    return {"exit": 0}


def run(scenario):
    name, *args = scenario.split(":")
    if name == "case":
        return case(int(args[0]), *(args[1:] or [None]))
    if name == "user":
        return user(int(args[0]), *args[1:])
    if name == "zero3":
        return zero3()
    if name == "without-check":
        return without_check()
    raise SystemExit(f"unknown scenario {scenario}")


def main():
    out, scenarios = Path(sys.argv[1]), sys.argv[2:]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    integration.AccumulationCheck.agree_timeout_s = float(os.environ.get("AGREE_TIMEOUT_S", "120"))
    results, code = {}, 0
    for scenario in scenarios:
        try:
            results[scenario] = run(scenario)
        except AccumcheckError as exc:
            results[scenario] = {"exit": 2, "error": str(exc).splitlines()[0]}
            code = 2
        Path(out, f"rank-{rank}.json").write_text(json.dumps(results, indent=1))
    if code == 0:
        dist.barrier()
        gc.collect()  # the engines hold the group through reference cycles: freed before it goes, not at shutdown
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())

"""What the optimizer step did with the gradient, judged by the your-own-loop check: one optimizer
step, one scheduler step and one clipping per window, parameters still between its micro-batches,
and the update equal to the optimizer applied once (a float64 replay). Each fault is a loop users
write; the correct loop is the positive control."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from accumcheck.torch import AccumulationCheck  # noqa: E402
from accumcheck.torch.stacks.stepwatch import BIAS_EACH, DECAY_EACH, LR_INSIDE  # noqa: E402

N = 4
loss_fn = torch.nn.functional.cross_entropy


def run(fault=None, steps=3, optimizer=torch.optim.AdamW, clip=None, chained=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = optimizer(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    if chained:  # two schedulers stepped as one
        sched = torch.optim.lr_scheduler.ChainedScheduler([sched, torch.optim.lr_scheduler.ExponentialLR(opt, 0.99)])
    data = [(torch.randn(5, 8), torch.randint(0, 3, (5,))) for _ in range(4 * N)]
    check = AccumulationCheck(model, opt, loss_fn=loss_fn, steps=steps, scheduler=sched)
    with check:
        for i, (x, y) in enumerate(check.batches(data)):
            (loss_fn(model(x), y) / N).backward()
            last = (i + 1) % N == 0
            if fault == "keras-19990":  # what Keras 3.0-3.4 did at every micro-step, in torch
                torch.nn.utils.clip_grad_norm_(model.parameters(), 100.0)
                if not last:
                    with torch.no_grad():
                        for g in opt.param_groups:
                            for p in g["params"]:
                                p.mul_(1 - g["lr"] * g["weight_decay"])
                                if p in opt.state:
                                    opt.state[p]["step"] += 1
            if fault == "scheduler-each":
                sched.step()
            if fault == "step-each":
                opt.step()
            if last:
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                if fault != "step-each":
                    opt.step()
                if fault != "scheduler-each":
                    sched.step()
                opt.zero_grad()
    return check, model, opt


def test_the_correct_loop_makes_one_update_per_window_to_the_replays_round_off():
    check, model, opt = run(clip=1e-3)  # clipping fires, once per window: the handed gradient is replayed
    report = check.report
    assert report.exit_code == 0 and [s.verdict for s in report.steps] == ["faithful"] * 3
    for s in report.steps:
        u = s.update
        assert u.one_update and u.optimizer_steps == 1 and u.clip_calls == 1 and u.moved == []
        assert u.error is not None and u.error <= 1
    assert [s.update.scheduler_steps for s in report.steps] == [None, 1, 1]
    # nothing of the watch is left on the optimizer or the scheduler class
    assert "zero_grad" not in opt.__dict__
    assert "step" in vars(torch.optim.lr_scheduler.LRScheduler)
    assert torch.optim.lr_scheduler.LRScheduler.step.__qualname__ == "LRScheduler.step"


def test_a_scheduler_stepped_every_micro_batch_is_named():
    report = run("scheduler-each")[0].report
    assert report.exit_code == 1 and {s.verdict for s in report.steps} == {"update"}
    assert all(s.update.scheduler_steps == N for s in report.steps)
    assert "the scheduler stepped 4 times in this window: the learning rate decays 4x too fast" in report.summary()
    assert report.steps[1].update.matches == LR_INSIDE


def test_an_optimizer_step_every_micro_batch_is_the_window_as_several_steps():
    report = run("step-each")[0].report
    assert report.exit_code == 1
    assert [s.update.optimizer_steps for s in report.steps] == [1, 2, 3]
    assert "the optimizer stepped 3 times in this window of 3 micro-batches" in report.steps[2].explanation
    # the window's first step is said to be part of it, before the factor its gradient happens to match
    assert report.steps[0].update.split and report.summary().startswith(
        "FLAGGED: 3 of 3 optimizer steps; step 0 (micro-batches 0): the optimizer stepped again before the gradient")


def test_keras_19990_in_torch_weight_decay_clipping_and_bias_correction_per_micro_step_are_named():
    report = run("keras-19990")[0].report
    assert report.exit_code == 1
    first, later = report.steps[0].update, report.steps[1].update
    assert first.clip_calls == N and later.clip_calls == N
    assert len(first.moved) == 4  # the decay moved every tensor between the micro-batches
    assert first.matches == DECAY_EACH  # before Adam has a step count to advance
    assert later.matches == f"{DECAY_EACH} and {BIAS_EACH}"
    text = report.summary()
    assert "gradient clipping ran 4 times in this window" in text and "moved between the window's micro-batches" in text


def test_an_optimizer_without_decoupled_decay_gets_no_weight_decay_hypothesis():
    report = run(optimizer=torch.optim.Adam)[0].report
    assert report.exit_code == 0
    assert all(s.update.one_update for s in report.steps)


@pytest.mark.parametrize("fault", [None, "scheduler-each"])
def test_a_chained_scheduler_is_one_scheduler_step(fault):
    report = run(fault, chained=True)[0].report
    assert [s.update.scheduler_steps for s in report.steps] == ([None, 1, 1] if fault is None else [N] * 3)
    assert report.exit_code == (0 if fault is None else 1)


@pytest.mark.parametrize("fault", [None, "keras-19990"])
def test_the_replay_in_chunks_of_tensors_judges_as_the_whole_replay(monkeypatch, fault):
    """A large model's update is replayed a few tensors at a time (stepwatch.REPLAY_ELEMENTS) and
    judged as it goes: the same errors, and the same cause named, as the replay of all at once."""
    from accumcheck.torch.stacks import stepwatch

    whole = run(fault)[0].report
    monkeypatch.setattr(stepwatch, "REPLAY_ELEMENTS", 1)  # one tensor per chunk
    chunked = run(fault)[0].report
    assert [s.update.matches for s in chunked.steps] == [s.update.matches for s in whole.steps]
    assert [s.update.error for s in chunked.steps] == [s.update.error for s in whole.steps]
    assert [s.verdict for s in chunked.steps] == [s.verdict for s in whole.steps]
    assert chunked.exit_code == (1 if fault else 0)
    # an optimizer torch.optim does not know replays all its parameters at once: its step may join them
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    custom = type("Joined", (torch.optim.SGD,), {})(params, lr=0.1)
    assert len(stepwatch._chunks(custom, params)) == 1
    assert len(stepwatch._chunks(torch.optim.SGD(params, lr=0.1), params)) == 2
    # what the float64 check's memory need counts for the replay: its largest chunk
    monkeypatch.setattr(stepwatch, "REPLAY_ELEMENTS", 4)
    many = [torch.nn.Parameter(torch.ones(n)) for n in (3, 1, 2, 9, 1, 1)]
    sgd = torch.optim.SGD(many, lr=0.1)
    assert stepwatch.replay_chunk(sgd, [p.numel() for p in many]) == \
        max(sum(p.numel() for p in chunk) for chunk in stepwatch._chunks(sgd, many)) == 9
    assert stepwatch.replay_chunk(custom, [3, 2]) == 5 and stepwatch.replay_chunk(None, [3, 1, 2]) == 4

"""Stack checks that fit beside the run (accumcheck.torch.stacks.owndtype): ``memory_budget=``, under
which a window's reference is computed in the model's own dtype micro-batch by micro-batch, summed
in float64, in groups of tensors, and the sampled check (``transformers.watch``) that stays on in a
real run and judges one window in K and every window of a new length.

Positive controls: correct Trainer, loop and Lightning runs are faithful under a budget, in one group
and in many, and the sampled check of a correct run with dropout on is faithful at every judged step
and leaves the training bit for bit as it is without it. Negative controls: the known faults stay
flagged under a budget (the loss not divided by N, a head that ignores num_items_in_batch), and a
compute_loss that divides by gradient_accumulation_steps, which only an epoch's short last window
shows, is caught there by the sampled check. What cannot fit is refused in one line naming the least
budget that would.
"""

from __future__ import annotations

import contextlib
import copy
import random
import tracemalloc
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_stack_reference import N, TokenLM, run_classifier, token_batches  # noqa: E402

from accumcheck.bounds import UNIT_ROUNDOFF  # noqa: E402
from accumcheck.errors import AccumcheckError, NothingJudgedError  # noqa: E402
from accumcheck.judge import pieces  # noqa: E402
from accumcheck.judge.stack import judge_groups, judge_window, precision_fit  # noqa: E402
from accumcheck.report.single import factor_text  # noqa: E402
from accumcheck.report.stack import SPLIT  # noqa: E402
from accumcheck.run.budget import FIXED_BYTES  # noqa: E402
from accumcheck.run.results import StackWindow, StepPrecision  # noqa: E402
from accumcheck.torch import AccumulationCheck  # noqa: E402
from accumcheck.torch.loopcheck import replica_fits  # noqa: E402
from accumcheck.torch.stacks import owndtype  # noqa: E402

# the least budget: room for the sums of TokenLM's largest tensor alone, so its tensors run in groups
TIGHT = owndtype.least_budget(list(TokenLM().named_parameters()))


def budget_loop(budget, fault=None, windows=3, seed=1, model=None):
    """test_stack_reference's loop over N-micro-batch windows under ``memory_budget``."""
    model = model or TokenLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = token_batches(N * windows, variable=fault is None, seed=seed)  # the fault's on equal micro-batches
    items = [sum(int((b["labels"] != -100).sum()) for b in data[w * N:(w + 1) * N]) for w in range(windows)]
    check = AccumulationCheck(model, opt, memory_budget=budget)
    with check:
        for i, batch in enumerate(check.batches(data)):
            if fault is None:
                loss = model(**batch, num_items_in_batch=items[i // N])["loss"]
            else:
                loss = model(**batch)["loss"]  # each micro-batch's own mean, not divided by N: N x the window's
            loss.backward()
            if (i + 1) % N == 0:
                opt.step()
                opt.zero_grad()
    return model, opt, check.report


def test_a_correct_loop_under_a_budget_is_faithful_in_its_own_dtype_within_the_stated_bound():
    _, _, report = budget_loop(owndtype.float64_need(TokenLM(), []) - 1)
    assert [s.verdict for s in report.steps] == ["faithful"] * 3 and report.exit_code == 0
    assert report.reference_dtype == "float32" and {s.reference for s in report.steps} == {SPLIT}
    for s in report.steps:  # float32 round-off, and the bound names the reference's own dtype too
        assert 0 < s.precision.error <= s.precision.float32_bound
        assert s.precision.bound > 8 * 2 * UNIT_ROUNDOFF["float32"]
    assert any(n.startswith("memory budget") and "in 1 group of tensors" in n for n in report.notes)


def test_in_groups_the_verdict_and_every_tensors_factor_are_those_of_one_group():
    _, _, whole = budget_loop(owndtype.float64_need(TokenLM(), []) - 1, fault="not-divided")
    _, _, grouped = budget_loop(TIGHT, fault="not-divided")
    assert any("in 3 groups of tensors" in n for n in grouped.notes)
    assert "judged in" in grouped.steps[0].reference_note
    for a, b in zip(whole.steps, grouped.steps):
        assert (a.verdict, a.result.matches) == (b.verdict, b.result.matches) == ("constant-factor", "N")
        assert set(a.result.tensor_factors) == set(b.result.tensor_factors) == {"emb.weight", "head.weight",
                                                                                "head.bias"}


class WideLM(torch.nn.Module):
    """An embedding and a head wide enough (3,000 tokens) that the check's float64 sums, megabytes,
    stand out from everything else a run allocates."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(3000, 32)
        self.head = torch.nn.Linear(32, 3000)

    def forward(self, input_ids, labels):
        logits = self.head(torch.tanh(self.emb(input_ids)))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 3000), labels.reshape(-1))


def traced_peak(budget=None, checked=True):
    """numpy's and Python's peak allocation (tracemalloc sees numpy's arrays, not torch's tensors)
    over two windows of WideLM's loop, checked with ``budget`` or not checked."""
    model = WideLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 3000, (4, 8), generator=gen)} for _ in range(2 * N)]
    for b in data:
        b["labels"] = b["input_ids"]
    tracemalloc.start()
    check = AccumulationCheck(model, opt, memory_budget=budget or owndtype.float64_need(model, [opt]) - 1) \
        if checked else None
    with check or contextlib.nullcontext():
        for i, batch in enumerate(check.batches(data) if check else data):
            (model(**batch) / N).backward()
            if (i + 1) % N == 0:
                opt.step()
                opt.zero_grad()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    if check:
        assert [s.verdict for s in check.report.steps] == ["faithful"] * 2
    return peak, model


@pytest.mark.parametrize("piece", [None, 1 << 12], ids=["tensors-whole", "tensors-in-pieces"])
def test_a_budget_groups_its_float64_sums_so_they_never_exceed_it(monkeypatch, piece):
    """What the check holds beside the run (numpy's arrays: the sums F, the judge's temporaries)
    stays within the budget less the code's share, and below what one group of every tensor holds.
    With pieces smaller than the tensors (96,000 elements each) the judge's temporaries are a
    piece's, and the least budget, which counts them so, is smaller and still holds."""
    if piece is not None:
        monkeypatch.setattr(pieces, "PIECE", piece)
    plain, model = traced_peak(checked=False)
    tight = owndtype.least_budget(list(model.named_parameters()))
    traced_peak(tight)  # the judge's compiled passes loaded (compiled, where numba's cache is cold) first
    grouped, _ = traced_peak(tight)
    whole, _ = traced_peak()
    assert grouped - plain <= tight - FIXED_BYTES
    assert grouped < whole  # one group: every tensor's sums at once
    sizes = [n.held + n.judging for n in owndtype.tensor_needs(list(model.named_parameters()))]
    assert sum(sizes) > tight - FIXED_BYTES  # the budget forces groups
    if piece is not None:  # the count of a piece's temporaries, not the tensor's, is what lowers it
        monkeypatch.setattr(pieces, "PIECE", 1 << 22)
        assert owndtype.least_budget(list(model.named_parameters())) > tight


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # one compiled pass; numpy and torch's norm
def test_a_groups_reference_frees_each_tensors_gradient_once_added_and_leaves_grad_alone(dtype):
    """The reference of a group (``owndtype._sums``): F and the norms are those of each micro-batch's
    gradient in float64, the stack's ``.grad`` is left as it is, and a tensor's gradient is freed
    once added, so the group never holds all its gradients at once (a hook of the user's, run before
    the check's, sees no earlier tensor's gradient still alive); the check's hooks go with it."""
    model = WideLM().to(getattr(torch, dtype))
    params = list(model.named_parameters())
    model.emb.weight.grad = torch.ones_like(model.emb.weight)
    grad_before = model.emb.weight.grad.clone()
    alive, refs = [], []

    def users_hook(grad):
        alive.append(sum(ref() is not None for ref in refs))
        refs.append(weakref.ref(grad))

    for _, p in params:
        p.register_hook(users_hook)
    hooks = [len(p._backward_hooks) for _, p in params]
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 3000, (2, 8), generator=gen) for _ in range(3)]
    weights = (0.5, 0.25, 0.25)
    loss = lambda module, ids: module(ids, ids)  # noqa: E731
    # the sums are written over a buffer that holds the last group's (nan here): each tensor's first
    # gradient is set, not added, and a tensor no micro-batch reaches sums to zero
    unused = ("unused", torch.nn.Parameter(torch.ones(5, dtype=getattr(torch, dtype))))
    buffer = np.full(sum(p.numel() for _, p in params) + 5 + 3, np.nan)
    sums, norms = owndtype._sums(loss, model, params + [unused], batches, weights, lambda bs: bs[0], None, buffer)
    assert not sums["unused"].any() and norms["unused"] == 0.0
    assert alive and max(alive) == 0
    assert [len(p._backward_hooks) for _, p in params] == hooks
    assert torch.equal(model.emb.weight.grad, grad_before) and model.head.weight.grad is None
    for name, p in params:
        grads = [torch.autograd.grad(loss(model, ids) * w, [p])[0].double() for ids, w in zip(batches, weights)]
        assert np.array_equal(sums[name], sum(g.numpy() for g in grads))
        assert norms[name] == pytest.approx(sum(float(g.norm()) for g in grads), rel=1e-12)


def test_the_model_optimizer_and_random_states_are_left_as_found_under_a_budget():
    model = TokenLM()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    data = token_batches(N)
    model(**data[0])["loss"].backward()
    opt.step()
    before = copy.deepcopy((model.state_dict(), opt.state_dict(), [p.grad for p in model.parameters()]))
    rng = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    check = AccumulationCheck(model, opt, memory_budget=TIGHT)
    with check:
        for batch in check.batches(data):
            (model(**batch)["loss"] / N).backward()
        opt.step()
        opt.zero_grad()
    assert check.report.exit_code in (0, 1)
    after = (model.state_dict(), opt.state_dict(), [p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(before[0].values(), after[0].values()))
    assert all(torch.equal(a, b) for a, b in zip(before[2], after[2]))
    assert str(before[1]) == str(after[1])
    assert torch.equal(rng[0], torch.get_rng_state()) and np.array_equal(rng[1], np.random.get_state()[1])
    assert rng[2] == random.getstate()


def test_a_budget_too_small_is_refused_in_one_line_with_the_least_that_would_do():
    least = owndtype.least_budget(list(TokenLM().named_parameters()))
    with pytest.raises(AccumcheckError, match=rf"give at least {least} ") as found:
        AccumulationCheck(TokenLM(), torch.optim.SGD(TokenLM().parameters(), lr=0.1), memory_budget=FIXED_BYTES)
    assert "\n" not in str(found.value)
    AccumulationCheck(TokenLM(), torch.optim.SGD(TokenLM().parameters(), lr=0.1), memory_budget=least)
    with pytest.raises(AccumcheckError, match="memory_budget: "):
        AccumulationCheck(TokenLM(), torch.optim.SGD(TokenLM().parameters(), lr=0.1), memory_budget="lots")


def test_a_replica_a_data_parallel_check_needs_is_refused_below_its_size():
    model = TokenLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    need = owndtype.float64_need(model, [opt])
    replica_fits(need, model, opt, "check")
    with pytest.raises(AccumcheckError, match=rf"float64 replica .* give at least {need} "):
        replica_fits(need - 1, model, opt, "check")


def test_a_window_that_cannot_be_split_is_refused_under_a_budget():
    """BatchNorm computes over the batch: the window as one batch holds every micro-batch's activations."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = torch.randn(N * 3, 4), torch.randint(0, 3, (N * 3,))
    check = AccumulationCheck(net, opt, loss_fn=torch.nn.functional.cross_entropy,
                              memory_budget=owndtype.float64_need(net, [opt]) - 1)
    with pytest.raises(AccumcheckError, match="BatchNorm1d '1' computes over the batch.*beyond any memory budget"):
        with check:
            for xb, yb in check.batches(zip(x.split(3), y.split(3))):
                (torch.nn.functional.cross_entropy(net(xb), yb) / N).backward()
            opt.step()
    assert run_classifier  # the joined-window controls of this model live in test_stack_reference


@pytest.mark.parametrize("scales", [(1.0, 1.0), (4.0, 4.0), (4.0, 1.0), (1.0, 4.0), (4.0, 2.0)])
def test_groups_judged_apart_read_as_the_window_judged_whole(scales):
    """judge_groups: a window cut into its tensors' groups has the verdict of the whole, and its
    round-off error is at most the largest group's. A group scaled next to one that is right, or
    one scaled otherwise, is no constant factor, as the whole window is not; where every group has
    the one factor, the sentence counts the window's tensors, not one group's."""
    rng = np.random.default_rng(0)
    full = {f"t{i}": rng.normal(size=(5, 3)) for i in range(4)}
    scale = {"t0": scales[0], "t1": scales[0], "t2": scales[1], "t3": scales[1]}
    applied = {k: v * scale[k] * (1 + 1e-7 * rng.normal(size=v.shape)) for k, v in full.items()}
    absum = {k: np.abs(v) * 1.5 for k, v in full.items()}

    def window(names):
        return StackWindow(step=0, micro_batches=list(range(N)), applied={k: applied[k] for k in names},
                           window={k: full[k] for k in names}, absum={k: absum[k] for k in names},
                           precision=StepPrecision(reference="float32"))

    whole = judge_window(window(list(full)), N)
    grouped = judge_groups([judge_window(window(["t0", "t1"]), N), judge_window(window(["t2", "t3"]), N)], "g")
    expected = "mismatch" if scales[0] != scales[1] else "faithful" if scales[0] == 1.0 else "constant-factor"
    assert whole.verdict == grouped.verdict == expected
    assert set(grouped.result.tensor_factors) == set(full)
    assert (grouped.result.factor_min, grouped.result.factor_max) == pytest.approx((min(scales), max(scales)), rel=1e-5)
    if expected == "faithful":
        assert precision_fit(window(list(full)), N).error <= grouped.precision.error
    if expected == "constant-factor":
        assert "on all 4 tensors" in grouped.result.explanation and grouped.result.matches == whole.result.matches
    if expected == "mismatch":
        assert grouped.result.explanation.startswith(f"not a constant factor: per-tensor factors {factor_text(min(scales))} to "
                                                     f"{factor_text(max(scales))}")
        assert grouped.result.matches is None and not grouped.result.constant


@pytest.mark.parametrize("groups", [(["t0", "t1"], ["t2", "t3"]), (["t0", "t2"], ["t1", "t3"])])
def test_a_gradient_where_the_window_has_none_is_the_worst_tensor_in_groups_as_whole(groups):
    """A tensor with a gradient where the window's is zero is as far from any factor as can be: the
    step judged in groups names it, as the window judged whole does, whichever group it is in."""
    rng = np.random.default_rng(0)
    full = {f"t{i}": rng.normal(size=(5, 3)) for i in range(4)}
    applied = {k: v * (4.0 if k in ("t0", "t1") else 1.0) for k, v in full.items()}
    full["t2"] = np.zeros((5, 3))

    def window(names):
        return StackWindow(step=0, micro_batches=list(range(N)), applied={k: applied[k] for k in names},
                           window={k: full[k] for k in names}, absum={k: np.abs(full[k]) * 1.5 + 0.1 for k in names},
                           precision=StepPrecision(reference="float32"))

    whole = judge_window(window(list(full)), N)
    grouped = judge_groups([judge_window(window(g), N) for g in groups], "g")
    assert whole.verdict == grouped.verdict == "mismatch"
    assert whole.result.factor_worst_tensor == grouped.result.factor_worst_tensor == "t2"
    assert "worst t2, a gradient where the full batch's is zero" in grouped.result.explanation


def test_a_group_within_its_dtypes_round_off_keeps_its_sentence_next_to_a_group_that_is_right():
    """A group whose applied gradient is a factor 1 + 2^-9 of its reference, within bfloat16's
    round-off of the sum (precision-loss), next to a group that is exact: the step reads as the
    window judged whole does, precision-loss, said as round-off, not as a factor."""
    rng = np.random.default_rng(1)
    full = {f"t{i}": rng.normal(size=(5, 3)) for i in range(4)}
    applied = {k: v * (1 + 2.0 ** -9 if k in ("t0", "t1") else 1.0) for k, v in full.items()}

    def window(names):
        return StackWindow(step=0, micro_batches=list(range(N)), applied={k: applied[k] for k in names},
                           window={k: full[k] for k in names}, absum={k: np.abs(full[k]) * 1.5 for k in names},
                           precision=StepPrecision(accumulation="bfloat16"))

    whole = judge_window(window(list(full)), N)
    grouped = judge_groups([judge_window(window(["t0", "t1"]), N), judge_window(window(["t2", "t3"]), N)], "g")
    assert whole.verdict == grouped.verdict == "precision-loss"
    assert grouped.result.explanation.startswith("precision lost in the local sum")
    assert not grouped.result.constant and grouped.result.matches is None


def test_the_bound_counts_a_reference_computed_below_float64():
    w = StackWindow(step=0, micro_batches=[0, 1], applied={"a": np.ones(3)}, window={"a": np.ones(3)},
                    absum={"a": np.ones(3)}, precision=StepPrecision())
    own = StackWindow(step=0, micro_batches=[0, 1], applied={"a": np.ones(3)}, window={"a": np.ones(3)},
                      absum={"a": np.ones(3)}, precision=StepPrecision(reference="float32"))
    assert precision_fit(own, 2).bound == pytest.approx(precision_fit(w, 2).bound + 8 * UNIT_ROUNDOFF["float32"])


# ----------------------------------------------------------------- the Hugging Face Trainer


@pytest.fixture(autouse=True)
def accelerate_state():
    """accelerate's GradientState is shared by every Accelerator in the process, and a Trainer's own
    run (the sampled check's is the user's) leaves its loader among the active ones: put back after
    each test, so later tests in the process start from accelerate's own state."""
    try:
        from accelerate.state import GradientState
    except ImportError:
        yield
        return
    kept = dict(GradientState._shared_state)
    yield
    GradientState._shared_state.clear()
    GradientState._shared_state.update(kept)


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import test_transformers_models as models
    import test_transformers_stack as stack

    return models, stack


def test_a_trainer_under_a_budget_is_faithful_and_its_faults_are_still_named(tmp_path, hf):
    from accumcheck.integrations.transformers import check

    models, stack = hf
    trainer = stack.trainer_for(tmp_path / "a")
    report = check(trainer, steps=3, memory_budget=owndtype.float64_need(trainer.model, []) - 1)
    assert [s.verdict for s in report.steps] == ["faithful"] * 3 and report.reference_dtype == "float32"
    assert "memory_budget=" in report.reproduce
    torch.manual_seed(0)
    trainer = models.trainer_for(tmp_path / "b", models.KwargsBert(models.bert_config(num_labels=3)),
                                 models.sentences(14, label=True))
    flagged = check(trainer, memory_budget=owndtype.float64_need(trainer.model, []) - 1)
    assert [(s.verdict, s.result.matches) for s in flagged.steps] == [("constant-factor", "N"),
                                                                      ("constant-factor", "k")]


def fixed_length(count, n=12, seed=0):
    """Sequences of one length: every micro-batch holds as many predicted tokens as the next."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(1, 64, (n,), generator=gen).tolist()
        out.append({"input_ids": ids, "attention_mask": [1] * n, "labels": [-100] + ids[1:]})
    return out


def with_dropout(model, rate=0.1):
    for m in model.modules():
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = rate
    return model


def dividing_by_n(transformers):
    class DividesByN(transformers.Trainer):
        """A compute_loss that divides its micro-batch's mean by gradient_accumulation_steps: right
        for a full window of equal micro-batches, k/N of it in an epoch's short last window."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return model(**inputs).loss / self.args.gradient_accumulation_steps

    return DividesByN


def sampled_run(tmp_path, stack, kind=None, watched=True, every=3):
    """Two epochs of 22 micro-batches each (5 windows of 4 and a last of 2), dropout on."""
    from accumcheck.integrations.transformers import watch

    torch.manual_seed(0)
    model = with_dropout(stack.tiny_llama())
    trainer = stack.trainer_for(tmp_path, model=model, data=fixed_length(44), kind=kind, num_train_epochs=2)
    if not watched:
        trainer.train()
        return model, None
    with watch(trainer, every=every) as sampled:
        trainer.train()
    return model, sampled.report


def test_the_sampled_check_judges_one_window_in_k_and_every_new_length_and_leaves_the_run_untouched(tmp_path, hf):
    _, stack = hf
    plain, _ = sampled_run(tmp_path / "plain", stack, watched=False)
    model, report = sampled_run(tmp_path / "watched", stack)
    assert [(s.step, len(s.micro_batches)) for s in report.steps] == [(0, 4), (3, 4), (5, 2), (6, 4), (9, 4), (11, 2)]
    assert [s.verdict for s in report.steps] == ["faithful"] * 6 and report.exit_code == 0
    assert report.unstepped == [] and report.micro_batches_seen == 44
    assert any("6 of 12 optimizer steps judged" in n for n in report.notes)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), model.state_dict().values()))


def test_a_fault_only_a_short_last_window_shows_is_caught_by_the_sampled_check(tmp_path, hf):
    _, stack = hf
    _, report = sampled_run(tmp_path, stack, kind=dividing_by_n(stack.transformers), every=100)
    assert [(s.step, s.verdict) for s in report.steps] == [(0, "faithful"), (5, "constant-factor"),
                                                           (6, "faithful"), (11, "constant-factor")]
    assert {s.result.matches for s in report.steps if s.verdict != "faithful"} == {"k/N"}
    assert report.exit_code == 1


def test_the_runs_own_dropout_is_what_the_reference_replays(tmp_path, hf, monkeypatch):
    """Without the random states of each micro-batch's own pass, dropout draws other masks and a
    correct run reads as flagged: the replay is what makes the live reference right."""
    _, stack = hf
    monkeypatch.setattr(owndtype, "_set_rng", lambda state: None)
    _, report = sampled_run(tmp_path, stack, every=100)
    assert report.exit_code == 1


def test_a_sampled_check_of_a_run_that_fed_nothing_passes_nothing(tmp_path, hf):
    from accumcheck.integrations.transformers import watch

    _, stack = hf
    trainer = stack.trainer_for(tmp_path)
    with pytest.raises(AccumcheckError, match="every must be a positive integer"):
        watch(trainer, every=0)
    with watch(trainer, every=10) as sampled:
        pass
    with pytest.raises(NothingJudgedError):
        sampled.report


# ----------------------------------------------------------------- Lightning


def test_a_lightning_fit_under_a_budget_is_faithful_in_its_own_dtype():
    pytest.importorskip("lightning.pytorch")
    import test_lightning_stack as lit
    from zoo import lm_batches

    from accumcheck.integrations.lightning import AccumulationCheck as LightningCheck

    module = lit.LitLM()
    report = lit.fit(module, lm_batches(2 * lit.N), LightningCheck(memory_budget=TIGHT))
    assert [s.verdict for s in report.steps] == ["faithful"] * 2 and report.reference_dtype == "float32"
    assert "memory_budget=" in report.reproduce


def test_a_model_that_runs_in_its_own_dtypes_is_put_back_after_the_check(tmp_path):
    """A data-parallel model runs in its own dtypes and its optimizer steps its very tensors: the
    weights, the optimizer's state and the gradients are put back from what was kept at the start."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.randn(2, 3)).sum().backward()
        before = copy.deepcopy((model.state_dict(), [p.grad for p in model.parameters()]))
        data = [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(4)]
        check = AccumulationCheck(ddp, opt, loss_fn=torch.nn.functional.mse_loss)
        with check:
            for i, (x, y) in enumerate(check.batches(data)):
                (torch.nn.functional.mse_loss(ddp(x), y) / 2).backward()
                if i % 2 == 1:
                    opt.step()
                    opt.zero_grad()
        assert [s.verdict for s in check.report.steps] == ["faithful"] * 2
        assert all(torch.equal(a, b) for a, b in zip(before[0].values(), model.state_dict().values()))
        assert all(torch.equal(a, p.grad) for a, p in zip(before[1], model.parameters()))
        assert len(opt.state) == 0  # the state the check's steps made is gone
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------- the sampled check of a loop


class DropoutLM(TokenLM):
    """TokenLM with dropout between its embedding and head: a live run draws masks."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, input_ids, labels=None, num_items_in_batch=None):
        logits = self.head(self.drop(torch.tanh(self.emb(input_ids))))
        total = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=-100,
                                                  reduction="sum")
        return {"loss": total / (num_items_in_batch if num_items_in_batch is not None else (labels != -100).sum())}


def live_loop(every=None, divide_by_n=False, epochs=2, per_epoch=10):
    """Epochs of ``per_epoch`` micro-batches in windows of N (the last one short), dropout on; the
    correct loop divides each micro-batch's token sum by its window's tokens, the faulty one each
    micro-batch's own mean by N (right for full windows of equal micro-batches, k/N of a short one)."""
    torch.manual_seed(0)
    model = DropoutLM()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    check = AccumulationCheck(model, opt, every=every) if every else None
    data = token_batches(per_epoch, variable=False)
    windows = [data[i:i + N] for i in range(0, per_epoch, N)]
    with check or contextlib.nullcontext():
        for _ in range(epochs):
            feed = check.batches(data) if check else iter(data)
            for window in windows:
                items = sum(int((b["labels"] != -100).sum()) for b in window)
                for _ in window:
                    batch = next(feed)
                    loss = model(**batch)["loss"] / N if divide_by_n else \
                        model(**batch, num_items_in_batch=items)["loss"]
                    loss.backward()
                opt.step()
                opt.zero_grad()
    return model, (check.report if check else None)


def test_the_sampled_check_of_a_loop_is_faithful_and_leaves_its_training_as_it_is():
    plain, _ = live_loop()
    model, report = live_loop(every=4)
    assert [(s.step, len(s.micro_batches)) for s in report.steps] == [(0, 4), (2, 2), (3, 4), (4, 4), (5, 2)]
    assert [s.verdict for s in report.steps] == ["faithful"] * 5 and report.exit_code == 0
    assert "every=4" in report.reproduce and report.unstepped == []
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), model.state_dict().values()))


def test_the_sampled_check_of_a_loop_catches_a_fault_of_its_short_windows():
    _, report = live_loop(every=100, divide_by_n=True)
    assert [(s.step, s.verdict) for s in report.steps] == [(0, "faithful"), (2, "constant-factor"),
                                                           (3, "faithful"), (5, "constant-factor")]
    assert report.exit_code == 1


def test_the_sampled_check_runs_in_one_process_and_takes_a_positive_every():
    model = TokenLM()
    with pytest.raises(AccumcheckError, match="every must be a positive integer"):
        AccumulationCheck(model, torch.optim.SGD(model.parameters(), lr=0.1), every=0)


def test_a_sampled_lightning_fit_is_faithful_and_lists_its_steps():
    pytest.importorskip("lightning.pytorch")
    import test_lightning_stack as lit
    from zoo import lm_batches

    from accumcheck.integrations.lightning import AccumulationCheck as LightningCheck

    report = lit.fit(lit.LitLM(), lm_batches(3 * lit.N), LightningCheck(every=2))
    assert [(s.step, s.verdict) for s in report.steps] == [(0, "faithful"), (2, "faithful")]
    assert report.exit_code == 0 and report.unstepped == []


@pytest.mark.parametrize("kind", [None, "LossOverN"])
def test_the_trainer_check_judges_each_window_after_its_step_and_holds_one_at_a_time(tmp_path, hf, monkeypatch, kind):
    """However many steps it runs, the float64 check keeps one window's gradients: each window is
    judged once its step (and its update's replay) has run, its arrays let go; the report is the
    one of judging them all at the end, for a faithful Trainer and a flagged one."""
    from accumcheck.integrations.transformers import check
    from accumcheck.torch.stacks.recorder import StackRecorder

    _, stack = hf
    kind = kind and getattr(stack, kind)
    held, capture = [], StackRecorder.capture

    def counted(recorder):
        held.append(sum(bool(w.applied) for w in recorder.windows))  # windows whose arrays are still kept
        return capture(recorder)
    monkeypatch.setattr(StackRecorder, "capture", counted)
    report = check(stack.trainer_for(tmp_path / "a", kind=kind), steps=4)
    assert len(report.steps) == 4 and max(held) <= 1
    monkeypatch.setattr(StackRecorder, "_settle", lambda recorder: None)  # every window kept to the end
    kept = check(stack.trainer_for(tmp_path / "b", kind=kind), steps=4)
    assert [s.verdict for s in report.steps] == [s.verdict for s in kept.steps] == \
        (["faithful"] * 4 if kind is None else ["constant-factor"] * 4)
    assert [s.explanation for s in report.steps] == [s.explanation for s in kept.steps]
    assert [s.update.error for s in report.steps] == [s.update.error for s in kept.steps]
    assert report.exit_code == kept.exit_code == (0 if kind is None else 1)


@pytest.mark.parametrize("scale", [1.0, "1/N"])
def test_the_lightning_check_judges_each_window_after_its_step_and_holds_one_at_a_time(monkeypatch, scale):
    """The Lightning callback, like the Trainer's check: one window's arrays at a time, and the
    report of judging them all at the end, for a faithful fit and one that divides by N again."""
    pytest.importorskip("lightning.pytorch")
    import test_lightning_stack as lit
    from zoo import lm_batches

    from accumcheck.integrations.lightning import AccumulationCheck as LightningCheck
    from accumcheck.torch.stacks.recorder import StackRecorder

    held, capture = [], StackRecorder.capture

    def counted(recorder):
        held.append(sum(bool(w.applied) for w in recorder.windows))
        return capture(recorder)
    monkeypatch.setattr(StackRecorder, "capture", counted)
    report = lit.fit(lit.LitLM(scale=scale), lm_batches(4 * lit.N), LightningCheck())
    assert len(report.steps) == 4 and max(held) <= 1
    monkeypatch.setattr(StackRecorder, "_settle", lambda recorder: None)
    kept = lit.fit(lit.LitLM(scale=scale), lm_batches(4 * lit.N), LightningCheck())
    assert [s.verdict for s in report.steps] == [s.verdict for s in kept.steps] == \
        (["faithful"] * 4 if scale == 1.0 else ["constant-factor"] * 4)
    assert [s.explanation for s in report.steps] == [s.explanation for s in kept.steps]
    assert report.exit_code == kept.exit_code == (0 if scale == 1.0 else 1)


def test_a_live_run_is_never_stopped_by_a_window_its_sampled_check_cannot_split(monkeypatch):
    """The sampled check in a real run: a chosen window whose loss cannot be split micro-batch by
    micro-batch (here, the first, as the probe may find where a fresh model's rows lose alike) is
    let go and said, the run trains on untouched, and the next window is judged in its place."""
    from accumcheck.torch.stacks import recorder as recording

    plain, _ = live_loop()
    plan, calls = recording.plan_reference, []

    def first_undecided(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 1:
            return recording.ReferencePlan(False, "the rows probed cannot tell a mean over A from a mean over B")
        return plan(*args, **kwargs)
    monkeypatch.setattr(recording, "plan_reference", first_undecided)
    model, report = live_loop(every=4)
    assert set(calls) == {"auto"}  # never the refusing "micro-batches" in a live run
    assert [(s.step, s.verdict) for s in report.steps] == [(1, "faithful"), (2, "faithful"), (3, "faithful"),
                                                           (4, "faithful"), (5, "faithful")]
    note = next(n for n in report.notes if n.startswith("sampled in your run"))
    assert "1 (in place of step 0, whose window could not be split)" in note
    assert "not judged, their loss not split micro-batch by micro-batch, as a live run needs: step 0 (the rows" in note
    assert report.exit_code == 0
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), model.state_dict().values()))


def test_a_sampled_run_none_of_whose_windows_splits_trains_on_and_passes_nothing():
    """BatchNorm computes over the batch, so no window of this loop splits: the loop trains to its
    end as without the check, and its report is no pass (NothingJudgedError, saying why)."""
    def train(every=None):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 3))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        x, y = torch.randn(N * 3 * 3, 4), torch.randint(0, 3, (N * 3 * 3,))
        check = AccumulationCheck(net, opt, loss_fn=torch.nn.functional.cross_entropy, every=every) if every else None
        batches = list(zip(x.split(3), y.split(3)))
        with check or contextlib.nullcontext():
            feed = check.batches(batches) if check else iter(batches)
            for i, (xb, yb) in enumerate(feed):
                (torch.nn.functional.cross_entropy(net(xb), yb) / N).backward()
                if (i + 1) % N == 0:
                    opt.step()
                    opt.zero_grad()
        return net, check

    plain, _ = train()
    net, check = train(every=2)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), net.state_dict().values()))
    with pytest.raises(NothingJudgedError, match=r"no optimizer step could be judged \(.*steps 0, 1, 2 \(BatchNorm1d "
                                                 r"'1' computes over the batch\)\)"):
        check.report


def test_the_trainer_trains_on_where_its_sampled_check_cannot_split_a_window(tmp_path, hf, monkeypatch):
    """transformers.watch: the first window undecided by the probe is let go (never a refusal that
    stops the user's Trainer), the run ends untouched, the next window is judged in its place."""
    from accumcheck.torch.stacks import recorder as recording

    _, stack = hf
    plain, _ = sampled_run(tmp_path / "plain", stack, watched=False)
    plan, calls = recording.plan_reference, []

    def first_undecided(choice, *args, **kwargs):  # as plan_reference does where the probe cannot decide
        calls.append(choice)
        if len(calls) > 1:
            return plan(choice, *args, **kwargs)
        if choice == "micro-batches":
            raise AccumcheckError("stack check: reference='micro-batches', but this window's loss cannot be split")
        return recording.ReferencePlan(False, "the rows probed cannot tell")
    monkeypatch.setattr(recording, "plan_reference", first_undecided)
    model, report = sampled_run(tmp_path / "watched", stack)
    assert [s.step for s in report.steps] == [1, 3, 5, 6, 9, 11] and report.exit_code == 0
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), model.state_dict().values()))


def test_under_a_budget_a_window_the_probe_cannot_decide_is_let_go_and_a_later_one_judged():
    """A head of zeros loses ln(V) on every token, so every row loses alike and the probe cannot
    tell a mean over items from a mean over rows: the first window is let go, said, and the
    windows after the first step (whose rows lose differently) are judged; a structural case
    (BatchNorm) is still refused (test_a_window_that_cannot_be_split_is_refused_under_a_budget)."""
    from accumcheck.torch.stacks.batches import join_padded
    from accumcheck.torch.stacks.reference import plan_reference

    def zeroed():
        model = TokenLM()
        with torch.no_grad():
            model.head.weight.zero_()
            model.head.bias.zero_()
        return model

    plan = plan_reference("auto", zeroed(), token_batches(N), False, lambda m, b: m(**b)["loss"], join_padded, [])
    assert not plan.split and plan.undecided and "cannot tell" in plan.note
    _, _, report = budget_loop(owndtype.float64_need(zeroed(), []) - 1, model=zeroed())
    assert [(s.step, s.verdict) for s in report.steps] == [(1, "faithful"), (2, "faithful")] and report.exit_code == 0
    assert any("not judged, the probe undecided between two readings of the loss on their rows: step 0" in n
               for n in report.notes)
    with pytest.raises(NothingJudgedError, match=r"no optimizer step could be judged"):
        budget_loop(owndtype.float64_need(zeroed(), []) - 1, model=zeroed(), windows=1)


def test_a_sampled_run_says_what_its_check_cost_each_step(monkeypatch):
    """The recorder counts its own time to the optimizer step it serves: each micro-batch recorded
    and each window captured, judged or let go (a clock that ticks once a reading shows each)."""
    import types

    from accumcheck.torch.stacks import recorder as recording

    ticks, made, init = iter(range(10**6)), [], recording.StackRecorder.__init__

    def kept(recorder, *args, **kwargs):
        made.append(recorder)
        init(recorder, *args, **kwargs)
    monkeypatch.setattr(recording, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    monkeypatch.setattr(recording.StackRecorder, "__init__", kept)
    _, report = live_loop(every=4)
    [recorder] = made
    # windows of 4, 4, 2 micro-batches in each of two epochs; one reading for each, one for the capture
    assert recorder.own_seconds == {0: 5, 1: 5, 2: 3, 3: 5, 4: 5, 5: 3}
    note = next(n for n in report.notes if n.startswith("sampled in your run"))
    assert note.endswith("its own time: 5 s a step let go (median of 1), 21 s on the 5 judged")

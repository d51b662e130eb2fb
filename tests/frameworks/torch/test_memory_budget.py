"""--memory-budget on PyTorch: a run judged in groups (the micro-steps replayed per group) gives the
report of the run judged at once, bit for bit, on every built-in case with a fault injected and on
your own models; and a child process holding a model stays within the budget beside it."""

import json
import subprocess
import sys
import textwrap

import pytest

import accumcheck

torch = pytest.importorskip("torch")
from budget_checks import assert_same_report, tightest  # noqa: E402

import accumcheck.torch  # noqa: E402
from accumcheck.case.reading import builtin_case_names  # noqa: E402
from accumcheck.errors import AccumcheckError  # noqa: E402
from accumcheck.options.choices import FAULT_KINDS
from accumcheck.run.budget import minimum  # noqa: E402
from accumcheck.torch.modelstate import snapshot_bytes  # noqa: E402
from accumcheck.torch.needs import model_needs  # noqa: E402

N = 8
CASES = builtin_case_names()
FAULTS = ("drop-step", "double-step", "scale", "bf16", "roundoff", "repeat-step")


def both(case, **options):
    options = {"case": case, "framework": "torch", "accum_steps": N, **options}
    whole = accumcheck.compare(**options)
    grouped = accumcheck.compare(**options, memory_budget=tightest(**options))
    return whole, grouped


@pytest.mark.parametrize("case", CASES)
def test_every_case_with_a_fault_judged_in_groups_is_judged_as_at_once(case):
    fault = FAULTS[CASES.index(case) % len(FAULTS)]
    whole, grouped = both(case, inject=fault)
    assert_same_report(whole, grouped)
    if fault != "roundoff":
        assert whole.flagged or whole.suspicious  # the fault was seen, and seen the same way in groups


@pytest.mark.slow
@pytest.mark.parametrize("fault", [None, *FAULT_KINDS])
@pytest.mark.parametrize("case", CASES)
def test_every_case_and_fault_judged_in_groups_is_judged_as_at_once(case, fault):
    assert_same_report(*both(case, inject=fault))


@pytest.mark.parametrize("options", [
    {"case": "transformer-small", "dtype": "bfloat16", "inject": "scale"},
    {"case": "embed-attention", "dtype": "float16"},
    {"case": "embed-attention", "accum_dtype": "float64", "inject": "drop-step"},
    {"case": "embed-attention", "mode": "accumulator", "inject": "double-step"},
    {"case": "tiny-grads", "mode": "compensated", "dtype": "bfloat16"},
    {"case": "padded-tokens", "loss_reduction": "token_count", "inject": "scale", "seed": 7},
], ids=lambda o: "-".join(str(v) for v in o.values()))
def test_the_options_judged_in_groups_are_judged_as_at_once(options):
    assert_same_report(*both(**options))


def test_a_budget_everything_fits_in_runs_as_without_one():
    whole, fitting = both("tiny-grads", inject="scale")
    roomy = accumcheck.compare("tiny-grads", framework="torch", accum_steps=N, inject="scale", memory_budget="64G")
    assert roomy.groups == 1 and roomy.config["memory_budget"] == 64 * 2**30
    assert_same_report(whole, fitting)


def test_a_budget_below_the_largest_tensor_names_it_and_the_minimum():
    least = tightest(case="embed-attention", framework="torch")
    with pytest.raises(AccumcheckError, match=rf"tensor \S+ alone needs .* give at least {least} ") as raised:
        accumcheck.compare("embed-attention", framework="torch", memory_budget=least - 1)
    assert "\n" not in str(raised.value)
    assert accumcheck.compare("embed-attention", framework="torch", accum_steps=2, memory_budget=least).groups > 1


def test_what_a_budget_cannot_hold_is_refused_before_the_run():
    for extra, word in (({"oracle": True}, "--oracle"), ({"full_batch": True}, "--full-batch"),
                        ({"world_size": 2}, "--world-size"), ({"framework": "torch,mxnet"}, "one framework")):
        options = {"framework": "torch", "memory_budget": "1G", **extra}
        with pytest.raises(AccumcheckError, match=word):
            accumcheck.compare("tiny-grads", **options)


# ----------------------------------------------------------------------------- your own model


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(50, 32), torch.nn.Flatten(), torch.nn.Linear(32 * 6, 64),
                               torch.nn.LayerNorm(64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 32), torch.nn.Unflatten(1, (1, 32)))


def tied_model(dtype):
    """An embedding whose weight is also the output layer's."""
    torch.manual_seed(0)
    embed, head = torch.nn.Embedding(50, 32), torch.nn.Linear(32, 50, bias=False)
    head.weight = embed.weight
    return torch.nn.Sequential(embed, torch.nn.Linear(32, 32), torch.nn.Tanh(), head).to(dtype)


def batches(n=N):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 50, (4, 6), generator=g), torch.randint(0, 32, (4, 1), generator=g)) for _ in range(n)]


def loss_fn(out, target):
    return torch.nn.functional.cross_entropy(out.reshape(-1, 32), target.reshape(-1))


def own_both(model, budget_bytes, **kwargs):
    whole = accumcheck.torch.check(model, loss_fn, batches(), accum_steps=N, **kwargs)
    grouped = accumcheck.torch.check(model, loss_fn, batches(), accum_steps=N, memory_budget=budget_bytes, **kwargs)
    return whole, grouped


def least(model, scale=None, mode="native"):
    """The smallest budget ``check`` takes for ``model``: the most groups (the copy that puts the
    model back is inside the budget)."""
    return minimum(model_needs(dict(model.named_parameters()), torch.float32, mode, scale, torch.device("cpu"))) \
        + snapshot_bytes(model)


@pytest.mark.parametrize("kwargs", [
    {"inject": "scale:2.weight"},
    {"inject": "drop-step:0.weight"},
    {"mode": "compensated", "inject": "double-step:5.weight"},
    {"train_mode": True, "inject": "bf16:7.bias"},
], ids=lambda k: "-".join(str(v) for v in k.values()))
def test_your_model_judged_in_groups_is_judged_as_at_once(kwargs):
    model = mlp()
    before = [(n, p.detach().clone(), p.grad) for n, p in model.named_parameters()]
    budget = least(model, mode=kwargs.get("mode", "native"))
    whole, grouped = own_both(model, budget, **kwargs)
    assert_same_report(whole, grouped)
    assert whole.flagged or whole.suspicious
    assert all(torch.equal(p, q) and p_grad is q.grad  # left as found
               for (_, p, p_grad), (_, q) in zip(before, model.named_parameters()))
    assert f"memory_budget={budget}" in grouped.reproduce_command()


def test_your_bfloat16_model_with_tied_weights_and_one_with_a_grad_scaler_judged_in_groups():
    model = tied_model(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    tokens = [(torch.randint(0, 50, (4, 6), generator=g), torch.randint(0, 50, (4, 6), generator=g)) for _ in range(N)]

    def tokens_loss(out, target):
        return torch.nn.functional.cross_entropy(out.float().reshape(-1, 50), target.reshape(-1))

    reports = [accumcheck.torch.check(model, tokens_loss, tokens, accum_steps=N, inject="scale", memory_budget=budget)
               for budget in (None, least(model))]
    assert_same_report(*reports)
    assert reports[0].tensors[0].aliases == ["3.weight"] and reports[0].flagged
    scaled = mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    assert_same_report(*own_both(scaled, least(scaled, 1024.0), grad_scaler=scaler, inject="drop-step"))


def test_your_models_budget_is_checked_in_one_line():
    model = mlp()
    for value, words in (("12X", "not a number of bytes"), (-5, "not a number of bytes"),
                         (1000, r"alone needs .* give at least \d+ ")):
        with pytest.raises(AccumcheckError, match=words) as raised:
            accumcheck.torch.check(model, loss_fn, batches(), accum_steps=N, memory_budget=value)
        assert "\n" not in str(raised.value)
    with pytest.raises(AccumcheckError, match="cannot be combined with oracle=True"):
        accumcheck.torch.check(model, loss_fn, batches(), accum_steps=N, memory_budget="1G", oracle=True)


# ----------------------------------------------------------------------------- memory

CHILD = textwrap.dedent("""
    import json, sys
    import torch
    import accumcheck.torch

    def peak():
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))

    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 512)]
    for _ in range(48):
        layers += [torch.nn.ReLU(), torch.nn.Linear(512, 512)]
    model = torch.nn.Sequential(*layers)
    data = [(torch.randn(4, 256), torch.randn(4, 512)) for _ in range(3)]
    loss = torch.nn.functional.mse_loss
    what, budget = sys.argv[1], json.loads(sys.argv[2])
    if what == "plain":
        for x, y in data:
            loss(model(x), y).backward()
        print(json.dumps({"peak": peak()}))
    else:
        report = accumcheck.torch.check(model, loss, data, accum_steps=3, memory_budget=budget)
        print(json.dumps({"peak": peak(), "groups": report.groups, "verdicts": [t.verdict for t in report.tensors]}))
""")


def child(what, budget=None):
    done = subprocess.run([sys.executable, "-c", CHILD, what, json.dumps(budget)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from /proc")
def test_a_child_judged_in_groups_stays_within_its_budget_beside_the_model():
    """12.7M parameters: a fresh child's peak RSS above a plain loop's stays within half of what the
    check without a budget adds."""
    own = child("plain")["peak"]
    whole = child("check")
    budget = (whole["peak"] - own) // 2
    grouped = child("check", budget)
    assert grouped["groups"] > 1 and grouped["verdicts"] == whole["verdicts"]
    assert grouped["peak"] - own <= budget, (grouped["peak"] - own, budget)

"""One call shape: ``accumcheck.torch.check``, ``accumcheck.mxnet.check`` and ``accumcheck.jax.check``
take the shared parameters (``accumcheck.run.checkargs``) under the same names, kinds and defaults,
PyTorch's and MXNet's in the same order; each declares what it honours, and the rest is refused in
one line. Each framework's module is imported only where that framework is installed."""

from __future__ import annotations

import importlib
import inspect

import pytest

from accumcheck.errors import AccumcheckError
from accumcheck.run.checkargs import KEYWORDS, POSITIONAL, CheckShape, shape_of

FRAMEWORKS = ("torch", "mxnet", "jax")
FIRST = {"torch": "model", "mxnet": "model", "jax": "params"}  # JAX checks the parameters in the model's place
P = inspect.Parameter


def framework_check(framework: str):
    """The framework's check, or a skip where the framework is not installed."""
    pytest.importorskip(framework)
    if framework == "jax":
        pytest.importorskip("optax")
    return importlib.import_module(f"accumcheck.{framework}").check


def described(check) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(check).parameters.values()]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_each_check_takes_the_shared_parameters_in_order_and_its_own_last(framework):
    check = framework_check(framework)
    first, *rest = described(check)
    assert first == (FIRST[framework], P.POSITIONAL_OR_KEYWORD, P.empty)
    shared = [(name, P.POSITIONAL_OR_KEYWORD, None) for name in POSITIONAL] + [
        (name, P.KEYWORD_ONLY, default) for name, default in KEYWORDS.items()]
    assert rest[:len(shared)] == shared
    assert all(kind is P.KEYWORD_ONLY for _, kind, _ in rest[len(shared):])  # the framework's own: keywords
    assert getattr(importlib.import_module(f"accumcheck.{framework}"), "check") is check


@pytest.mark.parametrize("one, other", [("torch", "mxnet"), ("torch", "jax"), ("mxnet", "jax")])
def test_two_checks_agree_on_every_parameter_they_share(one, other):
    first, second = described(framework_check(one))[1:], described(framework_check(other))[1:]
    names = {name for name, _, _ in first} & {name for name, _, _ in second}
    assert names >= set(POSITIONAL) | set(KEYWORDS)
    assert [p for p in first if p[0] in names] == [p for p in second if p[0] in names]


def test_pytorch_and_mxnet_take_the_model_and_the_shared_parameters_in_one_order():
    torch_check, mxnet_check = framework_check("torch"), framework_check("mxnet")
    mxnet_names = [name for name, _, _ in described(mxnet_check)]
    assert [name for name, _, _ in described(torch_check)][:len(mxnet_names)] == mxnet_names


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_each_check_declares_what_it_honours_and_why_not_the_rest(framework):
    shape = shape_of(framework_check(framework))
    assert shape is not None and shape.where == f"accumcheck.{framework}.check"
    assert shape.honoured <= set(KEYWORDS) and shape.reduction in ("mean", "sum")
    assert set(KEYWORDS) - shape.honoured <= set(shape.why_not)


# ----------------------------------------------------------------------------- the validation, once

SHAPE = CheckShape("accumcheck.toy.check", frozenset({"oracle", "inject", "progress"}), reduction="sum",
                   why_not={"step": "the toy computes its own loss"}, renamed={"net": "model"})
GOOD = dict(loss_fn=None, batches=[1, 2], accum_steps=None, **KEYWORDS)


def test_the_defaults_pass_and_none_is_the_frameworks_reduction():
    shared = SHAPE.validate(**GOOD)
    assert (shared.fault, shared.loss_reduction, shared.budget) == (None, "sum", None)
    assert SHAPE.validate(**{**GOOD, "inject": "scale:w", "oracle": True}).fault.target == "scale:w"


@pytest.mark.parametrize("change, message", [
    ({"step": len}, "check: accumcheck.toy.check cannot honour step=<builtin_function_or_method> (the toy computes "
                    "its own loss); leave it out"),
    ({"mode": "compensated"}, "check: accumcheck.toy.check cannot honour mode='compensated' (this framework's check "
                              "has no use for it); leave it out"),
    ({"train_mode": 0}, "check: accumcheck.toy.check cannot honour train_mode=0"),
    ({"memory_budget": "1G"}, "check: accumcheck.toy.check cannot honour memory_budget='1G'"),
    ({"batches": None}, "check: batches is missing"),
    ({"accum_steps": 0}, "check: accum_steps must be a positive integer, got 0"),
    ({"accum_steps": True}, "check: accum_steps must be a positive integer, got True"),
    ({"oracle": "yes"}, "check: oracle must be True or False, got 'yes'"),
    ({"loss_fn": 3}, "check: loss_fn must be a function, got a int"),
    ({"progress": "bar"}, "check: progress must be a function, got a str"),
    ({"inject": "melt"}, "--inject: unknown fault 'melt'"),
    ({"inject": 1}, "check: inject must be a text"),
])
def test_a_wrong_or_unhonoured_argument_is_refused_in_one_line(change, message):
    with pytest.raises(AccumcheckError) as raised:
        SHAPE.validate(**{**GOOD, **change})
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value), raised.value


def test_an_old_name_is_refused_with_the_new_one():
    SHAPE.refuse_renamed(["model", "batches"], "accum_check")
    with pytest.raises(AccumcheckError, match="^accum_check: 'net' is now 'model' in accumcheck.toy.check"):
        SHAPE.refuse_renamed(["batches", "net"], "accum_check")

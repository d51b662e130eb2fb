"""``accumcheck check FILE.py`` on a Gluon block and on a JAX loss function whose own code misbehaves.

Every row is a setup file and the command's options. What the user's code raises (the batches,
the block, a hook, the loss, ``step``, also ``sys.exit``; in the float64 passes too) is exit 2
with one line naming the micro-batch and the exception; so is a ``step`` that calls ``backward()``
itself or edits the weights, and a loss that does not depend on the parameters (nothing judged is
never exit 0). The positive controls prove the same setups reach a verdict. The rows run
in-process through ``accumcheck.cli.main``; a framework that is not installed skips its rows.
"""

from __future__ import annotations

import importlib.util

import pytest
from hostile import Refused, Verdict, assert_outcome

from accumcheck.cli import main

HAS = {"mxnet": importlib.util.find_spec("mxnet") is not None,
       "jax": importlib.util.find_spec("jax") is not None and importlib.util.find_spec("optax") is not None}

# A Gluon MLP on 8 micro-batches; the label of micro-batch k holds k, so user code knows which one it is on.
MXNET = '''
import random
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

L2 = gluon.loss.L2Loss()


def make_net():
    mx.random.seed(0)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(4, in_units=3, activation="tanh"), gluon.nn.Dense(2, in_units=4))
    net.initialize(mx.init.Xavier())
    return net


def make_batches(count=8):
    rng = np.random.default_rng(0)
    return [(mx.nd.array(rng.standard_normal((2, 3))), mx.nd.full((2, 2), k)) for k in range(count)]


def index(label):
    return int(label[0, 0].asscalar())


def accumcheck_setup():
{body}
'''

MXNET_ROWS = {
    "good": '    return {"model": make_net(), "loss_fn": L2, "batches": make_batches()}',
    "device-named": '    return {"model": make_net(), "loss_fn": L2, "batches": make_batches(), "device": "cpu"}',
    "block-key": '    return {"block": make_net(), "loss_fn": L2, "batches": make_batches()}',
    "ctx-key": '    return {"model": make_net(), "loss_fn": L2, "batches": make_batches(), "ctx": mx.cpu()}',
    "generator-raises": '''
    def batches():
        for k, batch in enumerate(make_batches()):
            if k == 3:
                raise RuntimeError("the loader broke")
            yield batch

    return {"model": make_net(), "loss_fn": L2, "batches": batches(), "accum_steps": 8}''',
    "batch-function-raises": '''
    listed = make_batches(2)
    return {"model": make_net(), "loss_fn": L2, "batches": lambda k: listed[k], "accum_steps": 4}''',
    "loss-raises": '''
    def loss_fn(out, label):
        np.random.rand(), random.random()
        if index(label) == 5:
            raise ValueError("a bad label")
        return L2(out, label)

    return {"model": make_net(), "loss_fn": loss_fn, "batches": make_batches()}''',
    "loss-exits": '''
    def loss_fn(out, label):
        if index(label) == 5:
            sys.exit(3)
        return L2(out, label)

    return {"model": make_net(), "loss_fn": loss_fn, "batches": make_batches()}''',
    "hook-raises": '''
    net = make_net()

    def hook(block, inputs, output):
        if inputs[0][0, 0].asscalar() == make_batches()[5][0][0, 0].asscalar():
            raise LookupError("a hook failed")

    net.register_forward_hook(hook)
    return {"model": net, "loss_fn": L2, "batches": make_batches()}''',
    "float64-loss-raises": '''
    def loss_fn(out, label):
        if out.dtype == np.float64 and index(label) == 5:
            raise TypeError("no float64 here")
        return L2(out, label)

    return {"model": make_net(), "loss_fn": loss_fn, "batches": make_batches()}''',
    "step-calls-backward": '''
    def step(net, batch):
        loss = L2(net(batch[0]), batch[1])
        loss.backward()
        return loss

    return {"model": make_net(), "step": step, "batches": make_batches()}''',
    "step-calls-backward-retaining": '''
    def step(net, batch):
        loss = L2(net(batch[0]), batch[1])
        loss.backward(retain_graph=True)
        return loss

    return {"model": make_net(), "step": step, "batches": make_batches()}''',
    "step-edits-weights": '''
    def step(net, batch):
        if index(batch[1]) == 5:
            with autograd.pause():
                net[0].weight.data()[:] += 1
        return L2(net(batch[0]), batch[1])

    return {"model": make_net(), "step": step, "batches": make_batches()}''',
    "loss-is-zero": '''
    return {"model": make_net(), "loss_fn": lambda out, label: (out * 0).sum(), "batches": make_batches()}''',
    "loss-is-detached": '''
    return {"model": make_net(), "loss_fn": lambda out, label: L2(out.detach(), label), "batches": make_batches()}''',
}

# A JAX MLP on 8 micro-batches; the target of micro-batch k holds k.
JAX = '''
import random
import sys

import jax
import jax.numpy as jnp
import numpy as np


def make_params():
    k = jax.random.split(jax.random.PRNGKey(0), 2)
    return {"dense": {"kernel": jax.random.normal(k[0], (3, 4)) * 0.5},
            "out": {"kernel": jax.random.normal(k[1], (4, 2))}}


def make_batches(count=8):
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((2, 3)).astype(np.float32), np.full((2, 2), k, np.float32)) for k in range(count)]


def loss(params, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ params["dense"]["kernel"]) @ params["out"]["kernel"] - y) ** 2)


def accumcheck_setup():
{body}
'''

JAX_ROWS = {
    "good": '    return {"loss_fn": loss, "params": make_params(), "batches": make_batches()}',
    "loss-is-one": '    return {"loss_fn": lambda p, b: 1.0, "params": make_params(), "batches": make_batches()}',
    "loss-stops-gradient": '''
    return {"loss_fn": lambda p, b: loss(jax.lax.stop_gradient(p), b), "params": make_params(),
            "batches": make_batches()}''',
    "generator-raises": '''
    def batches():
        for k, batch in enumerate(make_batches()):
            if k == 3:
                raise RuntimeError("the loader broke")
            yield batch

    return {"loss_fn": loss, "params": make_params(), "batches": batches(), "accum_steps": 8}''',
    "batch-function-raises": '''
    listed = make_batches(2)
    return {"loss_fn": loss, "params": make_params(), "batches": lambda k: listed[k], "accum_steps": 4}''',
    "loss-raises": '''
    def loss_fn(params, batch):
        np.random.rand(), random.random()
        if batch[1][0, 0] == 5:
            raise ValueError("a bad target")
        return loss(params, batch)

    return {"loss_fn": loss_fn, "params": make_params(), "batches": make_batches(), "jit": False}''',
    "loss-exits": '''
    def loss_fn(params, batch):
        if batch[1][0, 0] == 5:
            sys.exit(3)
        return loss(params, batch)

    return {"loss_fn": loss_fn, "params": make_params(), "batches": make_batches(), "jit": False}''',
    "callback-raises": '''
    def host(y):
        if y[0, 0] == 5:
            raise ValueError("the callback failed")
        return y

    def loss_fn(params, batch):
        y = jax.pure_callback(host, jax.ShapeDtypeStruct(batch[1].shape, batch[1].dtype), batch[1])
        return loss(params, (batch[0], y))

    return {"loss_fn": loss_fn, "params": make_params(), "batches": make_batches()}''',
    "float64-loss-raises": '''
    def loss_fn(params, batch):
        if params["out"]["kernel"].dtype == jnp.float64 and batch[1][0, 0] == 5:
            raise TypeError("no float64 here")
        return loss(params, batch)

    return {"loss_fn": loss_fn, "params": make_params(), "batches": make_batches(), "jit": False}''',
}

ROWS = [
    ("mxnet", "good", [], Verdict(0, "OK: all 4 tensors")),
    ("mxnet", "good", ["--inject", "scale"], Verdict(1, "FLAGGED")),
    ("mxnet", "device-named", [], Verdict(0, "OK: all 4 tensors")),
    ("mxnet", "block-key", [], Refused("accumcheck_setup() returned: 'block' is now 'model' in accumcheck.mxnet.check, "
                                       "the one shape every framework's check takes; rename it")),
    ("mxnet", "ctx-key", [], Refused("'ctx' is now 'device' in accumcheck.mxnet.check")),
    ("mxnet", "good", ["--memory-budget", "1G"],
     Refused("accumcheck.mxnet.check cannot honour memory_budget=1073741824 (it runs every parameter at once")),
    ("mxnet", "generator-raises", [], Refused("iterating batches raised RuntimeError while reading micro-batch 3")),
    ("mxnet", "batch-function-raises", [], Refused("batches raised IndexError on micro-batch 2")),
    ("mxnet", "loss-raises", [], Refused("loss_fn raised ValueError on micro-batch 5: a bad label")),
    ("mxnet", "loss-exits", [], Refused("loss_fn raised SystemExit on micro-batch 5: exit code 3")),
    ("mxnet", "hook-raises", [], Refused("the block raised LookupError on micro-batch 5: a hook failed")),
    ("mxnet", "float64-loss-raises", ["--oracle"],
     Refused("loss_fn on the float64 copy raised TypeError on micro-batch 5: no float64 here")),
    ("mxnet", "float64-loss-raises", ["--full-batch"],
     Refused("loss_fn on the float64 copy raised TypeError on micro-batch 5: no float64 here")),
    ("mxnet", "step-calls-backward", [],
     Refused("step called backward() itself on micro-batch 0 (the gradients, zeroed before it, were not zero when it "
             "returned); return the loss; accumcheck calls backward itself")),
    ("mxnet", "step-calls-backward-retaining", [], Refused("return the loss; accumcheck calls backward itself")),
    ("mxnet", "step-edits-weights", [], Refused("the weights changed while the check ran")),
    ("mxnet", "loss-is-zero", [], Refused("nothing was judged: none of the block's 4 parameters with a gradient")),
    ("mxnet", "loss-is-detached", [], Refused("the loss of micro-batch 0 is not in a computational graph")),
    ("jax", "good", [], Verdict(0, "OK: all 2 tensors")),
    ("jax", "good", ["--inject", "scale"], Verdict(1, "FLAGGED")),
    ("jax", "good", ["--mode", "compensated"], Refused("accumcheck.jax.check cannot honour mode='compensated'")),
    ("jax", "good", ["--train-mode"], Refused("accumcheck.jax.check cannot honour train_mode=True")),
    ("jax", "good", ["--full-batch"], Refused("accumcheck.jax.check cannot honour full_batch=True")),
    ("jax", "loss-is-one", [], Refused("nothing was judged: loss_fn's gradient was zero")),
    ("jax", "loss-stops-gradient", [], Refused("nothing was judged: loss_fn's gradient was zero")),
    ("jax", "generator-raises", [], Refused("iterating batches raised RuntimeError while reading micro-batch 3")),
    ("jax", "batch-function-raises", [], Refused("batches raised IndexError on micro-batch 2")),
    ("jax", "loss-raises", [], Refused("loss_fn raised ValueError on micro-batch 5: a bad target")),
    ("jax", "loss-exits", [], Refused("loss_fn raised SystemExit on micro-batch 5: exit code 3")),
    ("jax", "callback-raises", [], Refused("raised XlaRuntimeError on micro-batch 5")),
    ("jax", "float64-loss-raises", ["--oracle"],
     Refused("runs loss_fn on a float64 copy of params (JAX's x64 mode) and it raised TypeError on micro-batch 5")),
]


def _setup(framework: str, row: str) -> str:
    template, rows = (MXNET, MXNET_ROWS) if framework == "mxnet" else (JAX, JAX_ROWS)
    return template.replace("{body}", rows[row].strip("\n"))  # each body is indented for the function


@pytest.mark.parametrize("framework, row, options, expected", ROWS,
                         ids=[f"{f}-{r}{''.join(o)}" for f, r, o, _ in ROWS])
def test_the_users_own_code_is_exit_2_in_one_line_or_gets_its_verdict(framework, row, options, expected, tmp_path,
                                                                      monkeypatch, capsys):
    if not HAS[framework]:
        pytest.skip(f"{framework} is not installed")
    (tmp_path / "setup.py").write_text(_setup(framework, row))
    monkeypatch.chdir(tmp_path)
    try:
        code = main(["check", "setup.py", *options])
    except SystemExit as exit_:  # never expected: the user's sys.exit must not end the command
        code = exit_.code
    out, err = capsys.readouterr()
    assert_outcome(expected, code, out, err)


def test_every_setup_has_a_row():
    named = {(f, r) for f, r, _, _ in ROWS}
    assert named == {("mxnet", r) for r in MXNET_ROWS} | {("jax", r) for r in JAX_ROWS}

"""A Gluon loop that trains data-parallel on two CPU contexts, the gradients summed by a kvstore
'local', with gradient accumulation, checked step by step: at every trainer.step the gradient the
optimizer is about to apply (every context's gradient summed) is judged against its window's
micro-batches as one batch (in float64, the net, the Trainer and its kvstore put back afterwards).

    python examples/gluon_contexts.py                # trainer.step(N * b): faithful, exit code 0
    python examples/gluon_contexts.py --per-context  # trainer.step(N * b / 2): 2 x too large, exit code 1

Eight micro-batches of six samples with N = 4, each split across mx.cpu(0) and mx.cpu(1) by
split_and_load; Adam, its states held by the kvstore (update_on_kvstore).
"""

import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import accumcheck.render
from accumcheck.integrations.gluon import AccumulationCheck

N, B, MICRO_BATCHES = 4, 6, 8
CONTEXTS = [mx.cpu(0), mx.cpu(1)]


def main(per_context: bool = False) -> int:
    mx.random.seed(0)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(16, in_units=10, activation="relu"), gluon.nn.Dense(3, in_units=16))
    net.initialize(mx.init.Xavier(), ctx=CONTEXTS)
    net.hybridize()
    for param in net.collect_params().values():
        param.grad_req = "add"  # accumulate across backward() calls
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.01}, kvstore="local")
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.default_rng(0)
    batches = [(mx.nd.array(rng.standard_normal((B, 10))), mx.nd.array(rng.integers(0, 3, B)))
               for _ in range(MICRO_BATCHES)]

    check = AccumulationCheck(net, trainer, loss_fn, accum_steps=N)
    with check:
        for i, (x, y) in enumerate(batches):
            x, y = check.record(x, y)  # the whole micro-batch, in float64 while the check runs
            shards = zip(gluon.utils.split_and_load(x, CONTEXTS), gluon.utils.split_and_load(y, CONTEXTS))
            with autograd.record():
                losses = [loss_fn(net(xs), ys) for xs, ys in shards]
            autograd.backward(losses)
            if (i + 1) % N == 0:
                samples = N * B  # every context's samples behind the summed gradient
                trainer.step(samples / len(CONTEXTS) if per_context else samples)
                net.collect_params().zero_grad()
    print(accumcheck.render.render(check.report, "table"))
    return check.report.exit_code


if __name__ == "__main__":
    sys.exit(main(per_context="--per-context" in sys.argv[1:]))

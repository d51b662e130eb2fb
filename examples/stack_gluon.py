"""A Gluon training loop with gradient accumulation, checked step by step: at every trainer.step the
gradient the optimizer is about to apply is judged against its window's micro-batches as one
batch (in float64, the net and Trainer put back afterwards).

    python examples/stack_gluon.py              # trainer.step(N * b): faithful, exit code 0
    python examples/stack_gluon.py --per-micro  # trainer.step(b): every full window N times too large, exit code 1

Ten micro-batches of five samples with N = 4: two full windows and a short last one of two
micro-batches, stepped with trainer.step(k * b).
"""

import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import accumcheck.render
from accumcheck.integrations.gluon import AccumulationCheck

N, B, MICRO_BATCHES = 4, 5, 10


def main(per_micro_batch: bool = False) -> int:
    mx.random.seed(0)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(16, in_units=10, activation="relu"), gluon.nn.Dropout(0.1), gluon.nn.Dense(3, in_units=16))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    for param in net.collect_params().values():
        param.grad_req = "add"  # accumulate across backward() calls
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05, "momentum": 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.default_rng(0)
    batches = [(mx.nd.array(rng.standard_normal((B, 10))), mx.nd.array(rng.integers(0, 3, B)))
               for _ in range(MICRO_BATCHES)]

    check = AccumulationCheck(net, trainer, loss_fn, accum_steps=N)
    with check:
        for i, (x, y) in enumerate(batches):
            x, y = check.record(x, y)  # the micro-batch, in float64 while the check runs
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            if (i + 1) % N == 0 or i == len(batches) - 1:
                window = i % N + 1
                trainer.step(B if per_micro_batch else window * B)  # the samples behind the gradient
                net.collect_params().zero_grad()
    print(accumcheck.render.render(check.report, "table"))
    return check.report.exit_code


if __name__ == "__main__":
    sys.exit(main(per_micro_batch="--per-micro" in sys.argv[1:]))

"""A test file for a Gluon model-zoo network (deferred initialisation, BatchNorm): the plugin's
accum_check fixture runs accumcheck.mxnet.check at each --accum-steps.

    pytest --accum-steps 16,32 examples/test_gluon_resnet.py
"""

import mxnet as mx
from mxnet.gluon.model_zoo import vision

import accumcheck


def test_resnet18_accumulates_faithfully(accum_check):
    mx.random.seed(0)
    net = vision.resnet18_v1(classes=10)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    batches = [(mx.nd.random.normal(shape=(2, 3, 32, 32)), mx.nd.array([3, 7])) for _ in range(32)]
    report = accum_check(net, mx.gluon.loss.SoftmaxCrossEntropyLoss(), batches)
    accumcheck.assert_faithful(report)

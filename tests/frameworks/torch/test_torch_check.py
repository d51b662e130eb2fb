"""accumcheck.torch.check on a model built here, not from a case."""

import pytest

import accumcheck

torch = pytest.importorskip("torch")
import accumcheck.torch  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(20, 16)
        self.shared = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.drop = torch.nn.Dropout(0.5)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = sum(self.shared(h * s) for s in (1.0, 0.5, 2.0))
        return self.head(self.drop(torch.tanh(self.norm(h))))


def make():
    torch.manual_seed(0)
    net = Net()
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 20, (4, 6), generator=gen), torch.randint(0, 3, (4, 6), generator=gen))
               for _ in range(8)]

    def loss_fn(logits, target):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 3), target.reshape(-1))

    return net, loss_fn, batches


def snapshot(net):
    return ({n: p.detach().clone() for n, p in net.named_parameters()},
            {n: None if p.grad is None else p.grad.clone() for n, p in net.named_parameters()},
            net.training)


def same(a, b):
    params_a, grads_a, training_a = a
    params_b, grads_b, training_b = b
    if training_a != training_b:
        return False
    for name in params_a:
        if not torch.equal(params_a[name], params_b[name]):
            return False
        if (grads_a[name] is None) != (grads_b[name] is None):
            return False
        if grads_a[name] is not None and not torch.equal(grads_a[name], grads_b[name]):
            return False
    return True


def test_check_a_hand_built_model_and_leave_it_as_found():
    net, loss_fn, batches = make()
    net.train()
    loss_fn(net(batches[0][0]), batches[0][1]).backward()  # some gradients already there
    net.head.bias.grad = None  # and one parameter without
    before = snapshot(net)
    report = accumcheck.torch.check(net, loss_fn, batches, accum_steps=8, oracle=True)
    assert same(before, snapshot(net))
    accumcheck.assert_faithful(report)
    names = [t.name for t in report.tensors]
    assert names == [n for n, _ in net.named_parameters()]
    kinds = {t.name: t.kind for t in report.tensors}
    assert kinds == {"embed.weight": "embedding", "shared.weight": "weight", "shared.bias": "bias",
                     "norm.weight": "norm", "norm.bias": "norm", "head.weight": "weight", "head.bias": "bias"}
    assert all(t.oracle_err_native is not None for t in report.tensors)
    assert "model in eval mode" in report.notes and report.case == "Net"
    assert "accumcheck.torch.check(<your Net>" in report.reproduce_command()


@pytest.mark.parametrize("fault", ["drop-step", "double-step", "scale", "bf16"])
def test_check_flags_an_injected_fault(fault):
    net, loss_fn, batches = make()
    before = snapshot(net)
    report = accumcheck.torch.check(net, loss_fn, batches, accum_steps=8, inject=f"{fault}:shared.weight")
    assert [t.name for t in report.flagged] == ["shared.weight"]
    with pytest.raises(AssertionError, match="Mismatched elements"):
        accumcheck.assert_faithful(report)
    assert same(before, snapshot(net))


def test_check_accepts_an_iterator_and_a_function():
    net, loss_fn, batches = make()
    assert accumcheck.torch.check(net, loss_fn, iter(batches), accum_steps=4).exit_code == 0
    assert accumcheck.torch.check(net, loss_fn, lambda i: batches[i % 8], accum_steps=12).exit_code == 0


def test_check_rejects_bad_input():
    net, loss_fn, batches = make()
    before = snapshot(net)
    with pytest.raises(accumcheck.AccumcheckError, match="only 8 batches"):
        accumcheck.torch.check(net, loss_fn, batches, accum_steps=9)
    with pytest.raises(accumcheck.AccumcheckError, match="pass accum_steps"):
        accumcheck.torch.check(net, loss_fn, lambda i: batches[i])
    with pytest.raises(accumcheck.AccumcheckError, match="scalar loss tensor"):
        accumcheck.torch.check(net, lambda out, t: out.sum(-1), batches, accum_steps=2)
    with pytest.raises(accumcheck.AccumcheckError, match="no parameter named 'nope'"):
        accumcheck.torch.check(net, loss_fn, batches, accum_steps=2, inject="scale:nope")
    assert same(before, snapshot(net))  # a failed check leaves the model as it was too

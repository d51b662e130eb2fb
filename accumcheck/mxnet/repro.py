"""``accumcheck compare --repro`` for MXNet Gluon: the case written out as a plain ``HybridBlock``
with the very operators accumcheck's own block runs (``model.MXNetOps``), the loss of
``model.case_loss``, and the two passes of ``passes``: native (``grad_req='add'``, zeroed once; a
faulted parameter's total kept by hand from its ``grad_req='write'`` gradients, as accumcheck
injects it) and manual (``grad_req='write'``, each micro-step's gradient added into a float32
buffer and the float64 sums E and S). Hybridized with ``static_alloc=True`` when the run was."""

from __future__ import annotations

from typing import Any

from ..case.definition import IGNORE_LABEL, LAYERNORM_EPS, Case
from ..case.layers import run_layers
from ..repro.script import FrameworkParts, SourceWriter, Var, attribute_names, params_source, script
from ..run.config import RunConfig

_HELPERS = '''

def dense(F, x, weight, bias, units):
    """A dense layer on the last axis."""
    if bias is None:
        return F.FullyConnected(x, weight, num_hidden=units, no_bias=True, flatten=False)
    return F.FullyConnected(x, weight, bias, num_hidden=units, flatten=False)


def shared_dense(F, x, weight, bias, units, scales):
    """One weight used once per scale: the sum of dense(x * scale)."""
    outs = [dense(F, x * scale, weight, bias, units) for scale in scales]
    total = outs[0]
    for out in outs[1:]:
        total = total + out
    return total


def attention(F, x, heads, width, q, k, v, o=None):
    """Multi-head self-attention; q, k, v (and o, the output projection) are (weight, bias).
    Shapes are symbolic when hybridized: reshape codes 0 keep, -1 infer, -3 merge, -4 split."""

    def project(weight_bias):
        y = dense(F, x, *weight_bias, width)
        return y.reshape((0, 0, heads, -1)).transpose((0, 2, 1, 3)).reshape((-3, 0, 0))

    qh, kh, vh = project(q), project(k), project(v)
    scores = F.batch_dot(qh, kh, transpose_b=True) / math.sqrt(width // heads)
    y = F.batch_dot(F.softmax(scores, axis=-1), vh)
    y = y.reshape((-4, -1, heads, 0, 0)).transpose((0, 2, 1, 3)).reshape((0, 0, -3))
    return dense(F, y, *o, width) if o is not None else y
'''


class _GluonCode:
    """The layer primitives (``accumcheck.case.layers.LayerOps``) as lines of Gluon code in ``F``."""

    def __init__(self, writer: SourceWriter, rank: int) -> None:
        self.w, self.rank = writer, rank

    def embedding(self, x: Var, weight: Var, vocab: int, dim: int) -> Var:
        return self.w.assign(f"F.Embedding({x}, {weight}, input_dim={vocab}, output_dim={dim})",
                             f"embedding {weight.name}")

    def dense(self, x: Var, weight: Var, bias: Var | None, units: int) -> Var:
        if bias is None:
            expr = f"F.FullyConnected({x}, {weight}, num_hidden={units}, no_bias=True, flatten=False)"
        else:
            expr = f"F.FullyConnected({x}, {weight}, {bias}, num_hidden={units}, flatten=False)"
        return self.w.assign(expr, f"dense {weight.name}")

    def shared_dense(self, x: Var, weight: Var, bias: Var | None, units: int, scales: tuple[float, ...]) -> Var:
        return self.w.assign(f"shared_dense(F, {x}, {weight}, {'None' if bias is None else bias}, {units}, {scales!r})",
                             f"{weight.name} used {len(scales)} times")

    def activation(self, x: Var, fn: str) -> Var:
        if fn == "gelu":
            return self.w.assign(f"F.LeakyReLU({x}, act_type='gelu')")
        return self.w.assign(f"F.Activation({x}, act_type={fn!r})")

    def layernorm(self, x: Var, gamma: Var, beta: Var) -> Var:
        return self.w.assign(f"F.LayerNorm({x}, {gamma}, {beta}, axis=-1, eps={LAYERNORM_EPS!r})",
                             f"layer norm {gamma.name.rpartition('.')[0]}")

    def attention(self, x: Var, projections: dict[str, tuple[Var, Var | None]], heads: int, width: int) -> Var:
        pairs = ", ".join(f"{p}=({w}, {'None' if b is None else b})" for p, (w, b) in projections.items())
        return self.w.assign(f"attention(F, {x}, {heads}, {width}, {pairs})",
                             f"attention {projections['q'][0].name.rsplit('.', 2)[0]}")

    def branch(self, x: Var, body: Any, which: int) -> Var:
        # A hybridized graph cannot branch on data: the branch is multiplied by its gate (an input).
        self.w.line(f"# conditional branch {which}: x + gate * body(x), gate 1 on the micro-batches that take it")
        inner = body(x)
        gate = self.w.assign(f"F.slice_axis(gates[0], axis=0, begin={which}, end={which + 1})")
        return self.w.assign(f"{x} + F.broadcast_mul({inner}, {gate}.reshape({(1,) * self.rank!r}))",
                             "where the gate is 0 its parameters get gradients of exactly 0")


def model_source(case: Case) -> str:
    """The class ``Model``: the case's layers, written out."""
    names = [p.name for p in case.parameters()]
    attrs = attribute_names(names)
    writer = SourceWriter(indent=2)
    params = {name: Var(f"p[{attrs[name]!r}]", writer, name) for name in names}
    out = run_layers(case, Var("x", writer), params, _GluonCode(writer, 3 if case.input.kind == "tokens" else 2))
    return f'''# ----------------------------------------------------------------------------------- the model
{params_source(attrs)}
{_HELPERS}

class Model(mx.gluon.HybridBlock):
    """The case's layers as accumcheck builds them."""

    def __init__(self):
        super().__init__(prefix="model_")
        with self.name_scope():
            for name, attr in PARAMS.items():
                shape = DATA["weights/" + name].shape
                setattr(self, attr, self.params.get(attr, shape=shape, dtype="float32", init=mx.init.Zero()))

    def named(self):
        """accumcheck's parameter name -> Parameter."""
        return {{name: getattr(self, attr) for name, attr in PARAMS.items()}}

    def hybrid_forward(self, F, x, *gates, **p):
        """The logits of one micro-batch; gates[0][i] is 1 where it takes conditional branch i."""
{writer.text()}
        return {out}


def make_model():
    """A fresh Model holding the initial weights of the .npz (hybridized as the run was)."""
    model = Model()
    model.initialize(ctx=CTX)
    for name, param in model.named().items():
        param.set_data(mx.nd.array(DATA["weights/" + name], ctx=CTX, dtype="float32"))
    if HYBRIDIZE:
        model.hybridize(static_alloc=True)
    return model
'''


def _loss_source(case: Case) -> str:
    divide = {"mean": " / kept.sum()", "sum": "", "token_count": " / TOKENS  # over the N micro-batches' tokens"}
    tokens = ("TOKENS = sum(int((DATA[f\"labels/{k}\"] != IGNORE).sum()) for k in range(N))\n"
              if case.loss_reduction == "token_count" else "")
    return f'''

# ------------------------------------------------------------------------------------ the loss
IGNORE = {IGNORE_LABEL}  # padding labels: no loss, no gradient
{tokens}

def loss_of(model, k):
    """Micro-batch k's softmax cross-entropy, as torch.nn.functional.cross_entropy computes it."""
    x = mx.nd.array(DATA[f"inputs/{{k}}"], ctx=CTX, dtype="float32")  # Embedding takes its indices as floats
    labels = mx.nd.array(DATA[f"labels/{{k}}"], ctx=CTX, dtype="float32")
    gates = DATA[f"gates/{{k}}"].astype(np.float32)
    logits = model(x, mx.nd.array(gates, ctx=CTX, dtype="float32")) if gates.size else model(x)
    flat = labels.reshape((-1,))
    kept = flat != IGNORE
    picked = mx.nd.pick(mx.nd.log_softmax(logits.reshape((-1, CLASSES)), axis=-1), mx.nd.maximum(flat, 0), axis=-1)
    total = -(picked * kept).sum()
    return total{divide[case.loss_reduction]}
'''


_PASSES = '''

# ---------------------------------------------------------------------------- the two passes
def micro_step(model, k):
    with autograd.record():
        loss = loss_of(model, k)
    loss.backward()


def native_pass():
    """Native accumulation: grad_req='add', gradients zeroed once, then N micro-steps."""
    model = make_model()
    params = model.named()
    for name, param in params.items():
        # the faulted parameter (if any) keeps its total by hand below, from its own gradients
        param.grad_req = "write" if name == FAULT_PARAM else "add"
    for param in params.values():
        param.zero_grad()
    total = None
    for k in range(N):
        micro_step(model, k)
        if FAULT_PARAM is not None:  # the injected fault
            grad = params[FAULT_PARAM].grad().copy()
            added = contribution(k, grad, total)
            total = added.copy() if total is None else total + added
            total = after_add(k, total)
    grads = {name: param.grad().asnumpy() for name, param in params.items()}
    if FAULT_PARAM is not None:
        grads[FAULT_PARAM] = total.asnumpy()
    return grads


def manual_pass():
    """Manual accumulation: grad_req='write' (each micro-step's gradient alone), added into a
    float32 buffer, and into the float64 sums E = sum(g) and S = sum(|g|)."""
    model = make_model()
    params = model.named()
    for param in params.values():
        param.grad_req = "write"
    manual = {name: np.zeros(param.shape, np.float32) for name, param in params.items()}
    exact = {name: np.zeros(param.shape, np.float64) for name, param in params.items()}
    absum = {name: np.zeros(param.shape, np.float64) for name, param in params.items()}
    for k in range(N):
        micro_step(model, k)
        for name, param in params.items():
            grad = param.grad().asnumpy()
            manual[name] += grad
            exact[name] += grad.astype(np.float64)
            absum[name] += np.abs(grad.astype(np.float64))
    return manual, exact, absum
'''

_SETUP = '''os.environ.setdefault("MXNET_STORAGE_FALLBACK_LOG_VERBOSE", "0")  # quiet, set before mxnet loads
os.environ.setdefault("MXNET_SUBGRAPH_VERBOSE", "0")
'''

_IMPORTS = '''import mxnet as mx
from mxnet import autograd

FRAMEWORK = "mxnet " + mx.__version__'''

_BF16 = '''

def bfloat16(values):
    """float32 values rounded to the nearest bfloat16 (ties to even), kept as float32."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    out = rounded.astype(np.uint32).view(np.float32)
    return np.where(np.isfinite(values), out, values).astype(np.float32)
'''


def repro_source(config: RunConfig, report: Any, script_name: str, data_name: str,
                 shrunk_from: str | None = None) -> str:
    """The reproduction script of ``config``'s run (``report``: its Report)."""
    case = config.case
    hybridize = bool(config.option("hybridize", True))
    kind, _, index = config.device.partition(":")
    device = "cpu" if kind == "cpu" else f"gpu:{index or 0}"
    how = "hybridized with static_alloc=True" if hybridize else "imperative"
    setup = (f"CTX = mx.cpu() if DEVICE == 'cpu' else mx.gpu({int(index or 0)})\n"
             f"HYBRIDIZE = {hybridize!r}  # hybridize(static_alloc=True), as the run was\n")
    bf16 = _BF16 if config.fault is not None and config.fault.kind == "bf16" else ""
    parts = FrameworkParts(
        imports=_IMPORTS, device=device,
        native_words=f"MXNet Gluon's native gradient accumulation (grad_req='add', {how})",
        manual_words="manual accumulation (grad_req='write', each gradient added into a float32 buffer)",
        setup=_SETUP, body=bf16 + "\n\n" + setup + model_source(case) + _loss_source(case) + _PASSES,
        round_total="mx.nd.array(bfloat16(total.asnumpy()), ctx=total.context, dtype=total.dtype)",
        kernel_allowance=float(report.bound.get("native", {}).get("kernel_allowance", 0.0)),
        details=f", {how}")
    return script(config, report, parts, script_name, data_name, shrunk_from)

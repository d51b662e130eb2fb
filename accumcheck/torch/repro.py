"""``accumcheck compare --repro`` for PyTorch: the case written out as a plain ``torch.nn.Module``
with the very operations accumcheck's own model runs (``model.TorchOps``), the loss of
``model.case_loss``, and the two passes of ``accumulate``: native (``.grad`` accumulating across
``backward()``, the fault's hooks on its parameter) and manual (``.grad`` reset before each
micro-step, added into a float32 buffer and the float64 sums E and S)."""

from __future__ import annotations

from typing import Any

from ..case.definition import IGNORE_LABEL, LAYERNORM_EPS, Case
from ..case.layers import run_layers
from ..repro.script import FrameworkParts, SourceWriter, Var, attribute_names, params_source, script
from ..run.config import RunConfig

_ACTIVATIONS = {"relu": "torch.relu", "tanh": "torch.tanh", "gelu": "F.gelu"}

_ATTENTION = '''

def attention(x, heads, width, q, k, v, o=None):
    """Multi-head self-attention; q, k, v (and o, the output projection) are (weight, bias)."""
    batch, seq, _ = x.shape
    head = width // heads

    def project(weight_bias):
        y = F.linear(x, *weight_bias)
        return y.view(batch, seq, heads, head).transpose(1, 2)

    qh, kh, vh = project(q), project(k), project(v)
    weights = (qh @ kh.transpose(-1, -2) / math.sqrt(head)).softmax(dim=-1)
    y = (weights @ vh).transpose(1, 2).reshape(batch, seq, width)
    return F.linear(y, *o) if o is not None else y
'''


class _TorchCode:
    """The layer primitives (``accumcheck.case.layers.LayerOps``) as lines of PyTorch code."""

    def __init__(self, writer: SourceWriter) -> None:
        self.w = writer

    def embedding(self, x: Var, weight: Var, vocab: int, dim: int) -> Var:
        return self.w.assign(f"F.embedding({x}, {weight})", f"embedding {weight.name}: {vocab} x {dim}")

    def dense(self, x: Var, weight: Var, bias: Var | None, units: int) -> Var:
        args = f"{x}, {weight}" + ("" if bias is None else f", {bias}")
        return self.w.assign(f"F.linear({args})", f"dense {weight.name}: {units} units")

    def shared_dense(self, x: Var, weight: Var, bias: Var | None, units: int, scales: tuple[float, ...]) -> Var:
        args = f"{weight}" + ("" if bias is None else f", {bias}")
        return self.w.assign(f"sum(F.linear({x} * scale, {args}) for scale in {scales!r})",
                             f"{weight.name} used {len(scales)} times")

    def activation(self, x: Var, fn: str) -> Var:
        return self.w.assign(f"{_ACTIVATIONS[fn]}({x})")

    def layernorm(self, x: Var, gamma: Var, beta: Var) -> Var:
        return self.w.assign(f"F.layer_norm({x}, ({x}.shape[-1],), {gamma}, {beta}, {LAYERNORM_EPS!r})",
                             f"layer norm {gamma.name.rpartition('.')[0]}")

    def attention(self, x: Var, projections: dict[str, tuple[Var, Var | None]], heads: int, width: int) -> Var:
        pairs = ", ".join(f"{p}=({w}, {'None' if b is None else b})" for p, (w, b) in projections.items())
        return self.w.assign(f"attention({x}, {heads}, {width}, {pairs})",
                             f"attention {projections['q'][0].name.rsplit('.', 2)[0]}")

    def branch(self, x: Var, body: Any, which: int) -> Var:
        self.w.count += 1
        out = Var(f"h{self.w.count}", self.w)
        self.w.line(f"if gates[{which}]:  # conditional branch {which}: x + body(x) on the micro-batches that take it")
        self.w.indent += 1
        inner = body(x)
        self.w.line(f"{out} = {x} + {inner}")
        self.w.indent -= 1
        self.w.line("else:  # not taken: its parameters get no gradient in this micro-step")
        self.w.line(f"    {out} = {x}")
        return out


def model_source(case: Case) -> str:
    """The class ``Model``: the case's layers, written out."""
    names = [p.name for p in case.parameters()]
    attrs = attribute_names(names)
    writer = SourceWriter(indent=2)
    params = {name: Var(f"self.{attrs[name]}", writer, name) for name in names}
    out = run_layers(case, Var("x", writer), params, _TorchCode(writer))
    attention = _ATTENTION if any(layer.type == "attention" for layer in case.all_layers()) else ""
    return f'''# ----------------------------------------------------------------------------------- the model
{params_source(attrs)}
{attention}

class Model(torch.nn.Module):
    """The case's layers as accumcheck builds them, holding the initial weights of the .npz."""

    def __init__(self):
        super().__init__()
        for name, attr in PARAMS.items():
            value = torch.tensor(DATA["weights/" + name], dtype=torch.float32, device=DEVICE)
            self.register_parameter(attr, torch.nn.Parameter(value))

    def named(self):
        """accumcheck's parameter name -> parameter."""
        return {{name: getattr(self, attr) for name, attr in PARAMS.items()}}

    def forward(self, x, gates):
        """The logits of one micro-batch; gates[i] says whether it takes conditional branch i."""
{writer.text()}
        return {out}
'''


def _loss_source(case: Case) -> str:
    if case.loss_reduction == "token_count":
        loss = ("F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction=\"sum\") / TOKENS"
                "  # over the N micro-batches' labelled tokens")
        tokens = "TOKENS = sum(int((DATA[f\"labels/{k}\"] != IGNORE).sum()) for k in range(N))\n"
    else:
        loss = f"F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction={case.loss_reduction!r})"
        tokens = ""
    return f'''

# ------------------------------------------------------------------------------------ the loss
IGNORE = {IGNORE_LABEL}  # padding labels: no loss, no gradient
{tokens}

def loss_of(model, k):
    """Micro-batch k's softmax cross-entropy."""
    x = torch.from_numpy(DATA[f"inputs/{{k}}"]).to(DEVICE)
    labels = torch.from_numpy(DATA[f"labels/{{k}}"]).to(DEVICE).reshape(-1)
    logits = model(x, DATA[f"gates/{{k}}"].tolist())
    logits = logits.reshape(-1, logits.shape[-1])
    return {loss}
'''


_PASSES = '''

# ---------------------------------------------------------------------------- the two passes
def to_numpy(tensors):
    return {name: t.detach().cpu().numpy() for name, t in tensors.items()}


def native_pass():
    """Native accumulation: .grad adds up across backward() calls, never reset in between."""
    model = Model()
    params = model.named()
    step = [0]
    if FAULT_PARAM is not None:  # the injected fault, on this one parameter's accumulation
        target = params[FAULT_PARAM]
        target.register_hook(lambda grad: contribution(step[0], grad, target.grad))  # before .grad += grad

        def settle(p):  # after .grad += grad: the total as the fault leaves it
            p.grad.copy_(after_add(step[0], p.grad))

        target.register_post_accumulate_grad_hook(settle)
    for k in range(N):
        step[0] = k
        loss_of(model, k).backward()
    # a parameter no micro-batch used has no .grad: its total is zero
    return to_numpy({name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in params.items()})


def manual_pass():
    """Manual accumulation: .grad reset before each micro-step, each micro-step's gradient added
    into a float32 buffer, and into the float64 sums E = sum(g) and S = sum(|g|)."""
    model = Model()
    params = model.named()
    manual = {name: torch.zeros_like(p) for name, p in params.items()}
    exact = {name: torch.zeros_like(p, dtype=torch.float64) for name, p in params.items()}
    absum = {name: torch.zeros_like(p, dtype=torch.float64) for name, p in params.items()}
    for k in range(N):
        for p in params.values():
            p.grad = None
        loss_of(model, k).backward()
        with torch.no_grad():
            for name, p in params.items():
                grad = p.grad if p.grad is not None else torch.zeros_like(p)  # unused in this micro-step
                manual[name] += grad
                exact[name] += grad.double()
                absum[name] += grad.double().abs()
    return to_numpy(manual), to_numpy(exact), to_numpy(absum)
'''

_SETUP = '''os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, set before torch loads
'''

_IMPORTS = '''import torch
import torch.nn.functional as F

FRAMEWORK = "torch " + torch.__version__'''

_DETERMINISTIC = '''

if THREADS:  # as accumcheck's run had it: a CPU reduction split over other threads rounds differently
    torch.set_num_threads(THREADS)
if DEVICE != "cpu":  # as accumcheck runs on a GPU: deterministic kernels, no TF32
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


'''


def repro_source(config: RunConfig, report: Any, script_name: str, data_name: str,
                 shrunk_from: str | None = None) -> str:
    """The reproduction script of ``config``'s run (``report``: its Report)."""
    case = config.case
    device = "cpu" if config.device == "cpu" else config.device.replace("gpu", "cuda", 1)
    threads = report.settings.get("threads") if isinstance(report.settings.get("threads"), int) else None
    parts = FrameworkParts(
        imports=_IMPORTS, device=device,
        native_words="PyTorch's native gradient accumulation (.grad accumulating across backward())",
        manual_words="manual accumulation into a float32 buffer",
        setup=_SETUP, body=f"THREADS = {threads!r}  # torch.get_num_threads() of accumcheck's run" + _DETERMINISTIC
        + model_source(case) + _loss_source(case) + _PASSES,
        round_total="total.to(torch.bfloat16).to(total.dtype)",
        details="" if device == "cpu" else f" ({device})")
    return script(config, report, parts, script_name, data_name, shrunk_from)

"""PyTorch backend: one backward per micro-step feeds native, manual, E and S together.

Native accumulation is PyTorch's own: ``.grad`` accumulating across ``backward()`` calls. A hook
on each parameter sees the micro-gradient before it is added (leaf-tensor hooks run before
AccumulateGrad); after the backward the step is added into the manual buffer and the float64
sums E and S. The two modes see the very same micro-gradients and nothing is kept from one
micro-step to the next.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from typing import Any, Callable, Iterator

import numpy as np

from ..cases import IGNORE_LABEL, LAYERNORM_EPS, Case, Layer, branch_active
from ..errors import AccumcheckError
from ..faults import Fault, FaultInjector
from ..kernels import add_step
from .base import Backend, ParamAccumulation, Progress, RunResult


def resolve_device(device: str) -> Any:
    """A torch.device for "cpu", "gpu", "cuda" or "cuda:N"; AccumcheckError if unavailable."""
    import torch

    wanted = "cuda" if device == "gpu" else device
    if wanted == "cpu":
        return torch.device("cpu")
    if not (wanted == "cuda" or wanted.startswith("cuda:")):
        raise AccumcheckError(f"--device: unknown device {device!r}; use cpu, gpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise AccumcheckError(f"--device {device}: CUDA is not available to torch {torch.__version__} "
                              "(torch.cuda.is_available() is False); use --device cpu or a CUDA build of torch")
    dev = torch.device(wanted)
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise AccumcheckError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) present")
    return dev


@contextlib.contextmanager
def deterministic(device: Any) -> Iterator[dict[str, Any]]:
    """Deterministic algorithms on and TF32 off for the duration; the caller's settings come back."""
    import torch

    if device.type == "cuda":
        # cuBLAS needs this before its first call to be deterministic.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield {"deterministic_algorithms": True, "tf32": False, "threads": torch.get_num_threads()}
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[2], saved[3]


def build_model(case: Case, weights: dict[str, np.ndarray], dtype: Any, device: Any) -> Any:
    """The case as an nn.Module holding ``weights``; ``canonical`` maps names to parameters."""
    import torch

    class CaseModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.canonical: dict[str, torch.nn.Parameter] = {}
            for i, (name, value) in enumerate(weights.items()):
                param = torch.nn.Parameter(torch.tensor(value, dtype=dtype, device=device))
                self.register_parameter(f"p{i}", param)
                self.canonical[name] = param

        def forward(self, inputs: torch.Tensor, index: int = 0) -> torch.Tensor:
            """The logits of micro-batch ``index`` (its index routes conditional layers)."""
            return _forward(case.layers, inputs, self.canonical, "", index)

    return CaseModel()


def _forward(layers: tuple[Layer, ...], x: Any, params: dict[str, Any], prefix: str, index: int) -> Any:
    import torch
    import torch.nn.functional as F

    for layer in layers:
        name, o = prefix + layer.name, layer.options
        if layer.type == "embedding":
            x = F.embedding(x, params[f"{name}.weight"])
        elif layer.type == "dense":
            x = F.linear(x, params[f"{name}.weight"], params.get(f"{name}.bias"))
        elif layer.type == "shared_dense":
            w, b = params[f"{name}.weight"], params.get(f"{name}.bias")
            x = sum(F.linear(x * scale, w, b) for scale in o["scales"])
        elif layer.type == "activation":
            x = {"relu": torch.relu, "tanh": torch.tanh, "gelu": F.gelu}[o["fn"]](x)
        elif layer.type == "layernorm":
            x = F.layer_norm(x, (x.shape[-1],), params[f"{name}.gamma"], params[f"{name}.beta"], LAYERNORM_EPS)
        elif layer.type == "attention":
            x = _attention(x, params, name, o["heads"], o["out_proj"])
        elif layer.type == "residual":
            x = x + _forward(layer.body, x, params, prefix, index)
        elif layer.type == "block":
            x = _forward(layer.body, x, params, f"{name}.", index)
        elif layer.type == "conditional":
            # A real branch: on the other micro-batches the body's parameters are not used at all.
            if branch_active(layer, index):
                x = x + _forward(layer.body, x, params, f"{name}.", index)
        elif layer.type == "tied_output":
            x = F.linear(x, params[f"{o['tie']}.weight"], params.get(f"{name}.bias"))
    return x


def _attention(x: Any, params: dict[str, Any], name: str, heads: int, out_proj: bool) -> Any:
    import torch.nn.functional as F

    batch, seq, width = x.shape
    head = width // heads

    def project(p: str) -> Any:
        y = F.linear(x, params[f"{name}.{p}.weight"], params.get(f"{name}.{p}.bias"))
        return y.view(batch, seq, heads, head).transpose(1, 2)

    q, k, v = project("q"), project("k"), project("v")
    weights = (q @ k.transpose(-1, -2) / math.sqrt(head)).softmax(dim=-1)
    y = (weights @ v).transpose(1, 2).reshape(batch, seq, width)
    if out_proj:
        y = F.linear(y, params[f"{name}.o.weight"], params.get(f"{name}.o.bias"))
    return y


def case_loss(case: Case, logits: Any, labels: Any, total_tokens: int | None = None) -> Any:
    """Softmax cross-entropy, padding ignored: the micro-batch's mean or sum, or ("token_count")
    its sum over ``total_tokens``, the labelled positions of the whole accumulation."""
    import torch.nn.functional as F

    flat_logits, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    if case.loss_reduction == "token_count":
        return F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_LABEL, reduction="sum") / total_tokens
    return F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_LABEL, reduction=case.loss_reduction)


class TorchBackend(Backend):
    framework_name = "torch"

    def versions(self) -> dict[str, str]:
        import torch

        found = {"torch": torch.__version__}
        if torch.version.cuda:
            found["cuda"] = torch.version.cuda
        return found

    def run(self, case: Case, accum_steps: int, device: str, fault: Fault | None = None,
            oracle: bool = False, progress: Progress | None = None,
            options: dict[str, Any] | None = None, weights: dict[str, np.ndarray] | None = None) -> RunResult:
        import torch

        dev = resolve_device(device)
        options = options or {}
        dtype_name, accum_name = options.get("dtype", "float32"), options.get("accum_dtype", "float32")
        dtype, accum = getattr(torch, dtype_name), getattr(torch, accum_name)
        weights = case.weights() if weights is None else weights
        kinds = {p.name: p.kind for p in case.parameters()}
        with deterministic(dev) as settings, torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            model = build_model(case, weights, dtype, dev)
            mode = options.get("mode", "native")
            sums = _accumulate(case, model, accum_steps, dev, fault, progress, "native + manual", accum, mode)
            exact_oracle = None
            if oracle:
                model64 = build_model(case, weights, torch.float64, dev)
                exact_oracle = _accumulate(case, model64, accum_steps, dev, None, progress, "float64 oracle")
            with torch.no_grad():
                batch = case.batch(0)
                logits = _numpy(model(_inputs(batch.inputs, dev, dtype), batch.index))
            params = []
            for name, param in model.canonical.items():
                manual, exact, absum = sums["buffers"][name]
                native = sums["native"][name]
                params.append(ParamAccumulation(
                    name=name, kind=kinds[name], native=_numpy(native), manual=_numpy(manual),
                    exact=_numpy(exact), absum=_numpy(absum),
                    oracle=None if exact_oracle is None else _numpy(exact_oracle["native"][name])))
        if options.get("full_batch"):
            with deterministic(dev), torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
                settings["full_batch"] = full_batch_check(case, weights, accum_steps, dev, progress)
        losses = {"mean_loss": sums["loss"]}
        if exact_oracle is not None:
            losses["oracle_mean_loss"] = exact_oracle["loss"]
        if dev.type == "cuda":
            name = f"{dev} ({torch.cuda.get_device_name(dev)})"
        else:
            name = "cpu"
        settings["requested_device"] = device
        settings["mode"] = mode
        return RunResult(params=params, framework="torch", versions=self.versions(), device=name,
                         # the GradAccumulator sums in float32, whatever the parameters' dtype
                         param_dtype=dtype_name if mode == "native" else "float32", accum_dtype=accum_name,
                         native_kernel_allowance=0.0,
                         losses=losses, settings=settings, first_logits=logits)


# float64 evaluations of the same gradient agree to ~1e-15 of its scale; a semantic difference
# (how the loss is normalised) is of order one.
SEMANTIC_TOLERANCE = 1e-9


def full_batch_check(case: Case, weights: dict[str, np.ndarray], accum_steps: int, dev: Any,
                     progress: Progress | None = None) -> dict[str, Any]:
    """The accumulated gradient against the gradient of the whole batch in one backward pass, both
    in float64. With a "mean" loss the accumulated sum is divided by N, as training code does;
    "sum" and "token_count" compare as they are. Returns the normalisation, the largest difference
    relative to the full-batch gradient's largest element, the tensor where it is, and whether
    the two are equivalent (within SEMANTIC_TOLERANCE)."""
    import torch

    micro = _accumulate(case, build_model(case, weights, torch.float64, dev), accum_steps, dev, None, progress,
                        "float64 micro-batches")["native"]
    batches = [case.batch(k) for k in range(accum_steps)]  # the whole batch at once: memory grows with N
    inputs = _inputs(np.concatenate([b.inputs for b in batches]), dev, torch.float64)
    labels = torch.from_numpy(np.concatenate([b.labels for b in batches])).to(dev)
    model = build_model(case, weights, torch.float64, dev)
    whole = case if case.loss_reduction != "token_count" else case.with_reduction("mean")
    case_loss(whole, model(inputs), labels).backward()
    scale = 1.0 / accum_steps if case.loss_reduction == "mean" else 1.0
    full = {name: p.grad for name, p in model.canonical.items()}
    top = max(float(g.abs().max()) for g in full.values()) or 1.0
    gaps = {name: float((micro[name] * scale - full[name]).abs().max()) / top for name in full}
    worst = max(gaps, key=gaps.get)
    return {"normalisation": case.loss_reduction, "accumulated_scaled_by": "1/N" if scale != 1.0 else "1",
            "max_relative_difference": gaps[worst], "worst_tensor": worst,
            "equivalent": gaps[worst] <= SEMANTIC_TOLERANCE, "tolerance": SEMANTIC_TOLERANCE}


def float64_oracle(case: Case, weights: dict[str, np.ndarray], accum_steps: int, device: str,
                   progress: Progress | None = None) -> tuple[dict[str, np.ndarray], float]:
    """Accumulated gradients of the whole model in float64, and its mean loss (for other backends)."""
    import torch

    dev = resolve_device(device)
    with deterministic(dev), torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        model = build_model(case, weights, torch.float64, dev)
        result = _accumulate(case, model, accum_steps, dev, None, progress, "float64 oracle (torch)")
    return {name: _numpy(g) for name, g in result["native"].items()}, result["loss"]


def _inputs(values: np.ndarray, dev: Any, dtype: Any) -> Any:
    import torch

    inputs = torch.from_numpy(values).to(dev)
    return inputs.to(dtype) if inputs.is_floating_point() else inputs


class _StepRecorder:
    """Feeds manual, E and S from the micro-gradients the native path receives.

    During backward the hooks only keep a reference to each parameter's micro-gradient; after
    backward the whole step goes into flat buffers with one concatenation and one fused pass
    (three adds on CUDA), instead of three small operations per parameter inside the backward."""

    def __init__(self, params: dict[str, Any], accum_dtype: Any = None,
                 reduce_step: Callable[[Any], Any] | None = None) -> None:
        import torch

        self.params = params
        # Data parallel: manual adds the step all-reduced across ranks; E and S stay this rank's.
        self.reduce_step = reduce_step
        first = next(iter(params.values()))
        total = sum(p.numel() for p in params.values())
        self.manual = torch.zeros(total, dtype=accum_dtype or first.dtype, device=first.device)
        self.exact = torch.zeros(total, dtype=torch.float64, device=first.device)
        self.absum = torch.zeros(total, dtype=torch.float64, device=first.device)
        self.step = torch.empty(total, dtype=first.dtype, device=first.device)
        self.grads: dict[str, Any] = {}

    def flush(self) -> None:
        """Add the step just finished into manual, E and S."""
        import torch

        grads = self.grads
        if len(grads) < len(self.params):  # a parameter unused in this micro-step
            for name, p in self.params.items():
                grads.setdefault(name, torch.zeros_like(p))
        torch.cat([grads[name].reshape(-1) for name in self.params], out=self.step)
        grads.clear()
        if self.reduce_step is not None:
            self.manual.add_(self.reduce_step(self.step))
            self.exact.add_(self.step)
            self.absum.add_(self.step.abs())
        elif self.step.device.type == "cpu" and self.step.dtype in (torch.float32, torch.float64):
            add_step(self.step.numpy(), self.manual.numpy(), self.exact.numpy(), self.absum.numpy())
        else:
            self.manual.add_(self.step)
            self.exact.add_(self.step)
            self.absum.add_(self.step.abs_())

    def buffers(self) -> dict[str, tuple[Any, Any, Any]]:
        """Per-parameter (manual, exact, absum) views of the flat buffers."""
        out, offset = {}, 0
        for name, p in self.params.items():
            span = slice(offset, offset + p.numel())
            out[name] = tuple(buf[span].view(p.shape) for buf in (self.manual, self.exact, self.absum))
            offset += p.numel()
        return out


def _accumulate(case: Case, model: Any, accum_steps: int, dev: Any, fault: Fault | None,
                progress: Progress | None, phase: str, accum_dtype: Any = None, mode: str = "native") -> dict[str, Any]:
    """Stream the case's micro-steps through ``model``; see ``accumulate``."""
    import torch

    dtype = next(model.parameters()).dtype
    total = case.token_count(accum_steps) if case.loss_reduction == "token_count" else None

    def step_loss(step: int) -> Any:
        batch = case.batch(step)
        labels = torch.from_numpy(batch.labels).to(dev)
        return case_loss(case, model(_inputs(batch.inputs, dev, dtype), batch.index), labels, total)

    return accumulate(model.canonical, step_loss, accum_steps, fault, progress, phase, accum_dtype, mode)


def accumulate(params: dict[str, Any], step_loss: Callable[[int], Any], accum_steps: int, fault: Fault | None,
               progress: Progress | None, phase: str, accum_dtype: Any = None, mode: str = "native",
               step_context: Callable[[int], Any] | None = None,
               reduce_step: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """Run ``step_loss(step).backward()`` for each micro-step, letting ``.grad`` accumulate
    natively while the hooks feed manual (in ``accum_dtype``, default the parameters'), E and S.
    ``params`` maps names to leaf parameters, whose ``.grad`` is reset first. ``mode`` picks
    what fills the native slot: "native" (``.grad`` accumulating), "accumulator" or
    "compensated" (``accumcheck.torch.GradAccumulator`` taking each micro-step's ``.grad``).
    ``step_context(step)``, when given, is entered around each micro-step's forward and backward
    (DistributedDataParallel's ``no_sync()``); ``reduce_step`` maps a flat micro-gradient to what
    the manual buffer adds (its all-reduced mean). Returns {"buffers": name -> (manual, exact, absum),
    "native": name -> accumulated .grad, "loss": mean loss}."""
    import torch

    recorder = _StepRecorder(params, accum_dtype, reduce_step)
    handles = []
    state = {"step": 0}
    injector = None
    if fault is not None:
        injector = FaultInjector(fault, accum_steps, lambda t: t.to(torch.bfloat16).to(t.dtype))

    for name, param in params.items():
        param.grad = None
        if injector is None or fault.param != name:
            # A C-level callable: the hook costs no Python frame inside the backward pass.
            handles.append(param.register_hook(functools.partial(recorder.grads.__setitem__, name)))
            continue

        def inject(grad: Any, name: str = name, param: Any = param) -> Any:
            # A copy: the native path may adopt ``grad`` as .grad, and the bf16 fault rounds that.
            recorder.grads[name] = grad.clone()
            return injector.contribution(state["step"], grad, param.grad)

        handles.append(param.register_hook(inject))
        if fault.kind == "bf16":
            def round_total(p: Any) -> None:
                replaced = injector.after_add(state["step"], p.grad)
                if replaced is not None:
                    p.grad.copy_(replaced)

            handles.append(param.register_post_accumulate_grad_hook(round_total))

    first = next(iter(params.values()))
    loss_sum = torch.zeros((), dtype=torch.float64, device=first.device)
    accumulator = None
    if mode != "native":
        from ..torch import GradAccumulator

        accumulator = GradAccumulator(params.values(), compensated=mode == "compensated")
    try:
        for step in range(accum_steps):
            state["step"] = step
            with step_context(step) if step_context is not None else contextlib.nullcontext():
                loss = step_loss(step)
                loss.backward()
            recorder.flush()
            if accumulator is not None:
                accumulator.add()
            loss_sum += loss.detach()
            if progress is not None:
                progress(phase, step + 1, accum_steps)
    finally:
        for handle in handles:
            handle.remove()
    if accumulator is not None:
        native = dict(zip(params, accumulator.totals()))
    else:
        native = {name: (p.grad if p.grad is not None else torch.zeros_like(p)) for name, p in params.items()}
    return {"buffers": recorder.buffers(), "native": native, "loss": float(loss_sum) / accum_steps}


def _numpy(tensor: Any) -> np.ndarray:
    """A host copy; bfloat16 and float16 become float32 (exactly), numpy having no bfloat16."""
    import torch

    tensor = tensor.detach()
    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.float()
    return tensor.cpu().numpy()


BACKEND_CLASS = TorchBackend

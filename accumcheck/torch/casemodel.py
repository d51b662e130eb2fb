"""The case as a PyTorch module: devices, determinism, the layer primitives, the loss."""

from __future__ import annotations

import contextlib
import math
import os
import sys
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from ..case.definition import IGNORE_LABEL, LAYERNORM_EPS, Case
from ..case.layers import run_layers
from ..errors import AccumcheckError


def resolve_device(device: str) -> torch.device:
    """A torch.device for "cpu", "gpu", "cuda", "gpu:N" or "cuda:N"; AccumcheckError if unavailable."""
    wanted = device.replace("gpu", "cuda", 1) if device.startswith("gpu") else device
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
def deterministic(device: torch.device, warn_only: bool = False) -> Iterator[dict[str, Any]]:
    """Deterministic algorithms on and TF32 off for the duration; the caller's settings come back.
    ``warn_only``: an operation without a deterministic kernel warns instead of raising (a user's
    model may use one; native and manual share its backward passes anyway)."""
    if device.type == "cuda":
        # cuBLAS needs this before its first call to be deterministic.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    fill = _fill_uninitialized_memory(False)
    _use_deterministic_algorithms(True, warn_only=warn_only)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield {"deterministic_algorithms": True, "tf32": False, "threads": torch.get_num_threads()}
    finally:
        _use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[2], saved[3]
        if fill is not None:
            _fill_uninitialized_memory(fill)


def _fill_uninitialized_memory(mode: bool) -> bool | None:
    """Set PyTorch's fill of fresh allocations under deterministic algorithms (a debugging aid:
    every torch.empty written with NaN first); the setting as it was. Kernels write every element
    of what they allocate, so the gradients are the same either way. None where this PyTorch has
    no such setting."""
    if not hasattr(torch._C, "_get_deterministic_fill_uninitialized_memory"):
        return None
    was = torch._C._get_deterministic_fill_uninitialized_memory()
    torch._C._set_deterministic_fill_uninitialized_memory(mode)
    return was


def _use_deterministic_algorithms(mode: bool, warn_only: bool = False) -> None:
    # torch.use_deterministic_algorithms also sets TorchInductor's flag, and imports TorchInductor
    # (with dynamo and sympy: 1.7 s on a CPU) to do so. accumcheck compiles nothing: where
    # TorchInductor is not loaded yet, set the flag PyTorch's kernels read and leave it alone.
    if "torch._inductor.config" in sys.modules or not hasattr(torch._C, "_set_deterministic_algorithms"):
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    else:
        torch._C._set_deterministic_algorithms(mode, warn_only=warn_only)


def isolated(device: torch.device) -> Any:
    """The random state of this process (and of ``device``) as it was, after the block."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


class TorchOps:
    """The layer primitives (``accumcheck.case.layers.LayerOps``) for one micro-batch, whose
    conditional branches are taken where ``gates`` says."""

    def __init__(self, gates: list[bool]) -> None:
        self.gates = gates

    def embedding(self, x: Any, weight: Any, vocab: int, dim: int) -> Any:
        return F.embedding(x, weight)

    def dense(self, x: Any, weight: Any, bias: Any, units: int) -> Any:
        return F.linear(x, weight, bias)

    def shared_dense(self, x: Any, weight: Any, bias: Any, units: int, scales: tuple[float, ...]) -> Any:
        return sum(F.linear(x * scale, weight, bias) for scale in scales)

    def activation(self, x: Any, fn: str) -> Any:
        return {"relu": torch.relu, "tanh": torch.tanh, "gelu": F.gelu}[fn](x)

    def layernorm(self, x: Any, gamma: Any, beta: Any) -> Any:
        return F.layer_norm(x, (x.shape[-1],), gamma, beta, LAYERNORM_EPS)

    def attention(self, x: Any, projections: dict[str, tuple[Any, Any]], heads: int, width: int) -> Any:
        batch, seq, _ = x.shape
        head = width // heads

        def project(p: str) -> Any:
            y = F.linear(x, *projections[p])
            return y.view(batch, seq, heads, head).transpose(1, 2)

        q, k, v = project("q"), project("k"), project("v")
        weights = (q @ k.transpose(-1, -2) / math.sqrt(head)).softmax(dim=-1)
        y = (weights @ v).transpose(1, 2).reshape(batch, seq, width)
        return F.linear(y, *projections["o"]) if "o" in projections else y

    def branch(self, x: Any, body: Any, which: int) -> Any:
        # A real branch: on the other micro-batches the body's parameters are not used at all.
        return x + body(x) if self.gates[which] else x


def build_model(case: Case, weights: dict[str, np.ndarray], dtype: torch.dtype, device: torch.device) -> Any:
    """The case as an nn.Module holding ``weights``; ``canonical`` maps names to parameters."""
    shapes = {p.name: p.shape for p in case.parameters()}

    class CaseModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self._attributes: dict[str, str] = {}
            for i, (name, value) in enumerate(weights.items()):
                self.register_parameter(f"p{i}", torch.nn.Parameter(torch.tensor(value, dtype=dtype, device=device)))
                self._attributes[name] = f"p{i}"

        @property
        def canonical(self) -> dict[str, torch.nn.Parameter]:
            """The case's names to the parameters the module holds now (FSDP2 replaces them)."""
            return {name: getattr(self, attribute) for name, attribute in self._attributes.items()}

        def forward(self, inputs: torch.Tensor, index: int = 0) -> torch.Tensor:
            """The logits of micro-batch ``index`` (its index routes conditional layers)."""
            return run_layers(case, inputs, self.canonical, TorchOps(case.gates(index)), shapes)

    return CaseModel()


def case_loss(case: Case, logits: Any, labels: Any, total_tokens: int | None = None) -> Any:
    """Softmax cross-entropy, padding ignored: the micro-batch's mean or sum, or ("token_count")
    its sum over ``total_tokens``, the labelled positions of the whole accumulation."""
    flat_logits, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    if case.loss_reduction == "token_count":
        return F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_LABEL, reduction="sum") / total_tokens
    return F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_LABEL, reduction=case.loss_reduction)


def to_inputs(values: np.ndarray, dev: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A batch's inputs on ``dev``; floating ones in ``dtype`` (token ids stay integers)."""
    inputs = torch.from_numpy(values).to(dev)
    return inputs.to(dtype) if inputs.is_floating_point() else inputs


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A host copy; bfloat16 and float16 become float32 (exactly), numpy having no bfloat16."""
    tensor = tensor.detach()
    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.float()
    return tensor.cpu().numpy()

"""What a PyTorch run holds beside the model per tensor (``accumcheck.run.budget``): the StepRecorder's
manual buffer, E and S, its flat step buffer and the micro-gradients it keeps until the step is
added, and the host copies the judge reads where it cannot read the tensors themselves. (A run
under a budget holds no steps: ``accumulate``'s ``hold_steps``.)"""

from __future__ import annotations

from typing import Any

from ..run.budget import TensorNeed, element_bytes, need
from ..run.config import RunConfig

_SIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def _host_bytes(param: int, accum: int, mode: str, on_cpu: bool, scaled: bool = False) -> int:
    """Bytes per element of the host copies the judge reads: native as float32 where numpy lacks its
    dtype (or a GradAccumulator's sums, and carries), and copies of native, manual, E and S from a
    GPU, and again divided by a loss scale."""
    native = 4 * (2 if mode == "compensated" else 1) if mode != "native" else 4 if param < 4 else 0
    return native + (max(param, 4) + accum + 16) * ((not on_cpu) + scaled)


def case_needs(config: RunConfig) -> list[TensorNeed]:
    """Each tensor of ``config``'s case, in canonical order."""
    param, accum = _SIZE[config.dtype], _SIZE[config.accum_dtype]
    per_element = element_bytes(param, accum, param, _host_bytes(param, accum, config.mode, config.device == "cpu"))
    reduced = config.mode == "native" and param < 4
    return [need(p.name, p.numel, per_element, reduced) for p in config.case.parameters()]


def model_needs(params: dict[str, Any], accum_dtype: Any, mode: str, scale: float | None,
                where: Any) -> list[TensorNeed]:
    """Each of a user's parameters (canonical names, in order): ``accum_dtype`` the manual buffer's,
    ``scale`` the GradScaler's (the arrays are judged unscaled), ``where`` the model's device."""
    accum = accum_dtype.itemsize
    step = max(p.dtype.itemsize for p in params.values())  # the flat step buffer holds every dtype exactly
    out = []
    for name, p in params.items():
        size = p.dtype.itemsize
        host = _host_bytes(size, accum, mode, where.type == "cpu", scale is not None)
        reduced = mode == "native" and size < 4
        out.append(need(name, p.numel(), element_bytes(size, accum, step, host), reduced))
    return out



"""The jax devices a run names: ``--device`` of a built-in case's run, ``device`` of a check."""

from __future__ import annotations

from typing import Any

import jax

from ..errors import AccumcheckError


def resolve_device(device: str) -> Any:
    """The jax device for "cpu", "gpu", "cuda", "gpu:N" or "cuda:N"; AccumcheckError if absent."""
    if device == "cpu":
        return jax.devices("cpu")[0]
    kind, _, index = device.partition(":")
    if kind not in ("gpu", "cuda") or (index and not index.isdigit()):
        raise AccumcheckError(f"--device: unknown device {device!r}; use cpu, gpu, cuda or cuda:N")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        raise AccumcheckError(f"--device {device}: jax {jax.__version__} sees no GPU (jax.devices('gpu') fails); "
                              "use --device cpu or install a CUDA build of jaxlib") from None
    if int(index or 0) >= len(gpus):
        raise AccumcheckError(f"--device {device}: only {len(gpus)} GPU(s) present")
    return gpus[int(index or 0)]


def check_device(device: Any) -> Any:
    """The jax device a check's ``device`` names: a jax device, or "cpu", "gpu", "cuda", "gpu:N", "cuda:N"."""
    if hasattr(device, "platform") and hasattr(device, "id"):
        return device
    kind, _, index = device.partition(":") if isinstance(device, str) else ("", "", "")
    if kind not in ("cpu", "gpu", "cuda") or (index and not index.isdigit()):
        raise AccumcheckError(f"check: device {device!r} is not a device name (cpu, gpu, cuda, gpu:N, cuda:N) or a "
                              "jax device")
    platform = "cpu" if kind == "cpu" else "gpu"
    try:
        devices = jax.devices(platform)
    except RuntimeError:
        devices = []
    if int(index or 0) >= len(devices):
        raise AccumcheckError(f"check: device {device!r}: jax {jax.__version__} sees {len(devices)} {platform} "
                              "device(s) here; pass one it sees, or leave device out")
    return devices[int(index or 0)]


def device_name(device: Any) -> str:
    return "cpu" if device.platform == "cpu" else f"gpu:{device.id}"


def devices_of(arrays: dict[str, Any]) -> str:
    """Where ``arrays`` are, as a report names it ("cpu", "gpu:0", or several, sorted)."""
    return ", ".join(sorted({device_name(d) for array in arrays.values() for d in array.devices()}))


def has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False

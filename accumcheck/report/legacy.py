"""Reports written by accumcheck 0.1.0 (schema version 1), read as the current schema.

Version 1 kept the full-batch and data-parallel results, the requested device, the accumulation
mode and the MXNet hybridize flag as keys of ``settings``, and no run options; version 2 has typed
fields for the results and the options in ``config``. The upgrade rebuilds both.
"""

from __future__ import annotations

import tomllib
from typing import Any

from ..options.choices import MODES

_SETUP_KEYS = ("world_size", "backend", "launcher", "reduce_dtype", "find_unused_parameters", "hosts", "fault_rank",
               "native", "manual", "reference", "micro_batches")


def upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """A version-1 report of any kind as version-2 data."""
    data = dict(data, schema_version=2)
    kind = data.get("kind")
    if kind in ("cross", "sweep"):
        data["reports"] = [upgrade(r) for r in data.get("reports", [])]
        if kind == "cross" and not data.get("forward"):
            data["forward"] = None
        return data
    if kind == "trajectory":
        return data
    return _upgrade_report(data)


def _upgrade_report(data: dict[str, Any]) -> dict[str, Any]:
    settings = dict(data.get("settings", {}))
    full_batch = settings.pop("full_batch", None)
    parallel = settings.pop("data_parallel", None)
    requested = settings.pop("requested_device", data.get("device"))
    mode = settings.pop("mode", "native")
    skipped = settings.pop("inject_skipped", None)
    notes = []
    if "hybridize" in settings:
        notes.append("hybridized" if settings["hybridize"] else "imperative")
    if settings.get("oracle"):
        notes.append(f"oracle {settings['oracle']}")
    if mode == "eval":
        notes.append("model in eval mode")
    if skipped:
        notes.append(f"fault not injected: {skipped}")
    if parallel is not None:
        parallel = {"setup": {k: parallel.get(k) for k in _SETUP_KEYS}, "ranks": parallel.get("ranks", []),
                    "ranks_agree": parallel.get("ranks_agree"), "final_identical": parallel.get("final_identical"),
                    "single_process": parallel.get("single_process")}
    data.update(kind="report", settings=settings, notes=notes, full_batch=full_batch, data_parallel=parallel,
                config=_config(data, settings, requested, mode, full_batch, parallel))
    return data


def _config(data: dict[str, Any], settings: dict[str, Any], requested: str, mode: str,
            full_batch: dict | None, parallel: dict | None) -> dict[str, Any]:
    """The options a version-1 report's run was given, as far as it tells them."""
    source = str(data.get("case_source", ""))
    if source.startswith("<user model"):
        return {"model": data.get("case")}
    setup = parallel["setup"] if parallel else None
    inject = data["inject"].split("@")[0] if data.get("inject") else None
    reduction = data.get("loss_reduction", "mean")
    return {
        "framework": data.get("framework"), "device": requested,
        "case": data.get("case") if source.startswith("case ") else source,
        "accum_steps": data.get("accum_steps"), "seed": data.get("seed"), "oracle": data.get("oracle", False),
        "full_batch": full_batch is not None,
        "loss_reduction": reduction if full_batch is not None or reduction != _case_reduction(data.get("case_toml", ""))
        else None,
        "inject": inject,
        "world_size": setup["world_size"] if setup else None,
        "reduce_dtype": setup["reduce_dtype"] if setup else "float32",
        "inject_rank": setup["fault_rank"] if setup and inject and setup.get("fault_rank") else None,
        # version 1 recorded the dtype that accumulated: float32 for a GradAccumulator mode
        "dtype": data.get("param_dtype", "float32") if mode in ("native", "eval") else "float32",
        "accum_dtype": data.get("accum_dtype", "float32"),
        "mode": mode if mode in MODES else "native",
        "grad_norms": None,
        "backend_options": {"hybridize": False} if settings.get("hybridize") is False else {},
    }


def _case_reduction(case_toml: str) -> str | None:
    try:
        return tomllib.loads(case_toml).get("loss", {}).get("reduction", "mean")
    except tomllib.TOMLDecodeError:
        return None

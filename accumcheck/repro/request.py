"""``accumcheck compare --repro FILE.py``: the smallest reproduction for an upstream bug report.

The script (written by the framework's backend, ``Backend.repro_source``) imports only its
framework and numpy; its data goes beside it as FILE.npz: the case's initial weights
(``weights/NAME``) and every micro-batch (``inputs/K``, ``labels/K`` and ``gates/K``, whether
micro-batch K takes each conditional branch). With ``--shrink`` the smallest case that still
shows the finding goes beside them as FILE.toml (``accumcheck.repro.shrink``). This module is the
framework-free part: what may be written, where, and the data.
"""

from __future__ import annotations

import io
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..case.definition import Case
from ..errors import AccumcheckError
from ..files import check_output_file, check_replaceable, write_atomic
from ..run.backend import Backend
from ..run.config import RunConfig
from ..run.registry import backend_names, get_backend
from .script import check_fault_kind

SUFFIX = ".py"


@dataclass(frozen=True)
class ReproFiles:
    """The files of one reproduction: the script, its data and (after a shrink) the case."""

    script: Path
    data: Path
    case: Path
    shrunk: bool = False  # whether the case was written

    def says(self) -> str:
        """One line for whoever asked: what was written, and how to run it."""
        case = f", the case {self.case}" if self.shrunk else ""
        return f"reproduction written: {self.script} (with {self.data}{case}); run it with: python {self.script}"


def repro_files(path: str | Path) -> ReproFiles:
    """The script ``path`` (a .py file) and the files beside it (same stem)."""
    script = Path(path)
    if script.suffix != SUFFIX or not script.stem:
        raise AccumcheckError(f"--repro {path}: give the script a .py name, such as repro.py (its data goes beside "
                              "it as repro.npz)")
    return ReproFiles(script, script.with_suffix(".npz"), script.with_suffix(".toml"))


def writers() -> list[str]:
    """The backends that write reproduction scripts."""
    return [name for name in backend_names() if writes_repro(get_backend(name, installed=False))]


def writes_repro(backend: Backend) -> bool:
    return type(backend).repro_source is not Backend.repro_source


def check_request(config: RunConfig, path: str | Path | None, shrink: bool) -> ReproFiles | None:
    """Refuse, before anything runs, a reproduction that could not be written: ``--shrink``
    without ``--repro``, a run the script cannot stand for (two frameworks, data parallel, other
    dtypes or modes, a fault it cannot carry) and paths that could not take the files. Returns
    the files, or None without ``--repro``."""
    if path is None:
        if shrink:
            raise AccumcheckError("--shrink: shrinks the case of a --repro script; add --repro repro.py")
        return None
    files = repro_files(path)
    flag = f"--repro {path}"
    if len(config.frameworks) > 1:
        raise AccumcheckError(f"{flag}: a script reproduces one framework's run; give one --framework")
    if config.world_size is not None:
        raise AccumcheckError(f"{flag}: a script reproduces a single-process run; drop --world-size "
                              "(and run it outside torchrun)")
    for option, value, default, what in (
            ("--dtype", config.dtype, "float32", "float32 parameters"),
            ("--accum-dtype", config.accum_dtype, "float32", "a float32 manual buffer"),
            ("--mode", config.mode, "native", "the framework's own accumulation (--mode native)")):
        if value != default:
            raise AccumcheckError(f"{flag}: a script reproduces {what}; drop {option} {value}")
    if config.fault is not None:
        check_fault_kind(config.fault.kind)
    backend = get_backend(config.framework)
    if not writes_repro(backend):
        raise AccumcheckError(f"{flag}: the {backend.name} backend writes no reproduction scripts; use --framework "
                              f"{' or '.join(writers()) or 'NAME of one that does'}")
    check_output_file("--repro", files.script)
    check_output_file("--repro", files.data)
    if shrink:
        check_output_file("--repro", files.case)
    for other in (files.script, files.data) + ((files.case,) if shrink else ()):
        check_replaceable(other)
    return files


def case_arrays(case: Case, accum_steps: int) -> dict[str, np.ndarray]:
    """What the script reads: ``weights/NAME`` (float32), and per micro-step K ``inputs/K``,
    ``labels/K`` (int64, -100 where padding) and ``gates/K`` (bool: whether micro-batch K
    takes each conditional branch, in depth-first order; empty without conditional layers)."""
    arrays = {f"weights/{name}": value for name, value in case.weights().items()}
    for k in range(accum_steps):
        batch = case.batch(k)
        arrays[f"inputs/{k}"] = batch.inputs
        arrays[f"labels/{k}"] = batch.labels
        arrays[f"gates/{k}"] = np.array(case.gates(batch.index), dtype=bool)
    return arrays


def write_data(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """``arrays`` as a compressed .npz at ``path``, replaced atomically."""
    try:
        _write_bytes(path, arrays)
    except OSError as exc:
        raise AccumcheckError(f"--repro: cannot write {path} ({exc.strerror}); choose another path") from None


def _write_bytes(path: Path, arrays: dict[str, np.ndarray]) -> None:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    check_replaceable(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as handle:
            handle.write(buffer.getvalue())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write(files: ReproFiles, config: RunConfig, report: Any, shrunk_from: str | None = None) -> None:
    """Write the script of ``config``'s run (its ``report``) and its data."""
    if report.case_source.startswith("<user model"):
        raise AccumcheckError("--repro: a script reproduces a built-in case or case file, not your own model")
    source = get_backend(config.framework).repro_source(config, report, files.script.name, files.data.name,
                                                        shrunk_from)
    write_data(files.data, case_arrays(config.case, config.accum_steps))
    write_text(files.script, source)


def write_text(path: Path, text: str) -> None:
    """``text`` to ``path`` atomically; AccumcheckError naming it where it cannot be written."""
    try:
        write_atomic(path, text)
    except OSError as exc:
        raise AccumcheckError(f"--repro: cannot write {path} ({exc.strerror}); choose another path") from None


def target_of(report: Any, fault_param: str | None) -> tuple[str, str] | None:
    """The tensor a report is about, (name, kind): the fault's parameter where it is flagged,
    else the first flagged tensor; None when nothing is flagged."""
    flagged = report.flagged
    if not flagged:
        return None
    chosen = next((t for t in flagged if t.name == fault_param), flagged[0])
    return chosen.name, chosen.kind

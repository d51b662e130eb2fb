"""Report files: read any report kind (of this schema or an older one), write atomically."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ..errors import AccumcheckError
from .cross import CrossReport
from .single import Report
from .sweep import SweepReport
from .trajectory import TrajectoryReport
from .values import SCHEMA_VERSION

KINDS: dict[str, type] = {"report": Report, "cross": CrossReport, "sweep": SweepReport, "trajectory": TrajectoryReport}
_NAMES = {"report": "", "cross": " cross-framework", "sweep": " sweep", "trajectory": " trajectory"}


def report_from_data(data: Any, source: str = "<report>") -> Any:
    """The report ``data`` (a JSON object) holds, of whichever kind it names. Reports of
    schema version 1 (accumcheck 0.1.0) are upgraded. Raises AccumcheckError when it is none."""
    if not isinstance(data, dict):
        raise AccumcheckError(f"{source}: not an accumcheck report (top level is not an object)")
    version = data.get("schema_version")
    if version not in (1, SCHEMA_VERSION):
        raise AccumcheckError(f"{source}: report schema_version {version!r} is not supported "
                              f"(this accumcheck reads versions 1 and {SCHEMA_VERSION}); "
                              "re-run the comparison with this version")
    kind = data.get("kind", "report")
    if kind not in KINDS:
        raise AccumcheckError(f"{source}: unknown report kind {kind!r} (known: {', '.join(KINDS)})")
    try:
        return KINDS[kind].from_dict(data, source)
    except (TypeError, KeyError, AttributeError) as exc:
        raise AccumcheckError(f"{source}: not an accumcheck{_NAMES[kind]} report ({exc})") from None


def load_report(path: str | Path) -> Any:
    """Read a report written with ``--format json`` (any kind). Raises AccumcheckError when it
    cannot."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise AccumcheckError(f"{path}: cannot read report: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise AccumcheckError(f"{path}: not JSON ({exc.msg} at line {exc.lineno}); "
                              "pass a report written with --format json") from None
    return report_from_data(data, str(path))


def write_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.fchmod(fd, 0o666 & ~umask)  # as open() would create it, not mkstemp's 0600
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

"""The files accumcheck reads and writes, handled so that nothing is misread or lost.

Reading: only regular files, up to a size cap, as UTF-8 (a device such as /dev/zero, a FIFO or a
10 GB file is refused in one line, not read without end). Writing: every output location is
checked before any work (its folder exists and takes a new file, found by creating one, which
also holds for root and read-only mounts); a file is replaced atomically and only where it is a
regular file (a symlink, FIFO or device node is left as it is); and a result whose final write
fails is saved to a rescue file whose path the error names. Names that come from case files are
made safe before they become file names.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from pathlib import Path

from .errors import AccumcheckError

MAX_CASE_BYTES = 1 << 20  # a case file: a few hundred lines of TOML at most
MAX_REPORT_BYTES = 256 << 20  # a report: per-tensor figures, never per-element data


def read_text(path: str | Path, what: str, limit: int) -> str:
    """The text of the regular file ``path`` (a ``what``: "case file", "report"), at most
    ``limit`` bytes of UTF-8. Raises AccumcheckError naming the file and the fix."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise AccumcheckError(f"{path}: cannot read {what}: {exc.strerror}") from None
    if stat.S_ISDIR(info.st_mode):
        raise AccumcheckError(f"{path}: is a folder; give a {what}")
    if not stat.S_ISREG(info.st_mode):
        raise AccumcheckError(f"{path}: is {_kind(info.st_mode)}, not a regular file; give a {what}")
    try:
        with open(path, "rb") as handle:
            data = handle.read(limit + 1)  # a file that grows while read stops here too
    except OSError as exc:
        raise AccumcheckError(f"{path}: cannot read {what}: {exc.strerror}") from None
    if len(data) > limit:
        raise AccumcheckError(f"{path}: larger than any {what} ({size_text(max(info.st_size, len(data)))}; "
                              f"at most {size_text(limit)}); give a {what}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise AccumcheckError(f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                              f"save the {what} as UTF-8") from None


def check_output_file(flag: str, path: str | Path) -> None:
    """Fail before any work when ``path`` (given as ``flag``) could not take a regular file."""
    path = Path(path)
    try:
        info = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # said below, of its folder
        info = None
    except OSError as exc:
        raise AccumcheckError(f"{flag} {path}: cannot be written ({exc.strerror}); choose another path") from None
    if info is not None and stat.S_ISDIR(info.st_mode):
        raise AccumcheckError(f"{flag} {path}: is a folder; give a file name")
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise AccumcheckError(f"{flag} {path}: is {_kind(info.st_mode)}; accumcheck replaces only regular files "
                              "(atomically), so give the path of a regular file"
                              + (" (or leave --output out to print to stdout)" if flag == "--output" else ""))
    parent = path.parent
    if not parent.is_dir():
        what = "is not a folder" if parent.exists() else "does not exist"
        raise AccumcheckError(f"{flag} {path}: folder {parent} {what}; create it or choose another path")
    _probe(flag, path, parent)


def check_output_folder(flag: str, path: str | Path) -> None:
    """Fail before any work when folder ``path`` (created when missing) could not take new
    files."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise AccumcheckError(f"{flag} {path}: is a file; give a folder (it is created if missing)")
    existing = path
    while not existing.exists():
        if existing.is_symlink():  # a link to nowhere: creating the folder would fail
            raise AccumcheckError(f"{flag} {path}: {existing} is a broken symbolic link; choose another folder")
        existing = existing.parent
    if not existing.is_dir():
        raise AccumcheckError(f"{flag} {path}: {existing} is a file, not a folder; choose another folder")
    _probe(flag, path, existing)


def _probe(flag: str, path: Path, folder: Path) -> None:
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".accumcheck-probe-"):
            pass
    except OSError as exc:
        raise AccumcheckError(f"{flag} {path}: folder {folder} takes no new files ({exc.strerror}); "
                              "choose another path") from None


def write_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one. Only a
    regular file (or nothing) is replaced: anything else raises AccumcheckError untouched."""
    path = Path(path)
    check_replaceable(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.fchmod(fd, 0o666 & ~umask)  # as open() would create it, not mkstemp's 0600
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        check_replaceable(path)  # it may have changed since
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_replaceable(path: Path) -> None:
    """Raise AccumcheckError when ``path`` exists and is not a regular file."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise AccumcheckError(f"{path}: is {_kind(mode)}; accumcheck replaces only regular files")


def write_or_rescue(flag: str, path: str | Path, text: str, what: str = "report") -> None:
    """``write_atomic``; when it fails, the text goes to a rescue file in the temporary folder
    and the AccumcheckError raised names it, so that no computed result is lost."""
    try:
        write_atomic(path, text)
    except (OSError, AccumcheckError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise AccumcheckError(f"{flag} {path}: cannot write ({reason}); {rescue(text, Path(path).suffix, what)}") \
            from None


def rescue(text: str, suffix: str, what: str = "report") -> str:
    """Save ``text`` to a new file in the temporary folder; returns a sentence saying where."""
    try:
        fd, saved = tempfile.mkstemp(prefix=f"accumcheck-{what.replace(' ', '-')}-", suffix=suffix or ".txt")
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
    except OSError as exc:
        return f"the {what} could not be rescued either ({exc.strerror} in {tempfile.gettempdir()})"
    return f"the {what} was saved to {saved} instead"


def safe_file_name(name: str) -> str:
    """``name`` (say a case's name from a case file) as one file name: no folder separators, no
    leading dots, nothing but letters, digits, '.', '-' and '_'."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).lstrip(".") or "unnamed"


def _kind(mode: int) -> str:
    for test, word in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return word
    return "not a regular file"


def size_text(n: float) -> str:
    """A number of bytes as people read it: 300.0 MiB."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"

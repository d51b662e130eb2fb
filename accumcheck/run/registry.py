"""Where backends come from: the ``accumcheck.backends`` entry-point group, where each entry
names a Backend class (accumcheck's own are declared in its pyproject.toml; another package adds
one the same way, as pytest-randomly lets third parties plug in), and any class registered in
this process with ``register_backend``. Loading a backend imports its module, not its framework.
"""

from __future__ import annotations

import functools
import importlib.metadata
import tomllib
from pathlib import Path

from ..errors import AccumcheckError
from ..options.spec import Option
from .backend import Backend

ENTRY_POINT_GROUP = "accumcheck.backends"

_registered: dict[str, type[Backend]] = {}
_instances: dict[str, Backend] = {}


def register_backend(backend: type[Backend]) -> None:
    """Make ``backend`` (a Backend subclass) available as ``--framework backend.name`` in this
    process, beside (or instead of) the entry point of the same name."""
    if not (isinstance(backend, type) and issubclass(backend, Backend) and backend.name):
        raise AccumcheckError(f"register_backend: {backend!r} is not a Backend subclass with a name")
    _registered[backend.name] = backend
    _instances.pop(backend.name, None)


@functools.cache
def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """The group's entry points (read once a process: reading scans every installed package)."""
    found = {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    try:
        importlib.metadata.distribution("accumcheck")
    except importlib.metadata.PackageNotFoundError:  # run from a source checkout, not installed
        found = {**_declared_in_checkout(), **found}
    return found


def _declared_in_checkout() -> dict[str, importlib.metadata.EntryPoint]:
    """accumcheck's own backends as its pyproject.toml declares them, beside the package."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if not pyproject.is_file():
        return {}
    declared = tomllib.loads(pyproject.read_text()).get("project", {}).get("entry-points", {})
    return {name: importlib.metadata.EntryPoint(name, value, ENTRY_POINT_GROUP)
            for name, value in declared.get(ENTRY_POINT_GROUP, {}).items()}


def backend_names() -> list[str]:
    """Every backend known here, installed framework or not, sorted."""
    return sorted(set(_entry_points()) | set(_registered))


def get_backend(name: str, installed: bool = True) -> Backend:
    """The backend called ``name``. Raises AccumcheckError when none is, or (``installed``) when
    its framework is not installed."""
    if name not in _instances:
        found = _registered.get(name)
        if found is None:
            entry = _entry_points().get(name)
            if entry is None:
                raise AccumcheckError(f"--framework: unknown framework {name!r}; choose one of "
                                      f"{', '.join(backend_names())}")
            try:
                found = entry.load()
            except Exception as exc:  # a third party's module: say which and why, in one line
                raise AccumcheckError(f"--framework {name}: its backend ({entry.value}) cannot be loaded: "
                                      f"{type(exc).__name__}: {exc}") from None
        _instances[name] = found()
    backend = _instances[name]
    if installed and not backend.available():
        raise AccumcheckError(f"--framework {name}: {backend.package} is not installed; {backend.install}")
    return backend


def installed_backends() -> list[str]:
    """The backends whose framework is installed, in their order of preference."""
    found = [get_backend(name, installed=False) for name in backend_names()]
    return [b.name for b in sorted(found, key=lambda b: (b.preference, b.name)) if b.available()]


def default_backend() -> str:
    """The backend a run takes when none is named: the first installed, by preference."""
    installed = installed_backends()
    if not installed:
        hints = "; ".join(get_backend(name, installed=False).install for name in backend_names())
        raise AccumcheckError(f"--framework: no framework is installed ({hints})")
    return installed[0]


def backend_options() -> dict[str, tuple[str, Option]]:
    """Every backend's own options: option name -> (the first backend declaring it, the Option)."""
    found: dict[str, tuple[str, Option]] = {}
    for name in backend_names():
        for option in get_backend(name, installed=False).capabilities.options:
            found.setdefault(option.name, (name, option))
    return found

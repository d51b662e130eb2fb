"""``accumcheck check FILE.py[:FUNCTION]``: your own model from a Python file. The function
(default ``accumcheck_setup``) returns the keyword arguments of the model's framework's check
(``accumcheck.<framework>.check``, one shape for every framework: at least ``model`` and
``batches``; JAX's ``params``, ``loss_fn`` and ``batches``); the framework is the backend that owns
the model's class, or the parameters' arrays. A keyword a check took under an old name (MXNet's
``block`` and ``ctx``) is refused in one line naming the new one.

The file is imported, and its function called, with ``sys.argv`` set to ``[FILE.py]`` (a
module-level ``parse_args()`` sees none of accumcheck's own flags) and their standard output and
error taken aside: what they print goes to stderr once they return, so that stdout holds the
report alone. Whatever they raise, ``sys.exit()`` and argparse's exits included, is one
UserCodeError naming the file or the function."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Callable

from ..errors import USER_EXCEPTIONS, AccumcheckError, UserCodeError, first_line
from .backend import Backend
from .checkargs import shape_of
from .registry import backend_names, get_backend

DEFAULT_FUNCTION = "accumcheck_setup"


def user_check(model: Any, what: str = "check", second: Any = None) -> tuple[str, Callable[..., Any]]:
    """The framework of ``model`` and its check (``accumcheck.<framework>.check``), told by the
    model's class, or by the arrays of parameters (JAX's pytree), without importing a framework.
    ``second``, the call's next argument: a loss function followed by its parameters (JAX's former
    order) reaches their framework's check, which names the order it takes."""
    for name in backend_names():
        backend = get_backend(name, installed=False)
        if backend.owns(model) or backend.owns_parameters(model) or (
                second is not None and callable(model) and backend.owns_parameters(second)):
            check = get_backend(name).model_check()  # now installed for certain: the model is one
            if check is None:
                break
            return name, check
    able = [n for n in backend_names() if get_backend(n, installed=False).model_check is not Backend.model_check]
    arrays = [n for n in backend_names() if get_backend(n, installed=False).array_packages]
    parameters = f", or the {' or '.join(arrays)} parameters of a loss function" if arrays else ""
    raise AccumcheckError(f"{what}: {type(model).__name__} is not a model of a framework accumcheck checks here "
                          f"({', '.join(able)}); pass a model of one of them{parameters}")


def load_setup(target: str) -> dict[str, Any]:
    """The keyword arguments FILE.py:FUNCTION returns. Raises AccumcheckError, in one line, for a
    missing file or function, or a result that is not a mapping with ``model`` and ``batches``;
    UserCodeError for a file or function that raises or exits."""
    path_text, _, function = target.partition(":") if not Path(target).is_file() else (target, "", "")
    function = function or DEFAULT_FUNCTION
    path = Path(path_text)
    if path.suffix != ".py" or not path.is_file():
        raise AccumcheckError(f"check {target}: {path_text} is not a Python file here; give FILE.py or "
                              f"FILE.py:FUNCTION (default function: {DEFAULT_FUNCTION})")
    module = _import(path)
    make = getattr(module, function, None)
    if not callable(make):
        raise AccumcheckError(f"check {target}: {path.name} defines no function {function!r}; define it, or name "
                              f"yours as {path_text}:NAME")
    try:
        with _as_a_script(path) as printed:
            setup = make()
    except USER_EXCEPTIONS as exc:
        raise _raised(f"check {target}: {function}()", exc, printed,
                      "a setup function returns check's arguments as a dict; return them instead of exiting") from exc
    if not isinstance(setup, Mapping) or "batches" not in setup or not {"model", "params"} & set(setup):
        if isinstance(setup, Mapping):
            _refuse_renamed(setup, f"check {target}: {function}() returned")
        raise AccumcheckError(f"check {target}: {function}() must return a dict of check's arguments with at least "
                              f"'model' (JAX: 'params' and 'loss_fn') and 'batches', got {type(setup).__name__}"
                              + (f" with {', '.join(map(str, setup))}" if isinstance(setup, Mapping) else ""))
    return dict(setup)


def _refuse_renamed(setup: Mapping[str, Any], what: str) -> None:
    """The one line naming the new name of a key that a check took under an old name (MXNet's
    ``block``), where a value of the setup is a framework's model."""
    for value in setup.values():
        try:
            check = user_check(value, what)[1]
        except AccumcheckError:
            continue
        shape = shape_of(check)
        if shape is not None:
            shape.refuse_renamed(setup, what)


def run_setup(target: str, setup: dict[str, Any], overrides: dict[str, Any], progress: Any = None) -> Any:
    """The check of ``setup``'s model with the command line's ``overrides``; its Report records
    the command that reruns it."""
    setup = dict(setup)
    if "model" in setup and "params" in setup:
        raise AccumcheckError(f"check {target}: the setup returns both 'model' and 'params'; return the model "
                              "(JAX: its params) as one of them")
    model = setup.pop("model") if "model" in setup else setup.pop("params")
    framework, check = user_check(model, f"check {target}")
    shape = shape_of(check)
    if shape is not None:
        shape.refuse_renamed(setup, f"check {target}")
    _, *accepted = inspect.signature(check).parameters  # after the model (JAX's: the parameters)
    for name in list(setup) + list(overrides):
        if name not in accepted:
            flag = "--" + name.replace("_", "-")
            raise AccumcheckError(f"check {target}: {flag if name in overrides else repr(name)} is not an argument of "
                                  f"accumcheck.{framework}.check "
                                  f"(it takes {', '.join(sorted(accepted))})")
    report = check(model, **{**setup, **overrides, "progress": progress})
    report.config["setup"] = target
    report.config["command_options"] = {k: v for k, v in overrides.items() if v is not None}
    return report


def _import(path: Path) -> Any:
    name = f"accumcheck_setup_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.resolve().parent))  # the file's own imports of its neighbours
    sys.modules[name] = module  # as an import has it (dataclasses and pickle look the module up there)
    try:
        with _as_a_script(path) as printed:
            spec.loader.exec_module(module)
    except USER_EXCEPTIONS as exc:
        sys.modules.pop(name, None)
        raise _raised(f"check {path}: importing it", exc, printed,
                      "accumcheck imports the file with no command-line arguments (sys.argv = [the file]): put "
                      "the script's own command-line handling under if __name__ == '__main__':, or give every flag "
                      "a default") from exc
    finally:
        sys.path.remove(str(path.resolve().parent))
    return module


@contextlib.contextmanager
def _as_a_script(path: Path) -> Iterator[io.StringIO]:
    """The user's file run with ``sys.argv == [path]`` and its stdout and stderr taken aside
    (yielded); what it printed goes to stderr afterwards, unless it raised (then the error names
    its last line)."""
    argv, printed = sys.argv, io.StringIO()
    sys.argv = [str(path)]
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            yield printed
    finally:
        sys.argv = argv
    sys.stderr.write(printed.getvalue())


def _raised(what: str, exc: BaseException, printed: io.StringIO, exit_hint: str) -> UserCodeError:
    """The one-line error for ``what`` (the import, the setup function) raising ``exc``: an exit
    also names the last line it printed (argparse's error) and ``exit_hint``."""
    if not isinstance(exc, SystemExit):
        return UserCodeError(f"{what} raised {type(exc).__name__}: {first_line(exc)}")
    lines = [line.strip() for line in printed.getvalue().splitlines() if line.strip()]
    said = f" after printing {lines[-1][:200]!r}" if lines else ""
    return UserCodeError(f"{what} exited (SystemExit, {first_line(exc)}){said}; {exit_hint}")

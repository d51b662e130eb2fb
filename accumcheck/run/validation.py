"""Build a RunConfig from options given by name, checked once, in one place.

The command line, the pytest plugin and the Python API all end here: each value is checked by its
Option's rule, the case is found (its seed and loss normalisation applied), the number of
micro-steps and the fault are resolved, and the combination is held against every chosen
backend's Capabilities. Whatever cannot run is refused before anything runs, in one line that
names the option, the backend where one is to blame, and the fix.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..case.definition import Case
from ..case.reading import resolve_case
from ..errors import AccumcheckError
from ..files import check_output_folder, size_text
from ..options.spec import OPTIONS_BY_NAME, RUN_OPTIONS, Option
from .backend import Backend
from .budget import UNBUDGETED
from .config import RunConfig
from .faults import Fault, parse_fault, resolve_fault
from .launch import launched_world_size
from .registry import backend_names, backend_options, default_backend, get_backend
from .resources import check_resources, estimate

# What an option needs, said to whoever gives it without: option name -> the hint.
_REQUIREMENTS = {
    "world_size": "applies to data-parallel runs; add --world-size W",
    "inject": "names the rank of an --inject fault; add --inject KIND",
}


def configure(options: Mapping[str, Any], only: tuple[str, ...] | None = None, what: str = "compare") -> RunConfig:
    """The RunConfig that ``options`` (option name -> value; None or absent: the default) make.
    ``only`` names the run options a command takes (``what``: the command, for the message).
    Raises AccumcheckError for an unknown option, a bad value, an unknown or missing framework,
    a malformed case file, or a combination some chosen backend cannot run."""
    if only is not None:
        for name, value in options.items():
            if name not in only and value is not None:
                raise AccumcheckError(f"--{name.replace('_', '-')}: accumcheck {what} does not take it "
                                      f"(it takes {', '.join('--' + n.replace('_', '-') for n in only)})")
    values, extras = _checked(options)
    frameworks = tuple(dict.fromkeys(values["framework"] or (default_backend(),)))
    backends = [get_backend(name) for name in frameworks]
    case = resolve_case(values["case"])
    if values["seed"] is not None:
        case = case.with_seed(values["seed"])
    if values["loss_reduction"] is not None:
        case = case.with_reduction(values["loss_reduction"])
    steps = values["accum_steps"] or case.accum_steps
    fault = _fault(values["inject"], case, steps)
    _check_combination(values, extras, backends)
    for backend in backends:
        missing = sorted({layer.type for layer in case.all_layers()} - set(backend.capabilities.layer_types))
        if missing:
            raise AccumcheckError(f"--case {case.name}: the {backend.name} backend builds no {', '.join(missing)} "
                                  f"layers (it builds {', '.join(backend.capabilities.layer_types)}); use a case "
                                  "without them or another --framework")
    if values["full_batch"] and case.conditional_layers():
        raise AccumcheckError(f"--full-batch: case {case.name!r} routes each micro-batch through its conditional "
                              "layers on its own, so the whole batch has no single route; drop --full-batch")
    if values["strict"] and values["fail_on"] not in ("marginal", "suspicious"):
        raise AccumcheckError(f"--strict fails on suspicious tensors, --fail-on {values['fail_on']} only on "
                              "decisive ones: give one of the two")
    rank = values["inject_rank"]
    if rank is not None and rank >= values["world_size"]:
        raise AccumcheckError(f"--inject-rank {rank}: ranks are 0..{values['world_size'] - 1}")
    if values["grad_norms"] is not None:
        check_output_folder("--grad-norms", values["grad_norms"])
    need = estimate(case, steps, oracle=values["oracle"] or len(frameworks) > 1, full_batch=values["full_batch"],
                    world_size=values["world_size"], memory_budget=values["memory_budget"])
    check_resources(need, f"--case {case.name} at --accum-steps {steps}", force=values["force"],
                    launched=launched_world_size() is not None)
    return RunConfig(
        case=case, accum_steps=steps, frameworks=frameworks, device=values["device"], fault=fault,
        oracle=values["oracle"], full_batch=values["full_batch"], loss_reduction=values["loss_reduction"],
        world_size=values["world_size"], reduce_dtype=values["reduce_dtype"], inject_rank=rank,
        dtype=values["dtype"], accum_dtype=values["accum_dtype"], mode=values["mode"],
        memory_budget=values["memory_budget"],
        grad_norms=None if values["grad_norms"] is None else str(values["grad_norms"]), force=values["force"],
        fail_on="suspicious" if values["strict"] else values["fail_on"], backend_options=tuple(extras.items()))


def _checked(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each value checked by its option's rule: (run options with defaults filled in, the
    backend options that were given)."""
    extra = backend_options()
    values = {option.name: option.default for option in RUN_OPTIONS}
    extras: dict[str, Any] = {}
    for name, value in options.items():
        option = OPTIONS_BY_NAME.get(name) or extra.get(name, (None, None))[1]
        if option is None:
            known = ", ".join([*OPTIONS_BY_NAME, *extra])
            raise AccumcheckError(f"unknown option {name!r}; the options are {known}")
        if value is None:
            continue
        if isinstance(value, (Case, Fault)):  # already made: taken as it is
            values[name] = value
            continue
        (values if name in OPTIONS_BY_NAME else extras)[name] = _valid(option, value)
    return values, extras


def _valid(option: Option, value: Any) -> Any:
    try:
        return option.validate(value)
    except ValueError as exc:
        raise AccumcheckError(f"--{option.flag}: {exc}") from None


def _fault(inject: str | Fault | None, case: Any, steps: int) -> Fault | None:
    if inject is None:
        return None
    fault = parse_fault(inject) if isinstance(inject, str) else inject
    return resolve_fault(fault, [(p.name, p.kind) for p in case.parameters()], steps)


def _given(option: Option, values: Mapping[str, Any]) -> bool:
    return values[option.name] is not None and values[option.name] != option.default


def _check_combination(values: dict[str, Any], extras: dict[str, Any], backends: list[Backend]) -> None:
    given = [option for option in RUN_OPTIONS if _given(option, values)]
    for option in given:
        missing = [name for name in option.requires if values[name] is None]
        if missing:
            raise AccumcheckError(f"{option.as_flag(values[option.name])}: {_REQUIREMENTS[missing[0]]}")
    if len(backends) > 1:
        for option in given:
            if option.one_framework:
                raise AccumcheckError(f"{option.as_flag(values[option.name])}: works with one framework at a time; "
                                      "run each --framework on its own")
    for backend in backends:
        caps = backend.capabilities
        for option in given:
            if not caps.admits(option, values[option.name]):
                raise AccumcheckError(_refusal(backend, option, values[option.name]))
            if values["world_size"] is not None and option.name in caps.single_process_only:
                why = caps.why_not.get("single_process_only", "data-parallel runs do not take it")
                raise AccumcheckError(f"{option.as_flag(values[option.name])}: not available with --world-size "
                                      f"on the {backend.name} backend ({why})")
    if values["memory_budget"] is not None:
        budget = f"--memory-budget {size_text(values['memory_budget'])}"
        for name, why in UNBUDGETED.items():
            if _given(OPTIONS_BY_NAME[name], values):
                raise AccumcheckError(f"{budget}: not with {OPTIONS_BY_NAME[name].as_flag(values[name])} ({why}, "
                                      "beyond any budget); drop one of the two")
    owners = {option.name for backend in backends for option in backend.capabilities.options}
    for name, value in extras.items():
        if name not in owners:
            owner, option = backend_options()[name]
            raise AccumcheckError(f"{option.as_flag(value)}: an option of the {owner} backend; "
                                  f"--framework {','.join(b.name for b in backends)} has no such option")


def _refusal(backend: Backend, option: Option, value: Any) -> str:
    why = backend.capabilities.why_not.get(option.name)
    others = [name for name in backend_names() if name != backend.name
              and get_backend(name, installed=False).capabilities.admits(option, value)]
    fix = f"use --framework {' or '.join(others)}" if others else f"drop --{option.flag}"
    return (f"{option.as_flag(value)}: not available with the {backend.name} backend"
            + (f" ({why})" if why else "") + f"; {fix}")

def checked_values(options: Mapping[str, Any], spec: tuple[Option, ...]) -> dict[str, Any]:
    """``options`` checked against ``spec`` (a command's own options), defaults filled in."""
    known = {option.name: option for option in spec}
    values = {option.name: option.default for option in spec}
    for name, value in options.items():
        if name not in known:
            raise AccumcheckError(f"unknown option {name!r}; the options are {', '.join(known)}")
        if value is not None:
            values[name] = _valid(known[name], value)
    return values

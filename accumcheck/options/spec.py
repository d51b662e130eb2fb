"""The options themselves: one ``Option`` per setting, shared by the command line, the pytest
plugin and the Python API (``accumcheck.options`` says how), ``RUN_OPTIONS`` for a comparison, and
``command_line`` and ``stack_command``, the commands that rerun a run from a report."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .choices import ACCUM_DTYPES, DTYPES, FAIL_ON, FAULT_KINDS, MODES, REDUCTIONS
from .values import (
    byte_count,
    case_argument,
    comma_list,
    device_text,
    fault_text,
    framework_names,
    non_negative_int,
    positive_float,
    positive_int,
    seed_value,
    text,
)

Check = Callable[[Any], Any]  # a Python value -> the value; raises ValueError saying what is wrong


@dataclass(frozen=True)
class Option:
    """One setting. ``name`` is its keyword (the Python API, RunConfig's field); ``flag`` its
    command-line name without dashes (``accum-steps``: ``--accum-steps`` on the command line,
    ``--accum-steps`` in pytest too, where every flag starts with ``--accum-``).

    ``check`` validates a value, given as a Python value or as command-line text (default: any
    value; ``choices`` are checked first). ``switch`` options are booleans (``--oracle`` /
    ``--no-oracle``). ``capability`` names the field of a backend's Capabilities that must admit a
    value other than the default; ``requires`` the options without which this one means nothing;
    ``one_framework`` refuses it when two frameworks are compared. ``pytest`` is "list" when the
    plugin offers it as a comma list (one test run per item), "value" when as one value, None
    when not at all. ``reproduce`` says when a reproduce line carries it: "always", "changed"
    (when not the default) or "never"."""

    name: str
    flag: str
    help: str
    default: Any = None
    check: Check | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    switch: bool = False
    capability: str | None = None
    requires: tuple[str, ...] = ()
    one_framework: bool = False
    pytest: str | None = None
    reproduce: str = "changed"

    def validate(self, value: Any) -> Any:
        """``value`` checked (None stays None where the default is None). Raises ValueError."""
        if value is None and self.default is None:
            return None
        if self.switch:
            if not isinstance(value, bool):
                raise ValueError(f"{value!r} is not True or False")
            return value
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{value!r} is not one of {', '.join(self.choices)}")
        return self.check(value) if self.check is not None else value

    def as_flag(self, value: Any) -> str:
        """How the command line writes this option with ``value``."""
        return _flag(self.flag, value)

    def from_text(self, text: str) -> Any:
        """Command-line text as a value; raises argparse.ArgumentTypeError with the reason."""
        try:
            return self.validate(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    def add_to(self, add_argument: Callable[..., Any], prefix: str = "--", as_list: bool = False,
               default: Any = ..., help_suffix: str = "") -> None:
        """Declare the option through ``add_argument`` (argparse's ``add_argument`` or pytest's
        ``addoption``) as ``prefix + flag``; ``as_list`` takes a comma list. ``default``
        overrides the option's own default (backend options are declared unset, None)."""
        default = self.default if default is ... else default
        # pytest's prefix already says "accum-": --accum-steps, not --accum-accum-steps
        word = prefix.strip("-")
        flag = self.flag[len(word) + 1:] if word and self.flag.startswith(word + "-") else self.flag
        shown = "" if default is None else " (default: %(default)s)"
        text = self.help + help_suffix + shown
        if self.switch:
            add_argument(prefix + flag, action=argparse.BooleanOptionalAction, default=default, help=text)
            return
        parse = comma_list(self.from_text) if as_list else self.from_text
        add_argument(prefix + flag, type=parse, default=default, metavar=self.metavar or _metavar(self), help=text)


def _metavar(option: Option) -> str:
    return "|".join(option.choices) if option.choices else option.flag.upper().replace("-", "_")


# ----------------------------------------------------------------------------- the run options
# Every option of a comparison, in the order a reproduce line gives them.


RUN_OPTIONS: tuple[Option, ...] = (
    Option("framework", "framework", "a framework, or two comma-separated to compare them too; the default is the "
           "first installed", check=framework_names, metavar="NAME[,NAME]", pytest="list", reproduce="always"),
    Option("device", "device", "cpu, gpu, cuda or cuda:N", default="cpu", check=device_text, metavar="DEV",
           pytest="list", reproduce="always"),
    Option("case", "case", "a built-in case (see `accumcheck cases`) or a case .toml file", default="embed-attention",
           check=case_argument, metavar="NAME|PATH", pytest="list", reproduce="always"),
    Option("accum_steps", "accum-steps", "micro-steps to accumulate (default: the case's own)", check=positive_int,
           metavar="N", pytest="list", reproduce="always"),
    Option("seed", "seed", "override the case's seed (0 to 2**32 - 1)", check=seed_value, metavar="S",
           reproduce="always"),
    Option("oracle", "oracle", "also run the whole model in float64", default=False, switch=True,
           capability="oracle"),
    Option("full_batch", "full-batch", "also compare with the whole batch's gradient in one backward pass "
           "(float64)", default=False, switch=True, capability="full_batch", one_framework=True),
    Option("loss_reduction", "loss-reduction", "override the case's loss normalisation (token_count: divide by "
           "the accumulation's tokens)", choices=REDUCTIONS),
    Option("inject", "inject", f"perturb the native accumulation: {', '.join(FAULT_KINDS)}", check=fault_text,
           metavar="KIND[:PARAM]"),
    Option("repro", "repro", "also write FILE (a .py name) as a standalone script that reproduces this run with the "
           "framework and numpy alone, its data beside it (FILE.npz), for a bug report", check=text, metavar="FILE",
           one_framework=True, reproduce="never"),
    Option("shrink", "shrink", "with --repro: first shrink the case (layers, widths, N, batch, sequence) while a "
           "tensor stays flagged, and write the smallest case beside the script (FILE.toml)", default=False,
           switch=True, one_framework=True, reproduce="never"),
    Option("world_size", "world-size", "run data-parallel on W ranks: native accumulation across ranks against "
           "an all-reduce every micro-step and one process over the same micro-batches (default: one process; "
           "under torchrun: its WORLD_SIZE)", check=positive_int, metavar="W", capability="data_parallel",
           one_framework=True, pytest="value"),
    Option("reduce_dtype", "reduce-dtype", "with --world-size: the dtype of the all-reduce", default="float32",
           choices=DTYPES, capability="reduce_dtypes", requires=("world_size",), one_framework=True),
    Option("inject_rank", "inject-rank", "with --world-size: the rank whose native accumulation --inject perturbs "
           "(default: 0)", check=non_negative_int, metavar="R", requires=("world_size", "inject"),
           one_framework=True),
    Option("dtype", "dtype", "parameters and gradients, so the native accumulation", default="float32",
           choices=DTYPES, capability="dtypes", one_framework=True),
    Option("accum_dtype", "accum-dtype", "the manual buffer", default="float32", choices=ACCUM_DTYPES,
           capability="accum_dtypes", one_framework=True),
    Option("mode", "mode", "what is compared with the manual buffer: the framework's own accumulation, or its "
           "GradAccumulator, plain or compensated", default="native", choices=MODES, capability="modes",
           one_framework=True),
    Option("memory_budget", "memory-budget", "hold at most BYTES beside the model (e.g. 512M, 2G, 1.5GiB): the "
           "tensors are judged in groups that fit, the micro-steps run again for each group (slower; default: all "
           "at once)", check=byte_count, metavar="BYTES", capability="memory_budget", one_framework=True,
           pytest="value"),
    Option("grad_norms", "grad-norms", "also log each mode's per-layer gradient norms to TensorBoard event files "
           "in DIR", check=text, metavar="DIR", one_framework=True, reproduce="never"),
    Option("force", "force", "run although the estimate says it needs more memory than is available, or more "
           "ranks than there are cores", default=False, switch=True),
    Option("fail_on", "fail-on", "what fails the run (exit 1): suspicious tensors too, every flagged tensor "
           "(marginal, the default) or only the decisive ones (diverged: more than 10x past the bound, or a "
           "single-step fault)", default="marginal", choices=FAIL_ON, pytest="value"),
    Option("strict", "strict", "fail on suspicious tensors too (the same as --fail-on suspicious)", default=False,
           switch=True, pytest="value"),
)
OPTIONS_BY_NAME = {option.name: option for option in RUN_OPTIONS}

# ``accumcheck train``: its own options, and the run options it takes.
TRAIN_OPTIONS: tuple[Option, ...] = (
    Option("steps", "steps", "optimizer steps", default=20, check=positive_int, metavar="K"),
    Option("optimizer", "optimizer", "the optimizer", default="adam", choices=("adam", "sgd")),
    Option("lr", "lr", "learning rate", default=1e-3, check=positive_float, metavar="LR"),
)
TRAIN_RUN_OPTIONS = ("framework", "device", "case", "accum_steps", "seed", "inject", "oracle", "force", "dtype")


def command_line(record: dict[str, Any], command: str = "accumcheck compare") -> str:
    """The command that reruns a comparison whose ``RunConfig.record()`` is ``record``."""
    parts = [command]
    for option in RUN_OPTIONS:
        if option.name not in record or option.reproduce == "never":
            continue
        value = record[option.name]
        if value is None or (option.reproduce == "changed" and value == option.default):
            continue
        parts.append(_flag(option.flag, value))
    parts += [_flag(name.replace("_", "-"), value) for name, value in record.get("backend_options", {}).items()]
    return " ".join(parts)


def _flag(flag: str, value: Any) -> str:
    if isinstance(value, bool):
        return f"--{flag}" if value else f"--no-{flag}"
    return f"--{flag} {value}"


def add_options(add_argument: Callable[..., Any], options: Iterable[Option], prefix: str = "--",
                as_lists: bool = False) -> None:
    """Declare ``options`` through ``add_argument`` (argparse or pytest's ``addoption``).
    ``as_lists`` declares them as the plugin does: unset by default, and a comma list for the
    options it runs once per item."""
    for option in options:
        option.add_to(add_argument, prefix, as_list=as_lists and option.pytest == "list",
                      default=None if as_lists else ...)


def stack_command(stack: str, case: str, accum_steps: int, batches: int | None = None, fault: str | None = None,
                  world_size: int = 1) -> str:
    """The command that reruns ``accumcheck stack`` on a built-in case."""
    return " ".join(["accumcheck stack", f"--stack {stack}", f"--case {case}", f"--accum-steps {accum_steps}"] +
                    ([f"--batches {batches}"] if batches is not None else []) + ([f"--fault {fault}"] if fault else []) +
                    ([f"--world-size {world_size}"] if world_size > 1 else []))

"""Strict reading: every value of a report checked against the schema, each failure naming its field.

Three layers, each raising ``FieldError`` with the path of the field (``tensors[0].verdict``):

- ``check_data``, on the JSON before it is decoded: text that is not Unicode (a lone surrogate),
  integers past 64 bits or past the JSON parser's digit limit (``parse_int``), anywhere.
- ``values.decode``: each field of the type its dataclass hint says.
- ``check``, on the decoded report: each number and word against ``FIELDS`` (the words a field may
  hold, the least value of a number; by default an int is 0 or more and a float is not negative,
  nan and inf allowed: the figures of a non-finite tensor are), then how fields must agree with one
  another (``RELATIONS``: list lengths, indices in range, pairs of the frameworks listed, verdicts
  their own figures allow).

Every report accumcheck writes passes all three; a report edited by hand, cut short, or written by
a newer accumcheck with words this one does not know, does not.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable

from ..bounds import UNIT_ROUNDOFF
from ..options.choices import FAIL_ON
from .cross import CROSS_VERDICTS, Agreement, CrossReport, OddOneOut
from .single import DataParallelResult, DataParallelSetup, FullBatchResult, Report
from .stack import REFERENCES, StackReport, StackStep
from .sweep import SweepReport
from .tensor import (
    CAUSE_KINDS,
    COMPARED_MODES,
    FLAGGED_VERDICTS,
    KIND_ORDER,
    MARGINAL_RATIO,
    NEARER,
    SEVERITIES,
    VERDICTS,
    Cause,
    TensorResult,
)
from .trajectory import TrajectoryReport
from .values import SCHEMA_VERSION, FieldError, Where, path_text, shown

INT_LIMIT = 2**63  # no count, index, seed or size accumcheck writes comes near it
DTYPES = tuple(UNIT_ROUNDOFF)
FIX = "pass the report as accumcheck wrote it"
NEWER = "upgrade accumcheck if a newer one wrote the report, else pass the report as accumcheck wrote it"


@dataclass(frozen=True)
class LongInteger:
    """An integer the JSON parser would not convert (past ``sys.get_int_max_str_digits``), kept as
    its digit count so that ``check_data`` can name the field that holds it."""

    digits: int


def parse_int(text: str) -> int | LongInteger:
    """``json.loads``'s ``parse_int``: the integer, or a LongInteger where it is too long to convert."""
    try:
        return int(text)
    except ValueError:
        return LongInteger(len(text.lstrip("-")))


def check_data(data: Any) -> None:
    """Refuse, naming the field, any text (or object key) in ``data`` that is not Unicode, and any
    integer past 64 bits or left unconverted by ``parse_int``."""
    stack: list[tuple[Where, Any]] = [(None, data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                place = (where, key, not isinstance(key, str))
                if isinstance(key, str) and not key.isascii():
                    _unicode(place, key, "its name")
                stack.append((place, item))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if type(item) is not float:  # most of a report: its figures, which need nothing
                    stack.append(((where, i, False), item))
        elif type(value) is str:
            if not value.isascii():
                _unicode(where, value)
        elif type(value) is int:
            if not -INT_LIMIT <= value < INT_LIMIT:
                raise FieldError(path_text(where), f"an integer of about {int(value.bit_length() * 0.30103) + 1} "
                                 "digits, past the 64 bits any figure of a report fits in", FIX)
        elif isinstance(value, LongInteger):
            raise FieldError(path_text(where), f"an integer of {value.digits} digits, longer than any figure of a "
                             "report", FIX)


def _unicode(where: Where, text: str, what: str = "the text") -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise FieldError(path_text(where), f"{what} holds {text[exc.start]!r} at character {exc.start}, a lone "
                         "surrogate, which is not Unicode text", FIX) from None


# ---------------------------------------------------------------------------------------- values

Rule = Callable[[Any], "str | None"]  # a value's problem, or None


def one_of(words: tuple[Any, ...]) -> Rule:
    """The value is one of ``words``."""
    def rule(value: Any) -> str | None:
        if value in words:
            return None
        return f"{shown(value)} is not one of {', '.join(map(str, words))}"
    rule.fix = NEWER  # type: ignore[attr-defined]  # a word this accumcheck does not know
    return rule


def at_least(low: float, finite: bool = False) -> Rule:
    """The value is ``low`` or more (nan passes unless ``finite``; so does inf)."""
    def rule(value: Any) -> str | None:
        if finite and not math.isfinite(value):
            return f"{value!r} is not a finite number"
        if value < low:
            return f"{value!r} is negative" if low == 0 else f"{value!r} is less than {low}"
        return None
    return rule


def signed(value: Any) -> str | None:
    """Any number: a loss, a factor."""
    return None


def worst_mode(value: str) -> str | None:
    """Where a tensor's worst ratio is: a mode, and in a data-parallel run also the single-process
    reference, native against it, or a rank's own total (``accumcheck.judge.dataparallel``)."""
    rank = value.removeprefix("rank ")
    if rank != value and rank.isascii() and rank.isdigit():
        return None
    return one_of((*COMPARED_MODES, "single-process", "native vs single-process", "rank <n>"))(value)


worst_mode.fix = NEWER  # type: ignore[attr-defined]
NATURAL = at_least(0)  # every int unless FIELDS says otherwise: counts, indices, steps
MAGNITUDE = at_least(0.0)  # every float unless FIELDS says otherwise: errors, ratios, norms
POSITIVE_INT = at_least(1)
SETTING = at_least(0.0, finite=True)  # tolerances, allowances, times: never nan

# What a field's type does not say. A rule applies to the field's value, or to every number or
# word inside it (the items of a list, the values of an object).
FIELDS: dict[type, dict[str, Rule]] = {
    TensorResult: {"kind": one_of(KIND_ORDER), "dtype": one_of(DTYPES), "verdict": one_of(VERDICTS),
                   "worst_mode": worst_mode, "nearer": one_of(NEARER), "severity": one_of(SEVERITIES),
                   "classic_rtol": SETTING, "classic_atol": SETTING},
    Cause: {"kind": one_of(CAUSE_KINDS), "mode": one_of(COMPARED_MODES), "dtype": one_of(DTYPES),
            "factor": signed, "grad_scale": signed},
    Report: {"kind": one_of(("report",)), "schema_version": one_of((SCHEMA_VERSION,)),
             "param_dtype": one_of(DTYPES), "accum_dtype": one_of(DTYPES), "accum_steps": POSITIVE_INT,
             "seed": at_least(-1),  # -1: a user's own model, seeded by the user
             "losses": signed, "seconds": SETTING, "groups": POSITIVE_INT},
    FullBatchResult: {"tolerance": SETTING, "factor_tolerance": SETTING, "factor": signed, "tensor_factors": signed,
                      "factor_min": signed, "factor_max": signed},
    DataParallelSetup: {"world_size": POSITIVE_INT, "reduce_dtype": one_of(DTYPES)},
    Agreement: {"kind": one_of(KIND_ORDER), "verdict": one_of(CROSS_VERDICTS)},
    OddOneOut: {"kind": one_of(KIND_ORDER)},
    CrossReport: {"kind": one_of(("cross",)), "allowance": SETTING},
    SweepReport: {"kind": one_of(("sweep",))},
    TrajectoryReport: {"kind": one_of(("trajectory",)), "lr": at_least(0.0, finite=True),
                       "accum_steps": POSITIVE_INT, "losses": signed, "margin": at_least(1.0, finite=True)},
    StackReport: {"kind": one_of(("stack",)), "accum_steps": POSITIVE_INT, "precision": one_of(DTYPES),
                  "tolerance": SETTING},
    StackStep: {"reference": one_of(REFERENCES)},
}


def check(report: Any) -> None:
    """Refuse, naming the field, any value of the decoded ``report`` the schema does not allow."""
    _check_dataclass(report, None)


def _check_dataclass(obj: Any, where: Where) -> None:
    for name, checker in _plan(type(obj)):
        checker(getattr(obj, name), (where, name, False))
    relation = RELATIONS.get(type(obj))
    if relation is not None:
        relation(obj, where)


Checker = Callable[[Any, Where], None]


@functools.cache
def _plan(cls: type) -> list[tuple[str, Checker]]:
    """Each field of ``cls`` that has something to check, with its checker (made once per class)."""
    hints, rules = typing.get_type_hints(cls), FIELDS.get(cls, {})
    plan = [(f.name, _checker(hints[f.name], rules.get(f.name))) for f in dataclasses.fields(cls)]
    return [(name, checker) for name, checker in plan if checker is not None]


@functools.cache
def _checker(hint: Any, rule: Rule | None) -> Checker | None:
    """A function that checks a value of type ``hint`` (and every number or word inside it) against
    ``rule``, or its type's default; None where there is nothing to check."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        check = _checker(inner[0], rule) if len(inner) == 1 else None
        return None if check is None else lambda value, where: None if value is None else check(value, where)
    if dataclasses.is_dataclass(hint):
        return _check_dataclass
    if origin is list and args:
        item = _checker(args[0], rule)
        return None if item is None else lambda value, where: _each(item, enumerate(value), where, False)
    if origin is dict and args:
        entry = _checker(args[1], rule)
        return None if entry is None else lambda value, where: _each(entry, value.items(), where, True)
    rule = (rule or {int: NATURAL, float: MAGNITUDE}.get(hint)) if hint in (int, float, str) else None
    if rule is None:
        return None
    fix = getattr(rule, "fix", FIX)

    def scalar(value: Any, where: Where) -> None:
        problem = rule(value)
        if problem:
            raise FieldError(path_text(where), problem, fix)
    return scalar


def _each(check: Checker, items: Any, where: Where, entry: bool) -> None:
    for key, value in items:
        check(value, (where, key, entry))


# ------------------------------------------------------------------------------------- relations


def _at(where: Where, *steps: Any) -> Where:
    """``where`` some steps deeper: field names and list indices (strings and ints), object
    entries by key (a string in a tuple: ``("native",)``)."""
    for step in steps:
        where = (where, step[0], True) if isinstance(step, tuple) else (where, step, False)
    return where


def _fail(where: Where, *steps: Any, problem: str, fix: str = FIX) -> None:
    raise FieldError(path_text(_at(where, *steps)), problem, fix)


def _index_in(shape: list[int], index: list[int], where: Where, name: str) -> None:
    """``index`` (none: []) points into ``shape``."""
    if index and (len(index) != len(shape) or any(not 0 <= i < n for i, n in zip(index, shape))):
        _fail(where, name, problem=f"{index} is not an index into shape {shape}")


def _tensor(t: TensorResult, where: Where) -> None:
    if t.numel != math.prod(t.shape):
        _fail(where, "numel", problem=f"{t.numel} is not the size of shape {t.shape} ({math.prod(t.shape)})")
    for name in ("mismatched", "classic_mismatched", "over_bound_native", "over_bound_manual", "nonfinite_native",
                 "nonfinite_manual"):
        if getattr(t, name) > t.numel:
            _fail(where, name, problem=f"{getattr(t, name)} is more than the tensor's {t.numel} elements")
    _index_in(t.shape, t.max_abs_diff_index, where, "max_abs_diff_index")
    _index_in(t.shape, t.worst_index, where, "worst_index")
    if t.ratio_map_cell is not None and len(t.ratio_map_cell) != 2:
        _fail(where, "ratio_map_cell", problem=f"{t.ratio_map_cell} is not [rows, columns]")
    # Verdicts their own figures allow (``accumcheck.judge.verdicts``): identical modes differ
    # nowhere (both may still be far from E); round-off (and suspicious, a round-off tensor the
    # second pass singled out) is within the bound; no-gradient had none in any micro-step; an inf
    # or nan in E is one in both modes (they sum the same micro-gradients); a severity is a flagged
    # tensor's.
    if t.verdict == "identical" and t.mismatched:
        _fail(where, "verdict", problem=f"'identical' with {t.mismatched} elements where native and manual differ")
    if t.verdict in ("round-off", "suspicious") and not t.ratio <= 1.0:
        _fail(where, "verdict", problem=f"{t.verdict!r} with ratio {t.ratio:.3g} to the bound (past 1: not round-off)")
    if t.verdict == "no-gradient" and t.steps_with_grad != 0:
        _fail(where, "verdict", problem="'no-gradient' on a tensor with a gradient in " + (
            "every micro-step" if t.steps_with_grad is None else f"{t.steps_with_grad} micro-steps"))
    if t.verdict in ("non-finite", "overflow") and not t.nonfinite_native + t.nonfinite_manual:
        _fail(where, "verdict", problem=f"{t.verdict!r} with no inf or nan in either mode")
    if t.severity is not None and t.verdict not in FLAGGED_VERDICTS:
        _fail(where, "severity", problem=f"{t.severity!r} on a tensor not flagged ({t.verdict!r})")
    if t.severity == "marginal" and not t.ratio <= MARGINAL_RATIO:
        _fail(where, "severity", problem=f"'marginal' with ratio {t.ratio:.3g} (marginal is within "
              f"{MARGINAL_RATIO:g})")


def _report(r: Report, where: Where) -> None:
    seen: set[str] = set()
    for i, t in enumerate(r.tensors):
        if t.name in seen:
            _fail(where, "tensors", i, "name", problem=f"{t.name!r} is listed twice")
        seen.add(t.name)
        if t.steps_with_grad is not None and t.steps_with_grad > r.accum_steps:
            _fail(where, "tensors", i, "steps_with_grad",
                  problem=f"{t.steps_with_grad} is more than the {r.accum_steps} micro-steps")
        if t.cause is not None and t.cause.step is not None and t.cause.step >= r.accum_steps:
            _fail(where, "tensors", i, "cause", "step",
                  problem=f"{t.cause.step} is not one of the {r.accum_steps} micro-steps (counted from 0)")
    fail_on = r.config.get("fail_on")
    if fail_on is not None and fail_on not in FAIL_ON:  # the run's policy: it decides the exit code
        _fail(where, "config", ("fail_on",), problem=one_of(FAIL_ON)(fail_on) or "", fix=NEWER)
    for mode in COMPARED_MODES:
        bound = r.bound.get(mode)
        relative = bound.get("relative") if isinstance(bound, dict) else None
        if isinstance(relative, bool) or not isinstance(relative, (int, float)) or not relative >= 0:
            _fail(where, "bound", (mode,),
                  problem="expected an object with the bound's relative factor ('relative', 0 or more)")
    if r.data_parallel is not None:
        _data_parallel(r.data_parallel, r.tensors, _at(where, "data_parallel"))


def _data_parallel(d: DataParallelResult, tensors: list[TensorResult], where: Where) -> None:
    world = d.setup.world_size
    if d.setup.fault_rank is not None and d.setup.fault_rank >= world:
        _fail(where, "setup", "fault_rank", problem=f"{d.setup.fault_rank} is not a rank of {world}")
    ranks = [v.rank for v in d.ranks]
    names = {t.name for t in tensors}
    for i, v in enumerate(d.ranks):
        if v.rank >= world or v.rank in ranks[:i]:
            _fail(where, "ranks", i, "rank", problem=f"{v.rank} is not a rank of {world}, or is listed twice")
        for name in v.flagged:
            if name not in names:
                _fail(where, "ranks", i, "flagged", problem=f"{name!r} is not a tensor of the report")
    for t in tensors:
        if any(rank not in ranks for rank in t.flagged_ranks or []):
            _fail(where, "ranks", problem=f"tensor {t.name!r} names rank(s) {t.flagged_ranks}, not all of them listed")
        for name in ("rank_local_ratios", "rank_final_ratios"):
            if getattr(t, name) is not None and len(getattr(t, name)) != len(ranks):
                _fail(where, "ranks", problem=f"tensor {t.name!r} has {len(getattr(t, name))} {name}, not one per "
                      f"rank ({len(ranks)})")


def _full_batch(f: FullBatchResult, where: Where) -> None:
    # ``accumcheck.judge.fullbatch``: equivalent within the tolerance, or a factor within the factor
    # tolerance of 1; a constant factor is not equivalent.
    near_one = f.factor is not None and f.factor_tolerance is not None and abs(f.factor - 1.0) <= f.factor_tolerance
    if f.equivalent and not (f.max_relative_difference <= f.tolerance or near_one):
        _fail(where, "equivalent", problem=f"true with a difference of {f.max_relative_difference:.3g} past the "
              f"tolerance {f.tolerance:.3g} and no factor near 1")
    if f.equivalent and f.constant:
        _fail(where, "constant", problem="true on an equivalent result (a constant factor is one other than 1)")


def _agreement(a: Agreement, where: Where) -> None:
    _index_in(a.shape, a.max_abs_diff_index, where, "max_abs_diff_index")
    _index_in(a.shape, a.worst_index, where, "worst_index")
    if a.verdict == "identical" and a.max_abs_diff != 0:
        _fail(where, "verdict", problem=f"'identical' with a difference of {a.max_abs_diff:.3g}")
    if a.verdict in ("identical", "agree") and not a.ratio <= 1.0:
        _fail(where, "verdict", problem=f"{a.verdict!r} with ratio {a.ratio:.3g} to the bound (past 1: they "
              "disagree)")


def _cross(c: CrossReport, where: Where) -> None:
    frameworks = c.frameworks
    if len(frameworks) < 2 or len(set(frameworks)) != len(frameworks):
        _fail(where, "frameworks", problem=f"{frameworks} is not two or more frameworks, each once")
    if len(c.reports) != len(frameworks):
        _fail(where, "reports", problem=f"{len(c.reports)} report{'s' * (len(c.reports) != 1)} for the "
              f"{len(frameworks)} frameworks listed")
    for i, (name, report) in enumerate(zip(frameworks, c.reports)):
        if report.framework != name:
            _fail(where, "reports", i, "framework", problem=f"{report.framework!r}, where frameworks lists {name!r}")
    pairs = [list(p) for p in itertools.combinations(frameworks, 2)]

    def pair(place: Where, value: list[str] | None) -> None:
        if value is not None and value not in pairs:
            _fail(place, "frameworks", problem=f"{value} is not a pair of the frameworks listed "
                  f"({', '.join(frameworks)}), in their order")

    for i, forward in enumerate(c.forwards()):
        first = i == 0 and c.forward is not None
        pair(_at(where, "forward") if first else _at(where, "forward_rest", i - (c.forward is not None)),
             forward.frameworks)
    labelled = [a.frameworks is not None for a in c.agreement]
    if any(labelled) and not all(labelled):
        _fail(where, "agreement", problem="some records name their frameworks and some do not")
    names = {f: [t.name for t in r.tensors] for f, r in zip(frameworks, c.reports)}
    for i, a in enumerate(c.agreement):
        pair(_at(where, "agreement", i), a.frameworks)
        first = (a.frameworks or frameworks)[0]
        if a.name not in names[first]:
            _fail(where, "agreement", i, "name", problem=f"{a.name!r} is not a tensor of the {first} report")
    if all(labelled):  # every pair compares every tensor, once
        found = [(tuple(a.frameworks or ()), a.name) for a in c.agreement]
        wanted = [(tuple(p), name) for p in pairs for name in names[p[0]]]
        if sorted(found) != sorted(wanted):
            missing = sorted(set(wanted) - set(found))
            said = f"no record of {missing[0][1]!r} in {' vs '.join(missing[0][0])}" if missing else \
                "a record listed twice"
            _fail(where, "agreement", problem=f"not one record per tensor and pair of frameworks ({said})")
    for i, odd in enumerate(c.odd_one_out):
        if odd.framework is not None and odd.framework not in frameworks:
            _fail(where, "odd_one_out", i, "framework", problem=f"{odd.framework!r} is not one of the frameworks "
                  "listed")
        for j, disagreeing in enumerate(odd.disagreeing):
            if sorted(disagreeing) not in [sorted(p) for p in pairs]:
                _fail(where, "odd_one_out", i, "disagreeing", j,
                      problem=f"{disagreeing} is not a pair of the frameworks listed")


def _stack(s: StackReport, where: Where) -> None:
    for i, step in enumerate(s.steps):
        if not step.micro_batches:
            _fail(where, "steps", i, "micro_batches", problem="empty: an optimizer step's window holds one "
                  "micro-batch or more")
    if len(set(s.unstepped)) != len(s.unstepped) or any(i >= s.micro_batches_seen for i in s.unstepped):
        _fail(where, "unstepped", problem=f"not distinct micro-batches of the {s.micro_batches_seen} seen")


def _trajectory(t: TrajectoryReport, where: Where) -> None:
    def fail(*steps: Any, problem: str) -> None:
        _fail(where, *steps, problem=problem)
    t.check_relations(fail)


RELATIONS: dict[type, Callable[[Any, Where], None]] = {
    TensorResult: _tensor, Report: _report, FullBatchResult: _full_batch, Agreement: _agreement,
    CrossReport: _cross, StackReport: _stack, TrajectoryReport: _trajectory,
}

__all__ = ["FIELDS", "INT_LIMIT", "RELATIONS", "LongInteger", "check", "check_data", "one_of", "parse_int"]

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
from ..options import FAIL_ON
from .cross import CROSS_VERDICTS, Agreement, CrossReport, OddOneOut
from .single import DataParallelResult, DataParallelSetup, FullBatchResult, Report
from .stack import StackReport
from .sweep import SweepReport
from .tensor import (CAUSE_KINDS, COMPARED_MODES, FLAGGED_VERDICTS, KIND_ORDER, MARGINAL_RATIO, NEARER, SEVERITIES,
                     VERDICTS, Cause, TensorResult)
from .trajectory import TrajectoryReport
from .values import SCHEMA_VERSION, FieldError, field_path, key_path, shown

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
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            _unicode(path, value)
        elif isinstance(value, LongInteger):
            raise FieldError(path, f"an integer of {value.digits} digits, longer than any figure of a report", FIX)
        elif isinstance(value, int) and not isinstance(value, bool) and not -INT_LIMIT <= value < INT_LIMIT:
            raise FieldError(path, f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits, past the "
                             "64 bits any figure of a report fits in", FIX)
        elif isinstance(value, dict):
            for key, item in value.items():
                where = field_path(path, key) if isinstance(key, str) else key_path(path, key)
                if isinstance(key, str):
                    _unicode(where, key, "its name")
                stack.append((where, item))
        elif isinstance(value, list):
            stack.extend((field_path(path, i), item) for i, item in enumerate(value))


def _unicode(path: str, text: str, what: str = "the text") -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise FieldError(path, f"{what} holds {text[exc.start]!r} at character {exc.start}, a lone surrogate, "
                         "which is not Unicode text", FIX) from None


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
                       "accum_steps": POSITIVE_INT, "losses": signed},
    StackReport: {"kind": one_of(("stack",)), "accum_steps": POSITIVE_INT, "precision": one_of(DTYPES),
                  "tolerance": SETTING},
}


def check(report: Any) -> None:
    """Refuse, naming the field, any value of the decoded ``report`` the schema does not allow."""
    _check_dataclass(report, "")


def _check_dataclass(obj: Any, path: str) -> None:
    cls = type(obj)
    rules = FIELDS.get(cls, {})
    for f in dataclasses.fields(cls):
        _check_value(_hints(cls)[f.name], getattr(obj, f.name), field_path(path, f.name), rules.get(f.name))
    relation = RELATIONS.get(cls)
    if relation is not None:
        relation(obj, path)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_value(hint: Any, value: Any, path: str, rule: Rule | None) -> None:
    if value is None:
        return
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            _check_value(inner[0], value, path, rule)
        return
    if dataclasses.is_dataclass(hint):
        _check_dataclass(value, path)
    elif origin is list and args:
        for i, item in enumerate(value):
            _check_value(args[0], item, field_path(path, i), rule)
    elif origin is dict and args and args[1] is not Any:
        for key, item in value.items():
            _check_value(args[1], item, key_path(path, key), rule)
    elif hint is int or hint is float or hint is str:
        rule = rule or {int: NATURAL, float: MAGNITUDE}.get(hint)
        problem = rule(value) if rule is not None else None
        if problem:
            raise FieldError(path, problem, getattr(rule, "fix", FIX))


# ------------------------------------------------------------------------------------- relations


def _item(path: str, name: str, i: int) -> str:
    """The path of item ``i`` of list field ``name``."""
    return field_path(field_path(path, name), i)


def _fail(path: str, name: str | int, problem: str) -> None:
    raise FieldError(field_path(path, name), problem, FIX)


def _index_in(shape: list[int], index: list[int], path: str, name: str) -> None:
    """``index`` (none: []) points into ``shape``."""
    if index and (len(index) != len(shape) or any(not 0 <= i < n for i, n in zip(index, shape))):
        _fail(path, name, f"{index} is not an index into shape {shape}")


def _tensor(t: TensorResult, path: str) -> None:
    if t.numel != math.prod(t.shape):
        _fail(path, "numel", f"{t.numel} is not the size of shape {t.shape} ({math.prod(t.shape)})")
    for name in ("mismatched", "classic_mismatched", "over_bound_native", "over_bound_manual", "nonfinite_native",
                 "nonfinite_manual"):
        if getattr(t, name) > t.numel:
            _fail(path, name, f"{getattr(t, name)} is more than the tensor's {t.numel} elements")
    _index_in(t.shape, t.max_abs_diff_index, path, "max_abs_diff_index")
    _index_in(t.shape, t.worst_index, path, "worst_index")
    if t.ratio_map_cell is not None and len(t.ratio_map_cell) != 2:
        _fail(path, "ratio_map_cell", f"{t.ratio_map_cell} is not [rows, columns]")
    # Verdicts their own figures allow (``accumcheck.judge.verdicts``): identical modes differ
    # nowhere (both may still be far from E); round-off (and suspicious, a round-off tensor the
    # second pass singled out) is within the bound; no-gradient had none in any micro-step; an inf
    # or nan in E is one in both modes (they sum the same micro-gradients); a severity is a flagged
    # tensor's.
    if t.verdict == "identical" and t.mismatched:
        _fail(path, "verdict", f"'identical' with {t.mismatched} elements where native and manual differ")
    if t.verdict in ("round-off", "suspicious") and not t.ratio <= 1.0:
        _fail(path, "verdict", f"{t.verdict!r} with ratio {t.ratio:.3g} to the bound (past 1: not round-off)")
    if t.verdict == "no-gradient" and t.steps_with_grad != 0:
        _fail(path, "verdict", "'no-gradient' on a tensor with a gradient in " + (
            "every micro-step" if t.steps_with_grad is None else f"{t.steps_with_grad} micro-steps"))
    if t.verdict in ("non-finite", "overflow") and not t.nonfinite_native + t.nonfinite_manual:
        _fail(path, "verdict", f"{t.verdict!r} with no inf or nan in either mode")
    if t.severity is not None and t.verdict not in FLAGGED_VERDICTS:
        _fail(path, "severity", f"{t.severity!r} on a tensor not flagged ({t.verdict!r})")
    if t.severity == "marginal" and not t.ratio <= MARGINAL_RATIO:
        _fail(path, "severity", f"'marginal' with ratio {t.ratio:.3g} (marginal is within {MARGINAL_RATIO:g})")


def _report(r: Report, path: str) -> None:
    names = [t.name for t in r.tensors]
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            _fail(_item(path, "tensors", i), "name", f"{name!r} is listed twice")
        seen.add(name)
    for i, t in enumerate(r.tensors):
        where = _item(path, "tensors", i)
        if t.steps_with_grad is not None and t.steps_with_grad > r.accum_steps:
            _fail(where, "steps_with_grad", f"{t.steps_with_grad} is more than the {r.accum_steps} micro-steps")
        if t.cause is not None and t.cause.step is not None and t.cause.step >= r.accum_steps:
            _fail(field_path(where, "cause"), "step", f"{t.cause.step} is not one of the {r.accum_steps} "
                  "micro-steps (counted from 0)")
    fail_on = r.config.get("fail_on")
    if fail_on is not None and fail_on not in FAIL_ON:  # the run's policy: it decides the exit code
        raise FieldError(key_path(field_path(path, "config"), "fail_on"), one_of(FAIL_ON)(fail_on) or "", NEWER)
    for mode in COMPARED_MODES:
        bound = r.bound.get(mode)
        relative = bound.get("relative") if isinstance(bound, dict) else None
        if isinstance(relative, bool) or not isinstance(relative, (int, float)) or not relative >= 0:
            raise FieldError(key_path(field_path(path, "bound"), mode),
                             "expected an object with the bound's relative factor ('relative', 0 or more)")
    if r.data_parallel is not None:
        _data_parallel(r.data_parallel, r.tensors, field_path(path, "data_parallel"))


def _data_parallel(d: DataParallelResult, tensors: list[TensorResult], path: str) -> None:
    world = d.setup.world_size
    if d.setup.fault_rank is not None and d.setup.fault_rank >= world:
        _fail(field_path(path, "setup"), "fault_rank", f"{d.setup.fault_rank} is not a rank of {world}")
    ranks = [v.rank for v in d.ranks]
    names = {t.name for t in tensors}
    for i, v in enumerate(d.ranks):
        where = _item(path, "ranks", i)
        if v.rank >= world or v.rank in ranks[:i]:
            _fail(where, "rank", f"{v.rank} is not a rank of {world}, or is listed twice")
        for name in v.flagged:
            if name not in names:
                _fail(where, "flagged", f"{name!r} is not a tensor of the report")
    for t in tensors:
        if any(rank not in ranks for rank in t.flagged_ranks or []):
            _fail(path, "ranks", f"tensor {t.name!r} names rank(s) {t.flagged_ranks}, not all of them listed")
        for name in ("rank_local_ratios", "rank_final_ratios"):
            if getattr(t, name) is not None and len(getattr(t, name)) != len(ranks):
                _fail(path, "ranks", f"tensor {t.name!r} has {len(getattr(t, name))} {name}, not one per rank "
                      f"({len(ranks)})")


def _full_batch(f: FullBatchResult, path: str) -> None:
    # ``accumcheck.judge.fullbatch``: equivalent within the tolerance, or a factor within the factor
    # tolerance of 1; a constant factor is not equivalent.
    near_one = f.factor is not None and f.factor_tolerance is not None and abs(f.factor - 1.0) <= f.factor_tolerance
    if f.equivalent and not (f.max_relative_difference <= f.tolerance or near_one):
        _fail(path, "equivalent", f"true with a difference of {f.max_relative_difference:.3g} past the tolerance "
              f"{f.tolerance:.3g} and no factor near 1")
    if f.equivalent and f.constant:
        _fail(path, "constant", "true on an equivalent result (a constant factor is one other than 1)")


def _agreement(a: Agreement, path: str) -> None:
    _index_in(a.shape, a.max_abs_diff_index, path, "max_abs_diff_index")
    _index_in(a.shape, a.worst_index, path, "worst_index")
    if a.verdict == "identical" and a.max_abs_diff != 0:
        _fail(path, "verdict", f"'identical' with a difference of {a.max_abs_diff:.3g}")
    if a.verdict in ("identical", "agree") and not a.ratio <= 1.0:
        _fail(path, "verdict", f"{a.verdict!r} with ratio {a.ratio:.3g} to the bound (past 1: they disagree)")


def _cross(c: CrossReport, path: str) -> None:
    frameworks = c.frameworks
    if len(frameworks) < 2 or len(set(frameworks)) != len(frameworks):
        _fail(path, "frameworks", f"{frameworks} is not two or more frameworks, each once")
    if len(c.reports) != len(frameworks):
        _fail(path, "reports", f"{len(c.reports)} report{'s' * (len(c.reports) != 1)} for the {len(frameworks)} "
              "frameworks listed")
    for i, (name, report) in enumerate(zip(frameworks, c.reports)):
        if report.framework != name:
            _fail(_item(path, "reports", i), "framework", f"{report.framework!r}, where frameworks lists "
                  f"{name!r}")
    pairs = [list(p) for p in itertools.combinations(frameworks, 2)]

    def pair(where: str, value: list[str] | None) -> None:
        if value is not None and value not in pairs:
            _fail(where, "frameworks", f"{value} is not a pair of the frameworks listed ({', '.join(frameworks)}), "
                  "in their order")

    for i, forward in enumerate(c.forwards()):
        pair(field_path(path, "forward") if i == 0 and c.forward is not None else
             _item(path, "forward_rest", i - (c.forward is not None)),
             forward.frameworks)
    labelled = [a.frameworks is not None for a in c.agreement]
    if any(labelled) and not all(labelled):
        _fail(path, "agreement", "some records name their frameworks and some do not")
    names = {f: [t.name for t in r.tensors] for f, r in zip(frameworks, c.reports)}
    for i, a in enumerate(c.agreement):
        where = _item(path, "agreement", i)
        pair(where, a.frameworks)
        if a.name not in names[(a.frameworks or frameworks)[0]]:
            _fail(where, "name", f"{a.name!r} is not a tensor of the {(a.frameworks or frameworks)[0]} report")
    if all(labelled):  # every pair compares every tensor, once
        found = [(tuple(a.frameworks or ()), a.name) for a in c.agreement]
        wanted = [(tuple(p), name) for p in pairs for name in names[p[0]]]
        if sorted(found) != sorted(wanted):
            missing = sorted(set(wanted) - set(found))
            said = f"no record of {missing[0][1]!r} in {' vs '.join(missing[0][0])}" if missing else \
                "a record listed twice"
            _fail(path, "agreement", f"not one record per tensor and pair of frameworks ({said})")
    for i, odd in enumerate(c.odd_one_out):
        where = _item(path, "odd_one_out", i)
        if odd.framework is not None and odd.framework not in frameworks:
            _fail(where, "framework", f"{odd.framework!r} is not one of the frameworks listed")
        for j, disagreeing in enumerate(odd.disagreeing):
            if sorted(disagreeing) not in [sorted(p) for p in pairs]:
                _fail(field_path(where, "disagreeing"), j, f"{disagreeing} is not a pair of the frameworks listed")


def _stack(s: StackReport, path: str) -> None:
    for i, step in enumerate(s.steps):
        if not step.micro_batches:
            _fail(_item(path, "steps", i), "micro_batches", "empty: an optimizer step's window holds one "
                  "micro-batch or more")
    if len(set(s.unstepped)) != len(s.unstepped) or any(i >= s.micro_batches_seen for i in s.unstepped):
        _fail(path, "unstepped", f"not distinct micro-batches of the {s.micro_batches_seen} seen")


def _trajectory(t: TrajectoryReport, path: str) -> None:
    traces = {"losses": t.losses, "max_diff": t.max_diff, "band_ratio": t.band_ratio, "oracle_diff": t.oracle_diff}
    for field, trace in traces.items():
        for key, values in trace.items():
            if len(values) != t.steps:
                raise FieldError(key_path(field_path(path, field), key), f"{len(values)} values for {t.steps} steps")
    if set(t.band_ratio) != set(t.max_diff) or not set(t.oracle_diff) <= set(t.max_diff):
        _fail(path, "band_ratio", "not the tensor kinds of max_diff")
    for field in ("first_out_of_band", "non_finite"):
        for key, step in getattr(t, field).items():
            if step >= t.steps:
                raise FieldError(key_path(field_path(path, field), key), f"step {step} of a run of {t.steps}")
    # ``accumcheck.trajectory``: a tensor past its band is named in first_out_of_band at that step or
    # before, and a nan is a non-finite loss or parameter, or a step not run after one.
    first = min(t.first_out_of_band.values(), default=t.steps)
    for kind, values in t.band_ratio.items():
        past = next((step for step, value in enumerate(values) if value > 1.0), None)
        if past is not None and first > past:
            raise FieldError(key_path(field_path(path, "band_ratio"), kind),
                             f"past the band at step {past}, but first_out_of_band names no tensor by then")
    if not t.non_finite:
        for field in ("losses", "max_diff", "band_ratio"):
            for key, values in getattr(t, field).items():
                if any(math.isnan(v) for v in values):
                    raise FieldError(key_path(field_path(path, field), key), "nan, but non_finite names nothing")


RELATIONS: dict[type, Callable[[Any, str], None]] = {
    TensorResult: _tensor, Report: _report, FullBatchResult: _full_batch, Agreement: _agreement,
    CrossReport: _cross, StackReport: _stack, TrajectoryReport: _trajectory,
}

__all__ = ["FIELDS", "INT_LIMIT", "RELATIONS", "LongInteger", "check", "check_data", "one_of", "parse_int"]

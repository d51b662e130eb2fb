"""A run judged in groups (--memory-budget) against the same run judged at once: the same report,
field for field and float for float (shared by the framework tests)."""

from accumcheck.report.values import encode
from accumcheck.run.budget import minimum
from accumcheck.run.registry import get_backend
from accumcheck.run.validation import configure

# What may differ: the run's timing and creation time, its options (the budget) and the groups.
UNCOMPARED = {"seconds", "created", "config", "groups"}


def tightest(**options) -> int:
    """The smallest budget the run takes: the most groups."""
    config = configure(options)
    return minimum(get_backend(config.framework).tensor_needs(config))


def differences(whole, grouped) -> list[str]:
    """Where two reports differ, as "field" or "tensor name: field" (UNCOMPARED left out)."""
    a, b = encode(whole), encode(grouped)
    found = [key for key in a if key not in UNCOMPARED and key != "tensors" and a[key] != b.get(key)]
    if len(a["tensors"]) != len(b["tensors"]):
        return found + ["tensors: their number"]
    for x, y in zip(a["tensors"], b["tensors"]):
        found += [f"{x['name']}: {field}" for field in x if x[field] != y.get(field)]
    return found


def assert_same_report(whole, grouped, groups_at_least: int = 2) -> None:
    assert whole.groups == 1 and grouped.groups >= groups_at_least, (whole.groups, grouped.groups)
    assert differences(whole, grouped) == []
    assert grouped.config["memory_budget"] > 0 and "memory_budget" not in whole.config

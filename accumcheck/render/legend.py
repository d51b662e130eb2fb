"""What each table column means, in the few words of the line under its table."""

from __future__ import annotations

# What each table column means, for its table's one-line legend; a table may say more of its own.
LEGEND = {
    "max|g|": "largest |E|, the gradient's magnitude",
    "cause": "the fault the difference fits",
    "ratio": "worst |mode − E| over its round-off bound (past 1: not round-off)",
    "max|A-B|": "largest |native − manual|",
    "ulps": "that distance in units in the last place",
    "tol fails": "elements torch.testing's rtol/atol reject",
    "cond": "condition number S/|E| (large: cancellation)",
    "bound": "γ(N−1)/u ≈ N − 1, the worst case",
    "√N": "how typical round-off grows",
    "native": "worst |native − E| among the kind's tensors, in units of u·S",
    "manual": "the same for manual",
    "|A-B|": "worst |native − manual|, same units",
    "flagged": "tensors past their bound",
    "a vs b": "the frameworks compared",
    "max|diff|": "largest |B_a − B_b|",
    "fp32 err": "each framework's float32 error against its own float64 run",
    "own total, worst ratio": "the rank's own total against its own E and S, over the bound",
    "ratio A/B": "each report's ratio to its round-off bound",
    "micro-batches": "the window's",
    "items": "items in each micro-batch",
    "factor": "the applied gradient over the window's as one batch",
    "max rel diff": "largest difference, relative to the gradient's scale",
    "why": "what the applied gradient is",
    "loss": "mean micro-batch loss of each mode",
    "KIND ulps": "max |θ native − θ manual| in float32 ulps",
}


def _legend_key(header: str) -> str:
    """The legend's entry for a column: a family of columns (fp32 err torch, loss native, weight
    ulps, ratio A) is said once."""
    if header.startswith("fp32 err"):
        return "fp32 err"
    if header.startswith("loss "):
        return "loss"
    if header.endswith(" ulps"):
        return "KIND ulps"
    return "ratio A/B" if header in ("ratio A", "ratio B") else header


def legend(headers: list[str], own: dict[str, str] | None = None) -> str:
    """One line saying what the columns headed ``headers`` mean (those that need saying), in their
    order; ``own``: meanings of this table's own, before LEGEND's."""
    meanings = {**LEGEND, **(own or {})}
    keys = list(dict.fromkeys(_legend_key(" ".join(h.split())) for h in headers))
    return " · ".join(f"{key}: {meanings[key]}" for key in keys if key in meanings)


__all__ = ["LEGEND", "legend"]

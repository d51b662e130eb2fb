"""The Report: plain data with a schema version, written and read as JSON.

Computing (``compare``) and drawing (``render``) are kept apart: a saved report can be re-rendered
with ``accumcheck show`` on a machine that has neither framework installed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import AccumcheckError

if TYPE_CHECKING:
    from .crosscheck import CrossReport

SCHEMA_VERSION = 1
VERDICTS = ("identical", "round-off", "precision-loss", "diverged", "non-finite")
# precision-loss: within the round-off of its own (reduced) dtype, beyond that of the accumulation dtype
FLAGGED_VERDICTS = ("precision-loss", "diverged", "non-finite")
# Tensor kinds in the order a summary names them: embeddings and weights first.
KIND_ORDER = ("embedding", "weight", "bias", "norm")


@dataclass
class TensorResult:
    """Everything measured about one parameter tensor. Errors are absolute unless named ``rel``;
    "E" is the float64 sum of the same micro-gradients, "S" the float64 sum of their magnitudes."""

    name: str
    kind: str
    shape: list[int]
    dtype: str
    verdict: str
    ill_conditioned: bool
    numel: int
    max_abs_grad: float  # max |E|
    mismatched: int  # elements where native != manual
    max_abs_diff: float  # max |native - manual|
    max_abs_diff_index: list[int]
    max_rel_diff: float  # max |native - manual| / |manual|
    max_ulps: float  # max distance native-manual in units in the last place of ``dtype``
    classic_mismatched: int  # elements failing torch.testing's defaults for ``dtype``
    classic_rtol: float
    classic_atol: float
    ratio: float  # worst |mode - E| / bound over both modes and all elements
    worst_mode: str
    worst_index: list[int]
    bound_at_worst: float
    ratio_native: float
    ratio_manual: float
    over_bound_native: int
    over_bound_manual: int
    err_native: float  # max |native - E|
    err_manual: float
    rel_err_native: float  # ||native - E||_2 / ||E||_2
    rel_err_manual: float
    condition: float  # sum S / sum |E|
    nearer: str  # "native", "manual" or "tie" (smaller L2 error against E)
    nonfinite_native: int
    nonfinite_manual: int
    diff_ratio: float = 0.0  # worst |native - manual| / (bound_native + bound_manual)
    precision_ratio: float | None = None  # native's worst error over the accumulation dtype's bound
    err_ulps_native: float | None = None  # worst |native - E| in float32 ulps of E (reduced precision runs)
    err_ulps_manual: float | None = None
    ratio_map: list[list[float]] | None = None  # where the worst ratios sit (compare.ratio_map)
    ratio_map_cell: list[int] | None = None  # [rows, columns] of the tensor per map cell
    grad_sum_sq: float = 0.0  # sum of E^2 over the tensor
    norm_share: float = 0.0  # this tensor's share of the whole gradient's sum of squares (of E)
    oracle_err_native: float | None = None  # max |mode - O|, O = the whole model in float64
    oracle_err_manual: float | None = None
    oracle_err_exact: float | None = None
    # Data parallel (accumcheck.dataparallel): the single-process reference's worst ratio to its
    # bound, native against it (over both bounds), each rank's own total against its own E and S,
    # each rank's gradient after the all-reduce, and the ranks named by those.
    single_ratio: float | None = None
    single_agreement: float | None = None
    rank_local_ratios: list[float] | None = None
    rank_final_ratios: list[float] | None = None
    flagged_ranks: list[int] | None = None

    @property
    def flagged(self) -> bool:
        return self.verdict in FLAGGED_VERDICTS

    @property
    def label(self) -> str:
        """The verdict as shown: ``round-off (ill-conditioned)`` where that applies."""
        return f"{self.verdict} (ill-conditioned)" if self.ill_conditioned else self.verdict


@dataclass
class Report:
    """The result of one comparison, with everything needed to reproduce it."""

    case: str
    case_source: str
    case_fingerprint: str
    case_toml: str
    framework: str
    versions: dict[str, str]
    device: str
    param_dtype: str
    accum_dtype: str
    accum_steps: int
    seed: int
    oracle: bool
    inject: str | None
    bound: dict[str, Any]
    settings: dict[str, Any]
    losses: dict[str, float]
    seconds: float
    created: str
    tensors: list[TensorResult] = field(default_factory=list)
    loss_reduction: str = "mean"
    schema_version: int = SCHEMA_VERSION

    @property
    def flagged(self) -> list[TensorResult]:
        """Flagged tensors, embeddings and weights first, then by how far past the bound."""
        hits = [t for t in self.tensors if t.flagged]
        return sorted(hits, key=lambda t: (KIND_ORDER.index(t.kind) if t.kind in KIND_ORDER else 9,
                                           -_finite_or_max(t.ratio)))

    @property
    def semantic_mismatch(self) -> bool:
        """The full-batch check ran and the accumulated gradient is not the whole batch's."""
        return self.settings.get("full_batch", {}).get("equivalent") is False

    @property
    def exit_code(self) -> int:
        """0 when every tensor is faithful (and the full-batch check, if run, agrees), else 1."""
        return 1 if self.flagged or self.semantic_mismatch else 0

    def reproduce_command(self) -> str:
        """The CLI line that reruns this comparison (for a user's own model: the call)."""
        if self.case_source.startswith("<user model"):
            return f"accumcheck.{self.framework}.check(<your {self.case}>, loss_fn, batches, accum_steps={self.accum_steps})"
        parts = ["accumcheck compare", f"--framework {self.framework}",
                 f"--device {self.settings.get('requested_device', self.device)}",
                 f"--case {self.case_source_arg}", f"--accum-steps {self.accum_steps}", f"--seed {self.seed}"]
        if self.oracle:
            parts.append("--oracle")
        if self.settings.get("hybridize") is False:
            parts.append("--no-hybridize")
        if self.settings.get("full_batch"):
            parts.append(f"--full-batch --loss-reduction {self.loss_reduction}")
        if self.inject:
            parts.append(f"--inject {self.inject.split('@')[0]}")
        parallel = self.data_parallel
        if parallel:
            parts.append(f"--world-size {parallel['world_size']}")
            if parallel["reduce_dtype"] != "float32":
                parts.append(f"--reduce-dtype {parallel['reduce_dtype']}")
            if self.inject and parallel.get("fault_rank"):
                parts.append(f"--inject-rank {parallel['fault_rank']}")
        if self.param_dtype != "float32":
            parts.append(f"--dtype {self.param_dtype}")
        if self.accum_dtype != "float32":
            parts.append(f"--accum-dtype {self.accum_dtype}")
        if self.settings.get("mode", "native") != "native":
            parts.append(f"--mode {self.settings['mode']}")
        return " ".join(parts)

    @property
    def data_parallel(self) -> dict[str, Any] | None:
        """How a data-parallel run was set up and what its ranks said; None for one process."""
        return self.settings.get("data_parallel")

    @property
    def case_source_arg(self) -> str:
        return self.case if self.case_source.startswith("case ") else self.case_source

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        return _encode(dataclasses.asdict(self))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<report>") -> "Report":
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise AccumcheckError(f"{source}: report schema_version {version!r} is not supported "
                                  f"(this accumcheck reads version {SCHEMA_VERSION}); "
                                  "re-run the comparison with this version")
        data = _decode(data)
        try:
            tensors = [TensorResult(**t) for t in data.pop("tensors")]
            return cls(tensors=tensors, **data)
        except (TypeError, KeyError) as exc:
            raise AccumcheckError(f"{source}: not an accumcheck report ({exc})") from None


def _finite_or_max(x: float) -> float:
    return x if math.isfinite(x) else 1e308


# JSON has no inf/nan: they travel as the strings "inf", "-inf", "nan".
def _encode(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode(v) for v in obj]
    return obj


_FLOAT_WORDS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_TENSOR_FLOATS = {f.name for f in dataclasses.fields(TensorResult) if str(f.type).startswith("float")}


def _decode_value(key: str, value: Any) -> Any:
    if key == "ratio_map" and isinstance(value, list):
        return [[_FLOAT_WORDS.get(c, c) if isinstance(c, str) else c for c in row] for row in value]
    if key in _TENSOR_FLOATS and isinstance(value, str):
        return _FLOAT_WORDS.get(value, value)
    return value


def _decode(data: dict[str, Any]) -> dict[str, Any]:
    data = dict(data)
    data["tensors"] = [{k: _decode_value(k, v) for k, v in t.items()} for t in data.get("tensors", [])]
    if isinstance(data.get("seconds"), str):
        data["seconds"] = _FLOAT_WORDS.get(data["seconds"], data["seconds"])
    return data


def load_report(path: str | Path) -> "Report | CrossReport":
    """Read a report written with ``--format json`` (one framework's Report, or a CrossReport of
    several). Raises AccumcheckError when it cannot."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise AccumcheckError(f"{path}: cannot read report: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise AccumcheckError(f"{path}: not JSON ({exc.msg} at line {exc.lineno}); "
                              "pass a report written with --format json") from None
    if not isinstance(data, dict):
        raise AccumcheckError(f"{path}: not an accumcheck report (top level is not an object)")
    if data.get("kind") == "sweep":
        from .sweep import SweepReport

        try:
            return SweepReport.from_dict(data, str(path))
        except (TypeError, KeyError) as exc:
            raise AccumcheckError(f"{path}: not an accumcheck sweep report ({exc})") from None
    if data.get("kind") == "cross":
        from .crosscheck import CrossReport

        try:
            return CrossReport.from_dict(data, str(path))
        except (TypeError, KeyError) as exc:
            raise AccumcheckError(f"{path}: not an accumcheck cross-framework report ({exc})") from None
    return Report.from_dict(data, str(path))


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

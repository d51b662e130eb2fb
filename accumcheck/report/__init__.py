"""Every report kind, one JSON codec: plain data with a kind and a schema version.

Computing (``accumcheck.judge``) and drawing (``accumcheck.render``) are kept apart: a saved report
is re-rendered with ``accumcheck show`` on a machine that has neither framework installed.
"""

from ..files import write_atomic
from .cross import CROSS_VERDICTS, Agreement, CrossReport, ForwardAgreement, OddOneOut
from .diff import ReportDiff, TensorChange, diff_reports
from .files import KINDS, load_report, report_from_data
from .single import (
    DataParallelResult,
    DataParallelSetup,
    FullBatchResult,
    RankVerdict,
    Report,
    SingleProcessAgreement,
    TermFit,
)
from .stack import STEP_VERDICTS, StackReport, StackStep
from .sweep import SweepReport, growth_rows
from .tensor import FLAGGED_VERDICTS, KIND_ORDER, MARGINAL_RATIO, SEVERITIES, VERDICTS, Cause, TensorResult
from .trajectory import TrajectoryReport
from .values import SCHEMA_VERSION

__all__ = ["CROSS_VERDICTS", "FLAGGED_VERDICTS", "KINDS", "KIND_ORDER", "SCHEMA_VERSION", "VERDICTS", "MARGINAL_RATIO",
           "SEVERITIES", "Agreement", "Cause", "CrossReport", "DataParallelResult", "DataParallelSetup", "ForwardAgreement", "FullBatchResult", "OddOneOut", "TermFit",
           "RankVerdict", "Report", "STEP_VERDICTS", "StackReport", "StackStep", "ReportDiff", "SingleProcessAgreement", "SweepReport", "TensorChange",
           "TensorResult", "TrajectoryReport", "diff_reports", "growth_rows", "load_report", "report_from_data",
           "write_atomic"]

"""accumcheck: does your gradient accumulation compute what you think it computes?

Runs the same seeded model with native accumulation (PyTorch ``.grad`` accumulating across
``backward()``, MXNet ``grad_req='add'``) and manual accumulation (zero/write each micro-step,
add into a buffer), and judges every parameter tensor against floating-point error bounds.
"""

__version__ = "0.1.0"

from .api import compare, compare_frameworks
from .assertions import AccumulationMismatch, assert_faithful
from .errors import AccumcheckError
from .report import Report, TensorResult, load_report

__all__ = ["AccumcheckError", "AccumulationMismatch", "Report", "TensorResult", "__version__", "assert_faithful",
           "compare", "compare_frameworks", "load_report"]

"""Gradient diagnostics for divergence, PyTorch and MXNet Gluon.

- Per-parameter and per-layer gradient statistics (L2 norm, min, max, abs-max, share of the
  total sum of squares) for a few chosen layers (default: blocks 0, 1, n//2, -2, -1).
- A drop-in for ``torch.nn.utils.clip_grad_norm_`` that keeps the per-parameter norms it computes
  (``accumcheck.torch.diagnostics.GradMonitor``), and the Gluon equivalent.
- An anomaly trigger (clipping scale below a threshold, or a non-finite gradient) and a dominance
  report naming the parameters that dominate the gradient norm.
- TensorBoard scalars through any writer with ``add_scalar`` (the standard SummaryWriter).
- The monitors' lifecycle, written once for both (``monitor.GradMonitorBase``): the arguments,
  the logged steps and windows, the reports, the statistics written in batches, the writer.

The normal path never waits for the device: flags and statistics are copied to the host without
blocking and read once they have arrived, usually at the next step.
"""

from .layers import DEFAULT_LAYERS, layer_groups, layer_norms, select_layers
from .report import DominanceEntry, DominanceReport

__all__ = ["DEFAULT_LAYERS", "DominanceEntry", "DominanceReport", "layer_groups", "layer_norms", "select_layers"]

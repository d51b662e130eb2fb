"""The MXNet Gluon backend: ``grad_req='add'`` against ``grad_req='write'`` plus a buffer, in two
passes (``passes``). MXNet itself is imported inside the methods only."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np

from ..errors import AccumcheckError
from ..options.choices import ACCUM_DTYPES, MODES
from ..options.spec import Option
from ..report import TrajectoryReport
from ..run.backend import Backend, Capabilities, Progress
from ..run.budget import TensorNeed
from ..run.config import RunConfig
from ..run.results import RunResult

HYBRIDIZE = Option("hybridize", "hybridize", "MXNet: hybridize(static_alloc=True) the Gluon block (default: on)",
                   switch=True)
MULTI_PRECISION = Option("multi_precision", "multi-precision",
                         "MXNet, float16: the optimizer keeps float32 master weights (multi_precision=True)",
                         default=False, switch=True)


class MXNetBackend(Backend):
    name = "mxnet"
    package = "mxnet"
    preference = 1
    install = "pip install 'accumcheck[mxnet]'"
    capabilities = Capabilities(
        dtypes=("float32", "float16"), accum_dtypes=ACCUM_DTYPES, modes=MODES, full_batch=True,
        options=(HYBRIDIZE, MULTI_PRECISION), replay=True, memory_budget=True, trajectory=True,
        trajectory_dtypes=("float32", "float16"),
        why_not={"dtype": "it runs float32 and float16: MXNet 1.x has no bfloat16 kernels for these operators",
                 "world_size": "no data-parallel mode: data-parallel runs use torch.distributed"})

    def has_device(self, kind: str) -> bool:
        from .library import mx

        return kind == "cpu" or mx.context.num_gpus() > 0

    def versions(self) -> dict[str, str]:
        from .library import mx

        return {"mxnet": mx.__version__}

    def model_check(self) -> Callable[..., Any]:
        from .usercheck import check

        return check

    def run(self, config: RunConfig, progress: Progress | None = None,
            weights: dict[str, np.ndarray] | None = None) -> RunResult:
        from .builtin import run

        _check_multi_precision(config)
        return run(config, self.versions(), progress, weights)

    def tensor_needs(self, config: RunConfig) -> list[TensorNeed]:
        from .builtin import tensor_needs

        return tensor_needs(config)

    def run_groups(self, config: RunConfig, groups: list[list[str]], progress: Progress | None = None
                   ) -> Iterator[RunResult]:
        from .builtin import run_groups

        _check_multi_precision(config)
        return run_groups(config, groups, self.versions(), progress)

    def micro_gradients(self, config: RunConfig, names: list[str], progress: Progress | None = None,
                        weights: dict[str, np.ndarray] | None = None) -> Iterator[dict[str, np.ndarray]]:
        from .builtin import micro_gradients

        return micro_gradients(config, names, progress, weights)

    def train(self, config: RunConfig, steps: int, optimizer: str, lr: float,
              progress: Progress | None = None) -> TrajectoryReport:
        from .train import train

        _check_multi_precision(config)
        return train(config, steps, optimizer, lr, self.versions(), progress)

    def repro_source(self, config: RunConfig, report: Any, script_name: str = "repro.py",
                     data_name: str = "repro.npz", shrunk_from: str | None = None) -> str:
        from .repro import repro_source

        return repro_source(config, report, script_name, data_name, shrunk_from)


def _check_multi_precision(config: RunConfig) -> None:
    if config.option("multi_precision", False) and config.dtype != "float16":
        raise AccumcheckError(f"--multi-precision: {config.dtype} parameters need no float32 master weights; "
                              "give --dtype float16 or drop --multi-precision")

"""The PyTorch backend: native accumulation is ``.grad`` accumulating across ``backward()``; one
backward pass per micro-step also feeds the manual buffer and the float64 sums (``accumulate``).
Data-parallel runs go through torch.distributed (``distributed``). PyTorch itself is imported
inside the methods only."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np

from ..options.choices import DTYPES, MODES
from ..report import TrajectoryReport
from ..run.backend import Backend, Capabilities, Progress
from ..run.budget import TensorNeed
from ..run.config import RunConfig
from ..run.results import RunResult


class TorchBackend(Backend):
    name = "torch"
    package = "torch"
    preference = 0
    install = "pip install 'accumcheck[torch]'"
    capabilities = Capabilities(
        dtypes=DTYPES, modes=MODES, full_batch=True, data_parallel=True, reduce_dtypes=DTYPES,
        single_process_only=("dtype", "mode", "full_batch"), trajectory=True, replay=True, memory_budget=True,
        why_not={"single_process_only": "data-parallel runs keep float32 parameters and DDP's own accumulation; "
                                        "--reduce-dtype sets the all-reduce's dtype"})

    def has_device(self, kind: str) -> bool:
        import torch

        return kind == "cpu" or torch.cuda.is_available()

    def versions(self) -> dict[str, str]:
        import torch

        found = {"torch": torch.__version__}
        if torch.version.cuda:
            found["cuda"] = torch.version.cuda
        return found

    def model_check(self) -> Callable[..., Any]:
        from .usercheck import check

        return check

    def run(self, config: RunConfig, progress: Progress | None = None,
            weights: dict[str, np.ndarray] | None = None) -> RunResult:
        if config.world_size is not None:
            from .forkserver import start_early

            start_early()  # the ranks' server imports PyTorch while this process does
            from .distributed import run_data_parallel

            return run_data_parallel(config, self.versions(), progress)
        from .builtin import run_single

        return run_single(config, self.versions(), progress, weights)

    def tensor_needs(self, config: RunConfig) -> list[TensorNeed]:
        from .needs import case_needs

        return case_needs(config)

    def run_groups(self, config: RunConfig, groups: list[list[str]], progress: Progress | None = None
                   ) -> Iterator[RunResult]:
        from .builtin import run_groups

        return run_groups(config, groups, self.versions(), progress)

    def micro_gradients(self, config: RunConfig, names: list[str], progress: Progress | None = None,
                        weights: dict[str, np.ndarray] | None = None) -> Iterator[dict[str, np.ndarray]]:
        from .builtin import micro_gradients

        return micro_gradients(config, names, progress, weights)

    def train(self, config: RunConfig, steps: int, optimizer: str, lr: float,
              progress: Progress | None = None) -> TrajectoryReport:
        from .train import train

        return train(config, steps, optimizer, lr, self.versions(), progress)

    def repro_source(self, config: RunConfig, report: Any, script_name: str = "repro.py",
                     data_name: str = "repro.npz", shrunk_from: str | None = None) -> str:
        from .repro import repro_source

        return repro_source(config, report, script_name, data_name, shrunk_from)

"""The JAX backend: ``optax.MultiSteps``' accumulator against a ``tree_map`` buffer, both fed the
same micro-gradients (``run``). JAX and optax are imported inside the methods only."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np

from ..options.choices import ACCUM_DTYPES
from ..options.spec import Option
from ..report import TrajectoryReport
from ..run.backend import Backend, Capabilities, Progress
from ..run.config import RunConfig
from ..run.results import RunResult

JIT = Option("jit", "jit", "JAX: jit-compile the gradient, the MultiSteps update and the manual add (default: on)",
             switch=True)
GRAD_MEAN = Option("grad_mean", "grad-mean", "JAX: optax.MultiSteps(use_grad_mean=...), its running mean "
                   "(default: on, optax's default) or a running sum", switch=True)

MASTER_WEIGHTS = Option("master_weights", "master-weights",
                        "JAX, bfloat16: float32 master parameters, cast to bfloat16 in the forward; MultiSteps is "
                        "initialised on them and accumulates in float32", default=False, switch=True)


class JaxBackend(Backend):
    name = "jax"
    package = "jax"
    array_packages = ("jax", "jaxlib")  # jax.Array's class is jaxlib's ArrayImpl
    preference = 2
    install = "pip install 'accumcheck[jax]'"
    capabilities = Capabilities(
        dtypes=("float32", "bfloat16"), accum_dtypes=ACCUM_DTYPES, options=(JIT, GRAD_MEAN, MASTER_WEIGHTS),
        replay=True, trajectory=True,
        why_not={"dtype": "it runs float32 and bfloat16 parameters",
                 "mode": "GradAccumulator modes are PyTorch's and MXNet's; JAX's native slot is optax.MultiSteps",
                 "full_batch": "the full-batch reference is not built for JAX",
                 "world_size": "no data-parallel mode: data-parallel runs use torch.distributed",
                 "memory_budget": "the JAX backend runs every tensor in one group"})

    def has_device(self, kind: str) -> bool:
        from .devices import has_gpu

        return kind == "cpu" or has_gpu()

    def versions(self) -> dict[str, str]:
        from .library import versions

        return versions()

    def run(self, config: RunConfig, progress: Progress | None = None,
            weights: dict[str, np.ndarray] | None = None) -> RunResult:
        from .builtin import run

        return run(config, self.versions(), progress, weights)

    def model_check(self) -> Callable[..., Any]:
        from .usercheck import check

        return check

    def micro_gradients(self, config: RunConfig, names: list[str], progress: Progress | None = None,
                        weights: dict[str, np.ndarray] | None = None) -> Iterator[dict[str, np.ndarray]]:
        from .builtin import micro_gradients

        return micro_gradients(config, names, progress, weights)

    def train(self, config: RunConfig, steps: int, optimizer: str, lr: float,
              progress: Progress | None = None) -> TrajectoryReport:
        from .train import train

        return train(config, steps, optimizer, lr, self.versions(), progress)

"""A built-in case through the engine: the case as a model (``casemodel.build_model``), its loss
and its micro-batches (``CaseSubject``), run as a user's model is run; the RunResults the judge
reads (``run_single``, ``run_groups``) and the second pass's micro-gradients
(``micro_gradients``)."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch

from ..case.definition import IGNORE_LABEL, Case
from ..run.backend import Progress
from ..run.config import RunConfig
from ..run.results import FullBatchGap, ParamAccumulation, RunResult
from . import engine
from .casemodel import build_model, case_loss, deterministic, isolated, resolve_device, to_inputs, to_numpy
from .passes import accumulate


class CaseSubject(engine.Subject):
    """``case``'s model holding ``weights`` in ``dtype`` on ``device``, its N micro-batches and its
    loss. ``first_logits``: the model's output for micro-batch 0 once a pass has run (to compare
    forward passes across frameworks)."""

    strict = True
    hold_refs = True  # a model of plain operations: see passes.StepRecorder

    def __init__(self, case: Case, weights: dict[str, np.ndarray], dtype: Any, device: Any, steps: int) -> None:
        self.case, self.weights, self.device, self.steps = case, weights, device, steps
        self.model = build_model(case, weights, dtype, device)
        self.params = self.model.canonical
        self.reduction = case.loss_reduction
        self.total = case.token_count(steps) if case.loss_reduction == "token_count" else None
        self.first_logits: Any = None

    def step_loss(self, net: Any) -> Any:
        dtype = next(net.parameters()).dtype
        case, device = self.case, self.device

        def loss(step: int) -> Any:
            batch = case.batch(step)
            labels = torch.from_numpy(batch.labels).to(device)
            logits = net(to_inputs(batch.inputs, device, dtype), batch.index)
            if step == 0 and net is self.model and self.first_logits is None:
                self.first_logits = logits.detach()
            return case_loss(case, logits, labels, self.total)

        return loss

    def float64_twin(self) -> tuple[Any, dict[str, Any]]:
        twin = build_model(self.case, self.weights, torch.float64, self.device)
        return twin, twin.canonical

    def whole_loss(self, twin: Any, batches: Any) -> Any:
        batches = [self.case.batch(k) for k in range(self.steps)]  # the whole batch at once: memory grows with N
        inputs = to_inputs(np.concatenate([b.inputs for b in batches]), self.device, torch.float64)
        labels = torch.from_numpy(np.concatenate([b.labels for b in batches])).to(self.device)
        # "token_count" divides the sum by the window's labelled tokens: the whole batch's mean
        whole = self.case if self.reduction != "token_count" else self.case.with_reduction("mean")
        return case_loss(whole, twin(inputs), labels)

    def item_counts(self) -> list[int]:
        return [int((self.case.batch(k).labels != IGNORE_LABEL).sum()) for k in range(self.steps)]


def _subject(config: RunConfig, weights: dict[str, np.ndarray] | None = None) -> CaseSubject:
    case = config.case
    return CaseSubject(case, case.weights() if weights is None else weights, getattr(torch, config.dtype),
                       resolve_device(config.device), config.accum_steps)


def run_single(config: RunConfig, versions: dict[str, str], progress: Progress | None = None,
               weights: dict[str, np.ndarray] | None = None) -> RunResult:
    """The case's N micro-steps with native and manual accumulation (and the float64 model for
    the oracle and the full batch), every tensor at once."""
    with isolated(resolve_device(config.device)):
        subject = _subject(config, weights)
    sums, wide = engine.run_whole(subject, config.fault, getattr(torch, config.accum_dtype), config.mode,
                                  config.oracle, config.full_batch, progress)
    kinds = {p.name: p.kind for p in config.case.parameters()}
    params = [ParamAccumulation(name=name, kind=kinds[name], **sums.arrays[name],
                                oracle=wide.accumulated[name] if config.oracle else None)
              for name in subject.params]
    losses = {"mean_loss": sums.loss}
    if config.oracle:
        losses["oracle_mean_loss"] = wide.loss
    return _result(config, subject, params, versions, losses, sums.settings, to_numpy(subject.first_logits),
                   wide.full_batch if wide is not None else None)


def run_groups(config: RunConfig, groups: list[list[str]], versions: dict[str, str],
               progress: Progress | None = None) -> Iterator[RunResult]:
    """``run_single`` once per group of tensors (``Backend.run_groups``), through the engine's one
    group loop (``engine.in_groups``)."""
    with isolated(resolve_device(config.device)):
        subject = _subject(config)
    kinds = {p.name: p.kind for p in config.case.parameters()}
    for index, (names, sums) in enumerate(engine.in_groups(subject, groups, config.fault,
                                                           getattr(torch, config.accum_dtype), config.mode,
                                                           progress)):
        params = [ParamAccumulation(name=name, kind=kinds[name], **sums.arrays[name]) for name in names]
        result = _result(config, subject, params, versions, {"mean_loss": sums.loss}, sums.settings,
                         to_numpy(subject.first_logits) if index == 0 else None)
        del sums, params
        yield result
        del result  # before the next group runs


def micro_gradients(config: RunConfig, names: list[str], progress: Progress | None = None,
                    weights: dict[str, np.ndarray] | None = None) -> Iterator[dict[str, np.ndarray]]:
    """The run's micro-gradients of the tensors ``names`` again (``engine.replay``): the same
    model, batches and settings as ``run_single``, no fault."""
    yield from engine.replay(_subject(config, weights), names, progress)


def _result(config: RunConfig, subject: CaseSubject, params: list[ParamAccumulation], versions: dict[str, str],
            losses: dict[str, float], settings: dict[str, Any], logits: np.ndarray | None,
            gap: Any = None) -> RunResult:
    return RunResult(params=params, framework="torch", versions=versions, device=device_name(subject.device),
                     # the GradAccumulator sums in float32, whatever the parameters' dtype
                     param_dtype=config.dtype if config.mode == "native" else "float32", accum_dtype=config.accum_dtype,
                     losses=losses, settings=settings, first_logits=logits, full_batch=gap)


def device_name(dev: Any) -> str:
    return f"{dev} ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else "cpu"


def _native(subject: CaseSubject, progress: Progress | None, phase: str) -> tuple[dict[str, Any], float]:
    result = accumulate(subject.params, subject.step_loss(subject.model), subject.steps, None, progress, phase,
                        hold_refs=True)
    return result["native"], result["loss"]


def float64_oracle(case: Case, weights: dict[str, np.ndarray], accum_steps: int, device: str,
                   progress: Progress | None = None) -> tuple[dict[str, np.ndarray], float]:
    """The case's accumulated gradients in float64, and its mean loss: the oracle for another
    framework that lacks a float64 kernel (MXNet)."""
    dev = resolve_device(device)
    with isolated(dev):
        subject = CaseSubject(case, weights, torch.float64, dev, accum_steps)
    with deterministic(dev), isolated(dev):
        native, loss = _native(subject, progress, "float64 oracle (torch)")
        return {name: to_numpy(g) for name, g in native.items()}, loss


def full_batch_gap(case: Case, weights: dict[str, np.ndarray], accum_steps: int, device: str,
                   progress: Progress | None = None) -> FullBatchGap:
    """The case's full-batch comparison in float64 (``engine.float64_pass``): for another framework
    that lacks a float64 kernel (MXNet)."""
    dev = resolve_device(device)
    with isolated(dev):
        subject = CaseSubject(case, weights, torch.float64, dev, accum_steps)
    with deterministic(dev), isolated(dev):
        gap = engine.float64_pass(subject, subject.model, subject.params, True, progress).full_batch
    assert gap is not None
    return gap

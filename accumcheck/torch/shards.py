"""Gradients sharded across ranks, for GradMonitor: an FSDP2 model (``fully_shard``: each ``p.grad`` is a
DTensor whose local tensor is this rank's shard) and a DeepSpeed ZeRO-1/2 engine (the gradients live in
flat partitioned buffers; a parameter's piece on this rank is its fragment of the rank's partition).

Every rank computes its pieces' partial figures, per parameter: the sum of |g|^p (the max |g| for
the inf norm) and, at a logged step, the watched gradients' minima and maxima. ``Shards.combine``
joins them with one collective: at a normal step one all_reduce of the partial sums (what FSDP2's
own ``clip_grad_norm_`` spends on its total norm), at a logged step one all_gather of the packed
figures, reduced on every rank alike. Every rank then holds each parameter's global norm, the total
and the watched layers' minima and maxima, equal to the unsharded model's to round-off. DeepSpeed is
not imported: an engine is known by its type's module, its gradients read through what its ZeRO
optimizer links to each parameter (``_hp_mapping``, as ``deepspeed.utils.safe_get_full_grad`` reads them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..diagnostics.report import DominanceEntry, DominanceReport, rank
from ..errors import AccumcheckError


def is_engine(source: Any) -> bool:
    """Whether ``source`` is a DeepSpeed engine (told without importing DeepSpeed)."""
    return type(source).__module__.startswith("deepspeed") and hasattr(source, "zero_optimization_stage")


def sharded_source(source: Any, pairs: Sequence[tuple[str, Any]] | None) -> Shards | None:
    """The Shards of a DeepSpeed engine, or of (name, parameter) pairs holding DTensors (an FSDP2
    model's); None for gradients that are whole on each rank. ``pairs``: the source's, where it
    is no engine."""
    if is_engine(source):
        return ZeroShards(source)
    dtensor = _dtensor_type()
    if dtensor is not None and any(isinstance(p, dtensor) for _, p in pairs or ()):
        return DTensorShards(list(pairs))
    return None


def _dtensor_type() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed tensors
        return None
    return DTensor


class _Discard:
    """The writer of a rank that writes nothing: it logs the same steps as rank 0 (the same collectives)."""

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        pass

    def flush(self) -> None:
        pass


class Shards:
    """The pieces of the monitored gradients on this rank and the process group that holds the rest."""

    pairs: list[tuple[str, Any]]
    group: Any = None

    def at_boundary(self) -> bool:
        """Whether the gradients are complete (DeepSpeed: the accumulation boundary)."""
        return True

    def pieces(self, params: Sequence[Any]) -> list[Any]:
        """Each parameter's gradient on this rank: a tensor (empty where the rank holds none of it),
        or None where the parameter has no gradient (it counts as zero)."""
        raise NotImplementedError

    def scale(self) -> Any:
        """What the pieces are multiplied by (DeepSpeed's loss scale under fp16); 1 elsewhere."""
        return 1.0

    def writer_for(self, writer: Any) -> Any:
        """The writer this rank keeps: rank 0 its own; another rank a discarding one where rank 0 has
        a writer (every rank then logs the same steps and so meets the same collectives), else None.
        One all_reduce, when the monitor is made."""
        first = dist.get_rank(self.group) == 0
        device = "cpu" if dist.get_backend(self.group) == "gloo" else self.pairs[0][1].device
        flags = torch.tensor([float(writer is not None and first), float(writer is not None)], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        rank_0, any_rank = flags.tolist()
        if any_rank and not rank_0:
            raise AccumcheckError("GradMonitor: sharded gradients are logged by rank 0; give rank 0 the writer")
        return writer if first else (_Discard() if rank_0 else None)

    def combine(self, pieces: Sequence[Any], norm_type: float, dtype: Any, device: Any,
                extremes: Any = None) -> tuple[Any, Any]:
        """Each parameter's global gradient norm and the total (``norm_type``: positive or inf) from
        this rank's pieces, with ONE collective; ``extremes`` (rows: minima, maxima of the watched
        gradients, this rank's, as ``local_extremes`` wrote them) become the global ones in place."""
        if not (norm_type > 0):
            raise AccumcheckError(f"GradMonitor: sharded gradients take a positive norm type, not {norm_type}")
        inf = math.isinf(norm_type)
        live = [g for g in pieces if g is not None and g.numel() > 0]
        found = iter(torch._foreach_norm(live, norm_type) if live else ())
        zero = torch.zeros((), dtype=dtype, device=device)  # an empty piece, or none: nothing to add
        powers = torch.stack([next(found).to(device, dtype) if g is not None and g.numel() > 0 else zero
                              for g in pieces])  # no index tensor copied to the device
        if not inf:
            powers = powers.pow(norm_type)
        if extremes is None:
            dist.all_reduce(powers, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=self.group)
        else:
            packed = torch.cat([powers, extremes.to(dtype).reshape(-1)])
            gathered = packed.new_empty(dist.get_world_size(self.group) * packed.numel())
            dist.all_gather_into_tensor(gathered, packed, group=self.group)
            gathered = gathered.view(-1, packed.numel())
            count, width = len(pieces), extremes.shape[1]
            powers = gathered[:, :count].amax(0) if inf else gathered[:, :count].sum(0)
            extremes[0].copy_(gathered[:, count:count + width].amin(0))
            extremes[1].copy_(gathered[:, count + width:].amax(0))
        norms = powers if inf else powers.pow(1.0 / norm_type)
        scale = self.scale()
        if not isinstance(scale, float) or scale != 1.0:
            norms = norms / scale
            if extremes is not None:
                extremes.div_(scale)
        return norms, torch.linalg.vector_norm(norms, norm_type)

    def report(self, names: Sequence[str], norms: Any, top_k: int, step: int, reason: str, total: float,
               coef: float) -> DominanceReport:
        """The dominance report from the global per-parameter norms. A parameter's RMS and where its
        gradient is largest are not gathered from the ranks: they read nan and ()."""
        host = norms.detach().to("cpu", torch.float64).numpy()
        entries = [DominanceEntry(names[i], share, float(host[i]), math.nan, [], math.nan,
                                  0 if math.isfinite(host[i]) else 1) for i, share in rank(list(names), host, top_k)]
        return DominanceReport(step=step, reason=reason, total_norm=total, clip_coef=coef, entries=entries)


def local_extremes(pieces: Sequence[Any], watched: Sequence[int], outs: Sequence[tuple[Any, Any]]) -> None:
    """This rank's min and max of each watched gradient into ``outs`` (0-dim views, as GradMonitor's
    statistics plan holds them): +inf and -inf for an empty piece (they change no other rank's), 0 for
    a parameter without a gradient (as the unsharded monitor counts it)."""
    for i, (low, high) in zip(watched, outs):
        grad = pieces[i]
        if grad is None:
            low.zero_()
            high.zero_()
        elif grad.numel() == 0:
            low.fill_(math.inf)
            high.fill_(-math.inf)
        elif grad.dtype == low.dtype and grad.device == low.device:
            torch.aminmax(grad, out=(low, high))
        else:
            found = torch.aminmax(grad)
            low.copy_(found[0])
            high.copy_(found[1])


class DTensorShards(Shards):
    """An FSDP2 model's parameters (DTensors on a 1-D device mesh): a gradient's piece is its local
    shard (``to_local()``, the very tensor the DTensor holds, so clipping it clips the gradient)."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        dtensor = _dtensor_type()
        meshes = {id(p.device_mesh): p.device_mesh for _, p in pairs if isinstance(p, dtensor)}
        mesh = next(iter(meshes.values()))
        if len(meshes) > 1 or mesh.ndim != 1:
            raise AccumcheckError("GradMonitor: sharded parameters are watched on one 1-D device mesh (FSDP2's "
                                  "fully_shard over init_device_mesh(..., (world_size,)))")
        self.pairs, self.group = pairs, mesh.get_group()
        self._first = dist.get_rank(self.group) == 0

    def pieces(self, params: Sequence[Any]) -> list[Any]:
        out = []
        for p in params:
            grad = p.grad
            if grad is None or not hasattr(grad, "to_local"):  # a plain tensor: whole on every rank
                out.append(grad if grad is None or self._first else grad.new_empty(0))
            elif all(placement.is_shard() for placement in grad.placements):
                out.append(grad.to_local())
            else:  # replicated: counted once, by rank 0
                out.append(grad.to_local() if self._first else grad.to_local().new_empty(0))
        return out


class ZeroShards(Shards):
    """A DeepSpeed ZeRO-1/2 engine's parameters, named as its module names them. After
    ``engine.backward`` at the accumulation boundary (before ``engine.step``) a parameter's piece is
    its fragment of this rank's partition of the reduced gradients (what DeepSpeed's
    ``get_full_hp_grad`` would all-reduce; the optimizer's ``averaged_gradients``): clipping it clips
    what the engine's step applies."""

    UNREADABLE = ("GradMonitor: a DeepSpeed engine's gradients are read after engine.backward(loss) at the "
                  "accumulation boundary, before engine.step()")

    def __init__(self, engine: Any) -> None:
        stage = engine.zero_optimization_stage()
        if stage not in (1, 2):
            raise AccumcheckError(f"GradMonitor: a DeepSpeed engine under ZeRO stage 1 or 2 (this one: stage {stage})")
        self.engine, self.optimizer = engine, engine.optimizer
        self.pairs = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
        groups = [p._dp_group for _, p in self.pairs if getattr(p, "_dp_group", None) is not None]
        self.group = groups[0] if groups else None

    def at_boundary(self) -> bool:
        return bool(self.engine.is_gradient_accumulation_boundary())

    def scale(self) -> Any:
        return getattr(self.optimizer, "loss_scale", 1.0)

    def clipping(self) -> float:
        """The engine's own ``gradient_clipping`` (0: the engine does not clip)."""
        return float(self.engine.gradient_clipping() or 0.0)

    def pieces(self, params: Sequence[Any]) -> list[Any]:
        out = []
        for p in params:
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None:  # none of it in this rank's partition
                out.append(torch.empty(0, dtype=p.dtype, device=p.device))
                continue
            try:
                grad = mapping.get_lp_grad_fragment(p._index_in_param_group)
            except ValueError:  # no reduced gradients (off the boundary, or after engine.step)
                raise AccumcheckError(self.UNREADABLE) from None
            address = mapping.lp_fragment_address
            if grad.numel() == p.numel() and address.numel != p.numel():  # a full buffer: this rank's part
                grad = grad.view(-1).narrow(0, address.start, address.numel)
            out.append(grad)
        return out

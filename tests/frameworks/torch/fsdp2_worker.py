"""One rank of the FSDP2 stack tests (test_fsdp2_stack.py), started by torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node 2 fsdp2_worker.py OUT_DIR SCENARIO ...

Each SCENARIO runs on every rank in turn (gloo on the CPU) and this rank writes what it measured to
OUT_DIR/rank-R.json, by scenario (an exception as {"error": ...}). Scenarios:

    sharded        accumcheck.torch.stacks.sharded against a small net (an uneven Embedding, LayerNorm,
                   Dropout, two Linears, a float and an integer buffer), sharded as ``run_sharded_case``
                   shards (each Linear and Embedding, then the root), beside a float64 copy made before
                   sharding: full_gradient, float64_replica, the model left as it was, refresh
    policy         mixed_precision of models sharded with several MixedPrecisionPolicy
    case[:FAULT]   accumcheck.torch.loopcase.run_sharded_case on padded-tokens, N = 2, 8 micro-batches
"""

import copy
import gc
import json
import sys
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from accumcheck.torch.loopcase import run_sharded_case
from accumcheck.torch.stacks import sharded

warnings.filterwarnings("ignore")
VOCAB = 11


class Net(torch.nn.Module):
    """Parameters whose first dims (11, 5) do not split evenly over two ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.drop = torch.nn.Dropout(0.25)
        self.hidden = torch.nn.Linear(6, 5)
        self.head = torch.nn.Linear(5, VOCAB)
        self.register_buffer("scale", torch.tensor([0.5, 2.0, 1.0, 1.5, 0.75]))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, input_ids, labels=None):
        logits = self.head(torch.tanh(self.hidden(self.drop(self.norm(self.embed(input_ids))))) * self.scale)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return out


def shard(model, policy=None):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = policy or MixedPrecisionPolicy()
    for layer in model.modules():
        if isinstance(layer, (torch.nn.Linear, torch.nn.Embedding)):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, VOCAB, (3, 4), generator=g), "labels": torch.randint(0, VOCAB, (3, 4),
                                                                                               generator=g)}


def largest(a, b):
    return float((a.detach().double() - b.detach().double()).abs().max())


def relative(a, b):
    return largest(a, b) / max(float(b.detach().double().abs().max()), 1e-30)


def snapshot(model):
    """What float64_replica must leave as it was: the very parameter objects, their shards and
    gradients bit for bit, the classes, training flags, FSDP states and hooks."""
    return {"params": [id(p) for p in model.parameters()],
            "shards": [p.to_local().clone() for p in model.parameters()],
            "grads": [p.grad.to_local().clone() for p in model.parameters()],
            "grad_types": [type(p.grad).__name__ for p in model.parameters()],
            "classes": [type(m) for m in model.modules()],
            "training": [m.training for m in model.modules()],
            "states": [id(m._get_fsdp_state()) if isinstance(m, FSDPModule) else None for m in model.modules()],
            "hooks": [(len(m._forward_pre_hooks), len(m._forward_hooks), len(m._state_dict_pre_hooks),
                       len(m._load_state_dict_pre_hooks), len(m._load_state_dict_post_hooks)) for m in model.modules()]}


def same(before, after):
    return all(torch.equal(x, y) for key in ("shards", "grads") for x, y in zip(before[key], after[key])) and \
        all(before[key] == after[key] for key in before if key not in ("shards", "grads"))


def fsdp_remains(module):
    """Anything of FSDP in a module tree: its classes, state keys, attributes or hooks."""
    for m in module.modules():
        hooks = [*m._forward_pre_hooks.values(), *m._forward_hooks.values(), *m._state_dict_pre_hooks.values(),
                 *m._load_state_dict_pre_hooks.values(), *m._load_state_dict_post_hooks.values()]
        if isinstance(m, FSDPModule) or hooks or any("composable" in k or "fsdp" in k for k in m.__dict__):
            return True
    return False


def scenario_sharded():
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    plain = copy.deepcopy(model).double()  # the unsharded float64 model, built before sharding
    shard(model)
    found = {}
    # a micro-step in eval mode (no dropout): every rank's own batch, reduce-scattered (averaged)
    model.eval()
    mine = batch(rank)
    model(**mine)["loss"].backward()
    gathered = [sharded.full_gradient(p.grad) for p in model.parameters()]
    whole = {k: torch.cat([batch(r)[k] for r in range(dist.get_world_size())]) for k in mine}
    plain.eval()
    plain(**whole)["loss"].backward()
    found["gradient_types"] = sorted({type(g).__name__ for g in gathered})
    found["gradient_error"] = max(relative(g, p.grad) for g, p in zip(gathered, plain.parameters()))
    plain.zero_grad(set_to_none=True)
    tensor = torch.ones(2)
    found["plain_gradient_as_is"] = sharded.full_gradient(tensor) is tensor and sharded.full_gradient(None) is None

    model.train()
    model.norm.eval()  # flags that differ from module to module
    before = snapshot(model)
    replica = sharded.float64_replica(model)
    found["model_as_found"] = same(before, snapshot(model))
    names = [n for n, _ in model.named_parameters()]
    found["names"] = [n for n, _ in replica.named_parameters()] == names
    params = list(replica.parameters())
    found["plain_parameters"] = all(type(p) is torch.nn.Parameter and not isinstance(p.data, DTensor) for p in params)
    found["dtypes"] = sorted({str(t.dtype) for t in [*params, *replica.buffers()]})
    found["grads_none"] = all(p.grad is None for p in params)
    found["classes"] = [type(m).__name__ for m in replica.modules()] == [type(m).__name__ for m in plain.modules()]
    found["fsdp_remains"] = fsdp_remains(replica)
    found["training"] = [m.training for m in replica.modules()] == [m.training for m in model.modules()]
    found["dropout"] = replica.drop.p
    found["weights_error"] = max(largest(a, b) for a, b in zip(params, plain.parameters()))
    found["buffers_error"] = max(largest(a, b) for a, b in zip(replica.buffers(), plain.buffers()))

    # the replica runs alone in this process: rank 0 runs it twice, rank 1 once (an FSDP hook left
    # in it would wait on the other rank)
    replica.eval()
    errors = []
    for seed in range(2 if rank == 0 else 1):
        probe = batch(100 + seed)
        ours, theirs = replica(**probe), plain(**probe)
        ours["loss"].backward()
        theirs["loss"].backward()
        errors += [largest(ours["loss"], theirs["loss"]), largest(ours["logits"], theirs["logits"])]
        errors += [largest(a.grad, b.grad) for a, b in zip(replica.parameters(), plain.parameters())]
        replica.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
    found["replica_error"] = max(errors)
    found["replica_forwards"] = len(errors)
    dist.barrier()

    # the model trains on as before: the same micro-step again doubles its gradient, bit for bit
    first = [p.grad.to_local().clone() for p in model.parameters()]
    model.eval()
    model(**mine)["loss"].backward()
    found["model_trains_on"] = all(torch.equal(p.grad.to_local(), 2 * g) for p, g in zip(model.parameters(), first))

    # new weights and buffers on the model; refresh brings the replica up to them
    with torch.no_grad():
        for p, q in zip(model.parameters(), plain.parameters()):
            p.mul_(-2.0)
            q.mul_(-2.0)
        model.scale.add_(1.0)
        plain.scale.add_(1.0)
    sharded.refresh(replica, model)
    found["refreshed_error"] = max(largest(a, b) for a, b in zip([*replica.parameters(), *replica.buffers()],
                                                                 [*plain.parameters(), *plain.buffers()]))
    found["refreshed_dtypes"] = sorted({str(p.dtype) for p in replica.parameters()})
    probe = batch(200)
    found["refreshed_forward_error"] = largest(replica(**probe)["logits"], plain(**probe)["logits"])
    return found


def scenario_policy():
    policies = {"default": MixedPrecisionPolicy(), "reduce-bf16": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16),
                "param-bf16-reduce-fp32": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    found = {name: sharded.mixed_precision(shard(Net(), policy)) for name, policy in policies.items()}
    inner = Net()  # only a submodule sharded: its policy
    fully_shard(inner.head, mesh=init_device_mesh("cpu", (dist.get_world_size(),)),
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    found["submodule-fp16"] = sharded.mixed_precision(inner)
    found["unsharded"] = sharded.mixed_precision(Net())
    return found


def scenario_case(fault=None):
    report = run_sharded_case("padded-tokens", 2, batches=8, fault=fault, world_size=2)
    return {"exit": report.exit_code, "verdicts": [s.verdict for s in report.steps], "summary": report.summary(),
            "windows": [s.micro_batches for s in report.steps],
            "differences": [s.result.max_relative_difference for s in report.steps]}


def run(scenario):
    name, _, fault = scenario.partition(":")
    try:
        if name == "case":
            return scenario_case(fault or None)
        return {"sharded": scenario_sharded, "policy": scenario_policy}[name]()
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}


def main():
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    found = {}
    try:
        for scenario in sys.argv[2:]:
            found[scenario] = run(scenario)
            (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(found, indent=1, default=str))
    finally:
        gc.collect()  # the sharded models' reference cycles hold the group: freed before it goes
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Ground truth for DeepSpeed's gradient accumulation under ZeRO-1 and ZeRO-2, measured with no accumcheck code.

    DS_ACCELERATOR=cpu python -m torch.distributed.run --standalone --nproc_per_node 2 ci/ground_truth_deepspeed.py

Each run is one DeepSpeed engine (gloo on the CPU, a torch.optim.AdamW passed in so nothing compiles)
training a tiny model: an embedding, two linear layers and a token cross-entropy with mean reduction
over the micro-batch's tokens. Micro-batches are distinct on every rank (rank r's i-th is micro-batch
i x W + r of one seeded stream) and all hold the same number of tokens, so the mean over a window of
the per-micro-batch means is the window's mean. The loop is DeepSpeed's own:

    loss = engine(batch); engine.backward(loss); engine.step()

At each accumulation boundary (``engine.is_gradient_accumulation_boundary()``, after the last
backward, before ``engine.step()``) every rank reads A = ``deepspeed.utils.safe_get_full_grad(p)``
for every parameter, in the same order (a collective under ZeRO). F is the float64 gradient of the
global window (every rank's micro-batches of the step as ONE batch, the loss's mean over all of
them), computed on an unsharded float64 copy of the module's weights as they are at that step
(the weights the stack ran forward on: under bf16 the bf16 module weights, not the fp32 master).
The script prints, per run, the largest relative difference over tensors (max|A_t - F_t| /
max|F_t|), the norm-wise one (||A - F|| / ||F||) and the factor of the least-squares fit A = c F.

Runs: ZeRO stage 1 and 2 at gradient_accumulation_steps 2 and 4 in float32; one with
``engine.backward(loss, scale_wrt_gas=False)`` (the division by N that DeepSpeed does for you, left
out: c = N); bf16 (``"bf16": {"enabled": true}``) with the default accumulation dtype and with
``"data_types": {"grad_accum_dtype": "fp32"}`` and ``"bf16"``; fp16. A run that DeepSpeed refuses
prints its error's first line. Exit status 0 when every float32 run is within 1e-6 with c = 1
(the scale_wrt_gas=False run: c = N), 1 otherwise.
"""

import copy
import os
import sys
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

VOCAB, DIM, HIDDEN, ROWS, TOKENS = 11, 6, 10, 2, 5
WINDOWS = 2


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.hidden = torch.nn.Linear(DIM, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, labels):
        logits = self.out(torch.tanh(self.hidden(self.embed(input_ids))))
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1), reduction="mean")


def micro_batches(count):
    """``count`` micro-batches of one seeded stream: (input_ids, labels), ROWS x TOKENS each."""
    g = torch.Generator().manual_seed(1234)
    return [(torch.randint(0, VOCAB, (ROWS, TOKENS), generator=g), torch.randint(0, VOCAB, (ROWS, TOKENS), generator=g))
            for _ in range(count)]


def window_gradient(module, batches):
    """The float64 gradient of the window's micro-batches as one batch, on a float64 copy of ``module``."""
    reference = copy.deepcopy(module).to(torch.float64)
    for m in reference.modules():
        m._forward_hooks.clear()
        m._forward_pre_hooks.clear()
    ids = torch.cat([b[0] for b in batches])
    labels = torch.cat([b[1] for b in batches])
    logits = reference.out(torch.tanh(reference.hidden(reference.embed(ids))))
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="mean")
    names = [n for n, _ in reference.named_parameters()]
    grads = torch.autograd.grad(loss, [p for _, p in reference.named_parameters()])
    return dict(zip(names, grads))


def compare(applied, full, expected=1.0):
    """(max over tensors of max|A/e-F| / max|F|, ||A/e-F|| / ||F||, c of the fit A = c F), e the expected factor."""
    c = sum(float((applied[n] * f).sum()) for n, f in full.items()) / sum(float((f ** 2).sum()) for f in full.values())
    applied = {n: a / expected for n, a in applied.items()}
    per_tensor = max(float((applied[n] - f).abs().max() / f.abs().max()) for n, f in full.items())
    diff = sum(float(((applied[n] - f) ** 2).sum()) for n, f in full.items()) ** 0.5
    norm = sum(float((f ** 2).sum()) for f in full.values()) ** 0.5
    return per_tensor, diff / norm, c


def run(deepspeed, stage, accum, extra=None, scale_wrt_gas=True):
    """One engine, WINDOWS optimizer steps; the (per-tensor, norm-wise, factor) of its worst step, A divided
    by the factor expected (N where the loop leaves the division by N out: scale_wrt_gas=False)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Tiny()
    config = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": accum,
              "train_batch_size": ROWS * accum * world, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9, **(extra or {})}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    dtype = next(engine.module.parameters()).dtype
    stream = micro_batches(WINDOWS * accum * world)
    worst = (0.0, 0.0, None)
    for i in range(WINDOWS * accum):
        ids, labels = stream[i * world + rank]
        loss = engine(ids, labels)
        engine.backward(loss, scale_wrt_gas=scale_wrt_gas)
        if engine.is_gradient_accumulation_boundary():
            applied = {n: deepspeed.utils.safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
            applied = {n: g.detach().to(torch.float64) for n, g in applied.items()}
            start = (i + 1 - accum) * world
            full = window_gradient(engine.module, stream[start:start + accum * world])
            found = compare(applied, full, 1.0 if scale_wrt_gas else float(accum))
            if found[1] >= worst[1]:
                worst = found
        engine.step()
    engine.destroy()
    return dtype, worst


def main():
    import deepspeed
    import deepspeed.ops

    if os.environ.get("GROUND_TRUTH_NO_SHM"):
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = []
    for stage in (1, 2):
        for accum in (2, 4):
            runs.append((f"ZeRO-{stage} float32 N={accum}", stage, accum, None, True))
    runs.append(("ZeRO-1 float32 N=4 scale_wrt_gas=False", 1, 4, None, False))
    runs.append(("ZeRO-2 float32 N=4 scale_wrt_gas=False", 2, 4, None, False))
    for stage in (1, 2):
        runs.append((f"ZeRO-{stage} bf16 N=4", stage, 4, {"bf16": {"enabled": True}}, True))
        for accum_dtype in ("fp32", "bf16"):
            runs.append((f"ZeRO-{stage} bf16 grad_accum_dtype={accum_dtype} N=4", stage, 4,
                         {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": accum_dtype}}, True))
        runs.append((f"ZeRO-{stage} float32 grad_accum_dtype=bf16 N=4", stage, 4,
                     {"data_types": {"grad_accum_dtype": "bf16"}}, True))
        runs.append((f"ZeRO-{stage} fp16 N=4", stage, 4, {"fp16": {"enabled": True, "initial_scale_power": 8}}, True))
    failed = 0
    lines = []
    for label, stage, accum, extra, scale in runs:
        try:
            dtype, (per_tensor, normwise, c) = run(deepspeed, stage, accum, extra, scale)
            line = (f"{label:<45} params {str(dtype).removeprefix('torch.'):<8} max rel diff {per_tensor:.2e}  "
                    f"||A-F||/||F|| {normwise:.2e}  factor c = {c:.9f}")
            if extra is None:
                expected = 1.0 if scale else float(accum)
                if abs(c - expected) > 1e-6 * expected or per_tensor > 1e-6:
                    failed += 1
                    line += f"  FAIL (expected c = {expected:g}, within 1e-6)"
        except Exception as exc:  # a configuration DeepSpeed refuses on the CPU: its own first line
            text = (str(exc).strip().splitlines() or [""])[0]
            line = f"{label:<45} refused: {type(exc).__name__}: {text[:300]}"
            dist.barrier()
        lines.append(line)
        if rank == 0:
            print(line, flush=True)
    if rank == 0:
        print(f"ground_truth_deepspeed: {world} ranks, torch {torch.__version__}, deepspeed {deepspeed.__version__}; "
              f"{'FAILED' if failed else 'float32 runs faithful'}", flush=True)
    dist.barrier()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Ground truth for what the optimizer step did in examples/loop_step.py, measured with no accumcheck code.

    python ci/ground_truth_step.py     # prints JSON: {"correct": ..., "keras-19990": ...}

The example's model, data and AdamW(lr=1e-3, weight_decay=0.1) run in float64, N = 4, three windows, clipping to
1.0. Before each window the parameters and AdamW's state are copied; after its step, a fresh AdamW on copies of
those parameters, given that state, is stepped once on the gradient of the window's micro-batches JOINED as one
batch (cross-entropy's mean over the joined batch), clipped to 1.0 as the loop clips. Printed per loop: the largest
|update - that one step| over the largest |one step|, over the first window ("correct": the loop steps, clips and
schedules once per window; "keras-19990": it clips, decays and advances Adam's step count at every micro-step, as
Keras 3.0-3.4 did, keras#19990).
"""

import copy
import json
import sys

import torch
import torch.nn.functional as F

N = 4


def run(fault: str | None) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    data = [(torch.randn(16, 8).double(), torch.randint(0, 4, (16,))) for _ in range(N)]
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    state = copy.deepcopy(optimizer.state_dict())
    for i, (x, y) in enumerate(data):
        (F.cross_entropy(model(x), y) / N).backward()
        if fault == "keras-19990":
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            if i < N - 1:
                with torch.no_grad():
                    for p in params:
                        p.mul_(1 - 1e-3 * 0.1)
    if fault is None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    # one step of AdamW from the window's start on the window's gradient as one batch
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for t, b in zip(twin.parameters(), before):
            t.copy_(b)
    x = torch.cat([x for x, _ in data])
    y = torch.cat([y for _, y in data])
    grads = torch.autograd.grad(F.cross_entropy(twin(x), y), list(twin.parameters()))
    for t, g in zip(twin.parameters(), grads):
        t.grad = g
    torch.nn.utils.clip_grad_norm_(list(twin.parameters()), 1.0)
    once = torch.optim.AdamW(twin.parameters(), lr=1e-3, weight_decay=0.1)
    once.load_state_dict(state)
    once.step()
    gap = max(float((p.detach() - t.detach()).abs().max()) for p, t in zip(params, twin.parameters()))
    scale = max(float((t.detach() - b).abs().max()) for t, b in zip(twin.parameters(), before))
    assert "accumcheck" not in sys.modules
    return gap / scale


if __name__ == "__main__":
    print(json.dumps({"correct": run(None), "keras-19990": run("keras-19990")}))

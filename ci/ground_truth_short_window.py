"""Ground truth without accumcheck for the memory-budget and sampled checks: a GPT-2 (built from a
config) under the Trainer, gradient_accumulation_steps = 4, sequences of one length, 10 micro-batches
an epoch (windows of 4, 4 and 2), 2 epochs, no clipping. At every optimizer step the gradient the
optimizer is handed (its step pre-hook) is set beside the window's gradient as one batch, computed in
float64 on a copy of the model as the window began: the least-squares factor between them and the
largest residual. ``--fault``: a compute_loss that divides the model's mean by
gradient_accumulation_steps (right for a full window of equal micro-batches, k/N of a short one).

    python ci/ground_truth_short_window.py [--fault]
"""
import copy
import sys
import tempfile

import torch
import transformers

FAULT = "--fault" in sys.argv
torch.manual_seed(0)
cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=32,
                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = transformers.GPT2LMHeadModel(cfg)
g = torch.Generator().manual_seed(3)
data = []
for _ in range(10):
    ids = torch.randint(0, 500, (16,), generator=g).tolist()
    data.append({"input_ids": ids, "labels": ids})
collate = lambda fs: {k: torch.tensor([f[k] for f in fs]) for k in ("input_ids", "labels")}

class T(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if FAULT:
            return model(**inputs).loss / self.args.gradient_accumulation_steps
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=1,
                                      gradient_accumulation_steps=4, num_train_epochs=2, learning_rate=1e-3,
                                      report_to="none", save_strategy="no", logging_strategy="no", use_cpu=True,
                                      disable_tqdm=True, seed=0, max_grad_norm=0.0)
trainer = T(model=model, args=args, train_dataset=data, data_collator=collate)
window, start, ratios = [], [None], []
orig = trainer.training_step
def step(m, inputs, *a, **k):
    if not window:
        start[0] = copy.deepcopy(model).double()
    window.append({k2: v.clone() for k2, v in inputs.items()})
    return orig(m, inputs, *a, **k)
trainer.training_step = step
def pre(opt, *_):
    applied = [p.grad.double().clone() for p in model.parameters()]
    ref = start[0]
    ref.zero_grad()
    joined = {k: torch.cat([b[k] for b in window]) for k in window[0]}
    ref(**joined).loss.backward()  # the joined window's token mean
    num = sum(float((a * r.grad).sum()) for a, r in zip(applied, ref.parameters()))
    den = sum(float((r.grad * r.grad).sum()) for r in ref.parameters())
    res = max(float((a - num / den * r.grad).abs().max() / r.grad.abs().max()) for a, r in zip(applied, ref.parameters()))
    ratios.append((len(window), round(num / den, 6), f"{res:.1e}"))
    window.clear()
class CB(transformers.TrainerCallback):
    def on_train_begin(self, args, state, control, optimizer=None, **kw):
        optimizer.optimizer.register_step_pre_hook(pre)
trainer.add_callback(CB())
trainer.train()
print("fault" if FAULT else "correct", ratios)

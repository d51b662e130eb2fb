"""The ground truth of examples/trainer_ddp.py, measured without accumcheck: under torchrun on 2
ranks, the gradient the Trainer's optimizer applies at each step (clipping off) against the
gradient of every rank's micro-batches of that step as one batch, in float32, on a copy of the
model taken at the step; and that ratio against each rank's own-batch weighting.

    torchrun --nproc_per_node 2 ci/ground_truth_trainer_ddp.py [--per-rank-tokens]

Prints, on rank 0, per step: the least-squares factor of applied on window, the relative residual
|applied - factor x window| / |applied|, and the factor predicted/labelled tokens of the window.
"""

import copy
import os
import runpy
import sys

import torch
import torch.distributed as dist

example = runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "examples", "trainer_ddp.py"))
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments  # noqa: E402

per_rank = "--per-rank-tokens" in sys.argv
torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64)
args = TrainingArguments(output_dir="/tmp/ground-truth-trainer", per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3, report_to="none",
                         logging_strategy="no", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
                         average_tokens_across_devices=not per_rank, ddp_backend="gloo", max_grad_norm=0.0)
seen = []


class Recording(example["InOrder"]):
    """The Trainer, each micro-batch it computes a loss on kept (its loader reads ahead of the step)."""

    def compute_loss(self, model, inputs, *rest, **kwargs):
        seen.append({k: v.detach().cpu() for k, v in inputs.items() if k in ("input_ids", "attention_mask", "labels")})
        return super().compute_loss(model, inputs, *rest, **kwargs)


trainer = Recording(model=LlamaForCausalLM(config), args=args, train_dataset=example["sequences"](),
                    data_collator=example["pad"])
rows = []


def at_step(optimizer, *_):
    model = trainer.model.module if hasattr(trainer.model, "module") else trainer.model
    applied = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, seen[-2:])  # this rank's two micro-batches of the step
    batches = [gathered[r][i] for i in range(2) for r in range(len(gathered))]  # global order i x W + r
    width = max(b["input_ids"].shape[1] for b in batches)
    joined = {k: torch.cat([torch.nn.functional.pad(b[k], (0, width - b[k].shape[1]), value=-100 if k == "labels"
                                                    else 0) for b in batches]) for k in batches[0]}
    reference = copy.deepcopy(model)
    reference.zero_grad(set_to_none=True)
    reference(**joined).loss.backward()
    window = torch.cat([p.grad.reshape(-1) for p in reference.parameters()]).double()
    factor = float(applied @ window / (window @ window))
    residual = float((applied - factor * window).norm() / applied.norm())
    labelled = int((joined["labels"] != -100).sum())
    predicted = int((joined["labels"][:, 1:] != -100).sum())
    rows.append((factor, residual, predicted / labelled))


trainer.create_optimizer()
trainer.optimizer.register_step_pre_hook(at_step)
trainer.train()
if dist.get_rank() == 0:
    for step, (factor, residual, shift) in enumerate(rows):
        print(f"step {step}: applied = {factor:.4f} x window (residual {residual:.1e}); predicted/labelled {shift:.4f}")

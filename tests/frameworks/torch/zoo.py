"""Models as people write them, built from code with random weights (nothing downloaded): a GPT
with tied input and output embeddings in the style of nanoGPT, a ResNet-18-shaped network with
BatchNorm, and a tiny Hugging Face Llama."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 61
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        y = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's shape: token and position embeddings, pre-norm blocks, the output head tied to
    the token embedding; ``forward(idx, targets)`` returns ``(logits, loss)``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd), wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)), ln_f=nn.LayerNorm(config.n_embd)))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def gpt_batches(n: int, config: GPTConfig = GPTConfig(), batch: int = 2, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, config.vocab_size, (batch, config.block_size + 1), generator=gen)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet18(nn.Module):
    """torchvision's resnet18 topology (a 7x7 stem, max-pool, four stages of two basic blocks,
    BatchNorm everywhere), at a quarter of its widths by default."""

    def __init__(self, classes: int = 10, width: int = 16):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        widths = [width, 2 * width, 4 * width, 8 * width]
        stages, cin = [], width
        for i, w in enumerate(widths):
            stages.append(nn.Sequential(BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)))
            cin = w
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        for stage in (self.layer1, self.layer2, self.layer3, self.layer4):
            x = stage(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def image_batches(n: int, batch: int = 4, size: int = 32, classes: int = 10, seed: int = 2):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, size, size, generator=gen), torch.randint(0, classes, (batch,), generator=gen))
            for _ in range(n)]


def tiny_llama(seed: int = 0):
    """A ``transformers`` LlamaForCausalLM from a tiny config: hidden size 32, 2 layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="eager")
    return LlamaForCausalLM(config)


def token_batches(n: int, batch: int = 2, length: int = 12, vocab: int = 64, seed: int = 3, ragged: bool = True):
    """Dict batches for a causal LM, padded to ``length``: sequences of random lengths (ragged),
    the padding masked out and labelled -100, so micro-batches hold different numbers of tokens."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, vocab, (batch, length), generator=gen)
        lengths = torch.randint(2, length + 1, (batch,), generator=gen) if ragged else torch.full((batch,), length)
        mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
        out.append({"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


class TinyLM(torch.nn.Module):
    """Embedding, dropout, linear head; its loss is the token mean over the labelled positions of
    the batch it is given, or the token sum over ``num_items_in_batch``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(11, 6)
        self.drop = torch.nn.Dropout(0.2)
        self.head = torch.nn.Linear(6, 11)

    def forward(self, input_ids, labels=None, num_items_in_batch=None):
        logits = self.head(self.drop(self.emb(input_ids)))
        out = {"logits": logits}
        if labels is not None:
            total = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=-100, reduction="sum")
            out["loss"] = total / (num_items_in_batch if num_items_in_batch is not None else (labels != -100).sum())
        return out


def lm_batches(count, variable=False):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        ids = torch.randint(0, 11, (2, 8), generator=gen)
        labels = ids.clone()
        if variable:
            lengths = torch.randint(2, 9, (2, 1), generator=gen)
            labels[torch.arange(8) >= lengths] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out

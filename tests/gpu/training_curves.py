"""Shared by the GPU tests that compare loss curves: a small Qwen3 trained for a few steps on
learnable packed batches (runs of consecutive token ids, one single-token sample per batch)."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import hasten
from hasten.config import Config
from hasten.packing import move_batch

VOCAB = 32000


def learnable_batches(n: int, seed: int = 1) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    collator = hasten.PackingCollator(max_tokens=8192)
    out = []
    for _ in range(n):
        starts = torch.randint(0, VOCAB, (20,), generator=gen).tolist()
        lengths = [1] + torch.randint(2, 700, (19,), generator=gen).tolist()
        samples = [{"input_ids": [(s + i) % VOCAB for i in range(k)]} for s, k in zip(starts, lengths)]
        out.append(move_batch(collator(samples), "cuda"))
    return out


def train_curve(kernels: dict, batches: list[dict]) -> tuple[list[float], int]:
    """Losses of AdamW steps on `batches` with hasten's `kernels` switches, and the peak memory."""
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    model = Qwen3ForCausalLM(config).to("cuda", torch.bfloat16).train()
    handle = hasten.accelerate(model, Config.from_dict({"kernels": kernels}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.cuda.reset_peak_memory_stats()
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated()
    handle.undo()
    return losses, peak

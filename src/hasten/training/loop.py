"""The training loop behind `hasten train` (first cut: one process, one device)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

import hasten
from hasten.config import Config, ConfigError
from hasten.data import ByteTokenizer, load_dataset
from hasten.observability import fallback_counts, fallback_reasons, logger, reset_fallbacks
from hasten.packing import IGNORE_INDEX, PackingCollator, TokenBudgetBatchSampler, move_batch
from hasten.training.defaults import embedded_model_config
from hasten.training.metrics import MetricsLog, format_row, peak_memory_gib


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    losses: list[float]
    tokens: int
    metrics_path: Path
    model_dir: Path


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device is 'cuda' but no CUDA GPU is visible; use 'auto' or 'cpu'")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


def resolve_dtype(choice: str, device: torch.device) -> torch.dtype:
    if choice == "auto":
        bf16_ok = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16_ok else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[choice]


def load_model_and_tokenizer(config: Config, dtype: torch.dtype):
    path = config.model.path
    if not path:
        model = __import__("transformers").Qwen3ForCausalLM(embedded_model_config(config.model.default_size))
        return model.to(dtype), ByteTokenizer()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not Path(path).is_dir():
        raise ConfigError(f"model.path {path} is not a folder; give a local transformers model folder "
                          "(config.json and weights), or leave it empty for the embedded default model")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model, tokenizer


def _pad_collate(pad_token_id: int):
    """Padded micro-batches (training.packed_sequence false): the unpacked baseline."""

    def collate(samples: list[dict]) -> dict[str, Any]:
        samples = [s for s in samples if s["input_ids"]]
        width = max((len(s["input_ids"]) for s in samples), default=0)
        ids = torch.full((len(samples), width), pad_token_id, dtype=torch.long)
        labels = torch.full_like(ids, IGNORE_INDEX)
        mask = torch.zeros_like(ids)
        for row, s in enumerate(samples):
            n = len(s["input_ids"])
            ids[row, :n] = torch.tensor(s["input_ids"])
            labels[row, :n] = torch.tensor(s.get("labels") or s["input_ids"])
            mask[row, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask, "num_samples": len(samples)}

    return collate


def _lr_factor(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))  # cosine to 10%


def _batches_forever(loader: DataLoader, sampler: TokenBudgetBatchSampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def train(config: Config, output_dir: str | Path, log_dir: str | Path, *, progress: bool = True) -> TrainResult:
    output_dir, log_dir = Path(output_dir), Path(log_dir)
    for folder in (output_dir, log_dir):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create {folder}: {exc.strerror}; choose a writable folder") from exc
    t = config.training
    reset_fallbacks()
    torch.manual_seed(t.seed)
    device = resolve_device(t.device)
    dtype = resolve_dtype(t.dtype, device)
    model, tokenizer = load_model_and_tokenizer(config, dtype)
    model.to(device).train()
    handle = hasten.accelerate(model, config)
    for line in handle.report().splitlines():
        logger.info(line)

    samples = load_dataset(config.data.path, tokenizer, text_field=config.data.text_field)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    sampler = TokenBudgetBatchSampler([len(s["input_ids"]) for s in samples], t.max_tokens, seed=t.seed)
    collator = PackingCollator(t.max_tokens, overlong=t.overlong, pad_token_id=pad_id)
    collate = collator if t.packed_sequence else _pad_collate(pad_id)
    loader = DataLoader(samples, batch_sampler=sampler, collate_fn=collate, pin_memory=device.type == "cuda")

    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.learning_rate, weight_decay=t.weight_decay,
                                  fused=fused)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, t.warmup_steps, t.max_steps))

    metrics = MetricsLog(log_dir)
    (log_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    batches = _batches_forever(loader, sampler)
    losses: list[float] = []
    total_tokens = 0
    window_tokens, window_loss, window_micro = 0, torch.zeros((), device=device), 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    window_start = time.perf_counter()
    bar = tqdm(total=t.max_steps, desc="hasten train", unit="step", disable=None if progress else True,
               dynamic_ncols=True)  # None: no bar when the output is not a terminal
    for step in range(t.max_steps):
        for _ in range(t.gradient_accumulation_steps):
            batch = next(batches)
            while batch["num_samples"] == 0:  # every sample of this batch was empty or dropped
                batch = next(batches)
            batch = move_batch(batch, device)
            tokens = int(batch["input_ids"].numel() if t.packed_sequence else batch["attention_mask"].sum())
            window_tokens += tokens
            loss = model(**batch).loss / t.gradient_accumulation_steps
            loss.backward()
            window_loss += loss.detach()
            window_micro += 1
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        bar.update(1)
        if (step + 1) % t.logging_steps == 0 or step + 1 == t.max_steps:
            mean_loss = float(window_loss) * t.gradient_accumulation_steps / window_micro  # syncs once
            elapsed = time.perf_counter() - window_start
            steps_in_window = window_micro // t.gradient_accumulation_steps
            row = {"step": step + 1, "loss": mean_loss, "lr": scheduler.get_last_lr()[0],
                   "tokens": window_tokens, "tokens_per_s": window_tokens / elapsed,
                   "step_s": elapsed / steps_in_window, "peak_gib": peak_memory_gib(device),
                   "packing_efficiency": collator.stats.efficiency if t.packed_sequence else None,
                   "fallbacks": fallback_counts()}
            metrics.write(row)
            bar.set_postfix(loss=f"{mean_loss:.3f}", tok_s=f"{row['tokens_per_s']:,.0f}")
            tqdm.write(format_row(row))
            losses.append(mean_loss)
            total_tokens += window_tokens
            window_tokens, window_loss, window_micro = 0, torch.zeros((), device=device), 0
            window_start = time.perf_counter()
    bar.close()

    model_dir = output_dir / "final"
    model.save_pretrained(model_dir, safe_serialization=True)
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(model_dir)
    summary = {"steps": t.max_steps, "final_loss": losses[-1], "tokens": total_tokens, "device": str(device),
               "dtype": str(dtype), "packing": collator.stats.as_dict() if t.packed_sequence else None,
               "hasten_active": handle.active, "hasten_inactive": handle.inactive,
               "fallbacks": fallback_counts(), "fallback_reasons": fallback_reasons()}
    (log_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    metrics.close()
    handle.undo()
    return TrainResult(t.max_steps, losses[-1], losses, total_tokens, metrics.path, model_dir)

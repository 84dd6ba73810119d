"""The training loop behind `hasten train` (first cut: one process, one device)."""

from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

import hasten
from hasten.config import Config, ConfigError
from hasten.data import ByteTokenizer, DataError, load_dataset
from hasten.data.tokenizer import check_tokenizer_fits, load_model_tokenizer
from hasten.observability import count_host_syncs, fallback_counts, fallback_reasons, logger, reset_fallbacks
from hasten.packing import IGNORE_INDEX, PackingCollator, TokenBudgetBatchSampler
from hasten.training.checkpoint import (CheckpointError, TrainerState, latest_valid, load_checkpoint, save_checkpoint,
                                       save_final_model, verify)
from hasten.training.defaults import embedded_model_config
from hasten.training.distributed import all_reduce_sum, from_environment, gradient_sync, shutdown, wrap_model
from hasten.training.metrics import HostLeadMeter, MetricsLog, format_row, peak_memory_gib, profiled_step
from hasten.training.prefetch import NextBatchPrefetcher
from hasten.training.telemetry import GpuMonitor, TensorBoardSink, redact, version_record


@dataclass
class TrainResult:
    steps: int                 # optimizer steps completed in total (resumed ones included)
    final_loss: float
    losses: list[float]        # mean loss of each logging window of this process
    tokens: int
    metrics_path: Path
    model_dir: Path | None     # the final model; None when the run was interrupted
    interrupted_by: str | None = None   # "SIGTERM" / "SIGINT" when a signal stopped it
    resumed_from: Path | None = None
    last_checkpoint: Path | None = None


class _StopRequest:
    """SIGTERM / SIGINT set a flag; the loop saves a checkpoint after the current step and stops."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "_StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.signal_name = signal.Signals(signum).name
        logger.warning("hasten: %s received; saving a checkpoint after the current step, then stopping",
                       self.signal_name)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


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
    from transformers import AutoModelForCausalLM

    if not Path(path).is_dir():
        raise ConfigError(f"model.path {path} is not a folder; give a local transformers model folder "
                          "(config.json and weights), or leave it empty for the embedded default model")
    tokenizer = load_model_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    check_tokenizer_fits(tokenizer, model, path)
    return model, tokenizer


def _pad_collate(collator: PackingCollator, pad_token_id: int):
    """Padded micro-batches (training.packed_sequence false): the unpacked baseline, with the
    same validation, truncation and drops as the packed path (the collator's)."""

    def collate(samples: list[dict]) -> dict[str, Any]:
        prepared = collator.prepare_samples(samples)
        width = max((len(ids) for ids, _ in prepared), default=0)
        ids = torch.full((len(prepared), width), pad_token_id, dtype=torch.long)
        labels = torch.full_like(ids, IGNORE_INDEX)
        mask = torch.zeros_like(ids)
        for row, (sample_ids, sample_labels) in enumerate(prepared):
            n = len(sample_ids)
            ids[row, :n] = torch.from_numpy(sample_ids)
            labels[row, :n] = torch.from_numpy(sample_labels)
            mask[row, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask, "num_samples": len(prepared)}

    return collate


def _with_lora(model, config: Config, ctx):
    """LoRA adapters through PEFT on the (already hasten-patched) model; only they train."""
    try:
        import peft
    except ImportError as exc:
        raise ConfigError("lora.enabled needs PEFT: pip install peft") from exc
    if ctx.strategy == "fsdp2":
        raise ConfigError("lora.enabled with training.distributed fsdp2 is not supported yet; use ddp")
    lora = config.lora
    targets = [name.strip() for name in lora.target_modules.split(",") if name.strip()]
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                         target_modules=targets, task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum(p.numel() for p in wrapped.parameters())
    if ctx.is_main:
        logger.info("hasten: LoRA r=%d on %s: %d of %d parameters train (%.2f%%)", lora.r, ",".join(targets),
                    trainable, total, 100 * trainable / total)
    return wrapped


def _lr_factor(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))  # cosine to 10%


def _batches_from(loader: DataLoader, sampler: TokenBudgetBatchSampler, epoch: int, skip: int):
    """(epoch, batches consumed in that epoch, batch), forever, starting `skip` batches into `epoch`."""
    while True:
        sampler.set_epoch(epoch, skip=skip)
        for consumed, batch in enumerate(loader, start=skip + 1):
            if batch["num_samples"]:  # else every sample of the batch was empty or dropped
                yield epoch, consumed, batch
        epoch, skip = epoch + 1, 0


def _resolve_resume(resume: str | None, checkpoints: Path) -> Path | None:
    if resume in (None, "", "none"):
        earlier = sorted(p.name for p in checkpoints.glob("checkpoint-*")) if checkpoints.is_dir() else []
        if earlier:  # a fresh run here would mix its checkpoints with another run's
            raise ConfigError(f"{checkpoints} already holds checkpoints of an earlier run ({earlier[-1]}, ...); "
                              "continue it with --resume auto, or train into a new --output_dir")
        return None
    if resume == "auto":
        found = latest_valid(checkpoints)
        if found is None:
            logger.info("hasten: --resume auto found no complete checkpoint in %s; starting fresh", checkpoints)
        return found
    path = Path(resume)
    try:
        verify(path)
    except CheckpointError as exc:
        raise ConfigError(f"--resume {resume}: {exc}; pass another checkpoint folder or --resume auto") from exc
    return path


def train(config: Config, output_dir: str | Path, log_dir: str | Path, *, progress: bool = True,
          resume: str | None = None) -> TrainResult:
    """Train per `config`; `resume` is None, "auto" (newest complete checkpoint, if any) or a checkpoint folder."""
    output_dir, log_dir = Path(output_dir), Path(log_dir)
    for folder in (output_dir, log_dir):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create {folder}: {exc.strerror}; choose a writable folder") from exc
    t = config.training
    ctx = from_environment(t.distributed)
    checkpoints = output_dir / "checkpoints"
    resume_from = _resolve_resume(resume, checkpoints)
    reset_fallbacks()
    torch.manual_seed(t.seed)
    device = resolve_device(t.device)
    if device.type == "cuda" and ctx.enabled:
        device = torch.device("cuda", ctx.local_rank)
    dtype = resolve_dtype(t.dtype, device)
    model, tokenizer = load_model_and_tokenizer(config, dtype)
    model.to(device).train()
    handle = hasten.accelerate(model, config)
    if ctx.is_main:
        for line in handle.report().splitlines():
            logger.info(line)
    if config.lora.enabled:
        model = _with_lora(model, config, ctx)
    hf_model = model
    model = wrap_model(model, ctx, device, reshard_after_forward=t.fsdp2_reshard_after_forward,
                       layers_per_unit=t.fsdp2_layers_per_unit)
    if ctx.enabled and ctx.is_main:
        logger.info("hasten: %s over %d processes", ctx.strategy, ctx.world_size)

    samples = load_dataset(config.data.path, tokenizer, text_field=config.data.text_field,
                           assistant_roles=config.data.assistant_roles)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    sampler = TokenBudgetBatchSampler([len(s["input_ids"]) for s in samples], t.max_tokens, seed=t.seed,
                                      rank=ctx.rank, world_size=ctx.world_size)
    # An epoch of nothing but empty or dropped samples would make the batch loop spin forever.
    fits = (lambda n: n <= t.max_tokens) if t.overlong == "drop" else (lambda n: True)
    if not any(s["input_ids"] and fits(len(s["input_ids"])) for s in samples):
        dropped = " or longer than training.max_tokens (overlong: drop)" if t.overlong == "drop" else ""
        raise DataError(f"{config.data.path or 'the embedded corpus'}: no sample can be trained on (all are "
                        f"empty{dropped}); check the data file and training.max_tokens")
    if len(sampler) == 0:
        raise DataError(f"the data set makes fewer packed batches than there are processes ({ctx.world_size}) at "
                        f"training.max_tokens={t.max_tokens}; use more data or a smaller max_tokens")
    if ctx.world_size > 1 and ctx.is_main:
        # every collective waits for the slowest rank: say how even the work is (sampler balances it)
        logger.info("hasten: rank balance over an epoch: the busiest rank's compute is %.2fx the mean "
                    "(1.00 is even; long outlier samples raise it)", sampler.rank_imbalance())
    collator = PackingCollator(t.max_tokens, overlong=t.overlong, pad_token_id=pad_id)
    collate = collator if t.packed_sequence else _pad_collate(collator, pad_id)
    loader = DataLoader(samples, batch_sampler=sampler, collate_fn=collate, pin_memory=device.type == "cuda")

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=t.learning_rate, weight_decay=t.weight_decay,
                                  fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, t.warmup_steps, t.max_steps))
    state = TrainerState(step=0, epoch=0, batches_in_epoch=0)
    if resume_from is not None:
        state = load_checkpoint(resume_from, model, optimizer, scheduler, ctx)
        logger.info("hasten: resumed from %s at step %d", resume_from, state.step)

    # Rank 0 reports for the whole job; the other ranks write nothing.
    metrics = MetricsLog(log_dir) if ctx.is_main else None
    tensorboard = TensorBoardSink(log_dir, config.logging.tensorboard if ctx.is_main else "false")
    gpu_monitor = GpuMonitor(device) if config.logging.gpu_monitor and ctx.is_main else None
    if ctx.is_main:
        (log_dir / "config.json").write_text(json.dumps(redact(config.to_dict()), indent=2))
        (log_dir / "versions.json").write_text(json.dumps(redact(version_record()), indent=2))
    # the next batch's copy to the GPU runs on a side stream while the current step computes
    batches = NextBatchPrefetcher(_batches_from(loader, sampler, state.epoch, state.batches_in_epoch), device,
                                  batch_of=lambda item: item[2])
    losses: list[float] = []
    window_tokens, window_loss, window_micro = 0, torch.zeros((), device=device), 0
    window_checkpoint_s = 0.0  # checkpoint writing inside the window: reported apart from the step rate
    window_syncs = 0  # host syncs of the window's first step
    sync_sites_reported = False
    last_checkpoint: Path | None = resume_from
    host_lead = HostLeadMeter(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)  # the first window's anchor needs an idle GPU
    host_lead.start_window()
    window_start = time.perf_counter()
    bar = tqdm(total=t.max_steps, initial=state.step, desc="hasten train", unit="step",
               disable=None if progress and ctx.is_main else True,  # None: no bar off a terminal
               dynamic_ncols=True)
    stopping = False  # the whole job stops (ranks agree at a logging step)
    with _StopRequest() as stop:
        while state.step < t.max_steps and not stopping:
            # The first step of each logging window counts its host syncs (torch's sync debug mode;
            # cheap when there are none, which is the point). 0 without CUDA.
            syncs_probe = (count_host_syncs(record_sites=not sync_sites_reported) if window_micro == 0
                           else contextlib.nullcontext())
            profiler = (profiled_step(log_dir, state.step + 1, ctx.rank, device)
                        if config.logging.profile_step == state.step + 1 else contextlib.nullcontext())
            with profiler, syncs_probe as probed:
                for micro in range(t.gradient_accumulation_steps):
                    (state.epoch, state.batches_in_epoch, host_batch), batch = next(batches)
                    # non-padding tokens, counted on the host copy (no device read-back)
                    window_tokens += int(host_batch["input_ids"].numel() if t.packed_sequence
                                         else host_batch["attention_mask"].sum())
                    with gradient_sync(model, ctx, last_micro_batch=micro == t.gradient_accumulation_steps - 1):
                        loss = model(**batch).loss / t.gradient_accumulation_steps
                        host_lead.mark(step_start=micro == 0)
                        loss.backward()
                        host_lead.mark()
                    window_loss += loss.detach()
                    window_micro += 1
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                host_lead.mark()
            if probed is not None:
                window_syncs = probed.count
                if probed.sites and not sync_sites_reported and ctx.is_main:
                    sync_sites_reported = True  # once per run: where the step waits for the GPU
                    logger.info("hasten: %d host sync(s) in one training step, at: %s", probed.count,
                                "; ".join(sorted(set(probed.sites))))
            state.step += 1
            bar.update(1)
            # Alone, a signal stops after this step; under torchrun the ranks agree at the next logging step.
            stopping = stop.signal_name is not None and not ctx.enabled
            if state.step % t.logging_steps == 0 or state.step == t.max_steps or stopping:
                # one read-back (and, under torchrun, one small all-reduce) per logging step
                signalled = float(stop.signal_name is not None)
                window_loss_sum = float(window_loss)  # waits for the GPU: the window's events are done
                tokens_all, loss_all, micro_all, stop_all, *leads = all_reduce_sum(
                    [window_tokens, window_loss_sum, window_micro, signalled,
                     *host_lead.rank_slots(ctx.rank, ctx.world_size)], ctx, device)
                stopping = stopping or stop_all > 0
                mean_loss = loss_all * t.gradient_accumulation_steps / micro_all
                elapsed = time.perf_counter() - window_start - window_checkpoint_s
                row = {"step": state.step, "loss": mean_loss, "lr": scheduler.get_last_lr()[0],
                       "tokens": int(tokens_all), "tokens_per_s": tokens_all / elapsed,
                       "step_s": elapsed / (window_micro // t.gradient_accumulation_steps),
                       "checkpoint_s": window_checkpoint_s, "host_syncs_per_step": window_syncs,
                       "peak_gib": peak_memory_gib(device),
                       # the most host-bound rank's margin, and the least (see HostLeadMeter)
                       "host_lead_ms": min(leads) if leads else None,
                       "host_lead_ms_max": max(leads) if leads else None,
                       "packing_efficiency": collator.stats.efficiency if t.packed_sequence else None,
                       "fallbacks": fallback_counts()}
                if handle.moe_stats is not None:
                    row["moe"] = handle.moe_stats.summary()
                if handle.offload is not None:
                    row["offload"] = handle.offload.summary()
                if gpu_monitor is not None and (gpu := gpu_monitor.read()) is not None:
                    row["gpu"] = gpu
                if ctx.is_main:
                    host_lead.report(row["host_lead_ms"])
                    metrics.write(row)
                    tensorboard.write(row)
                    bar.set_postfix(loss=f"{mean_loss:.3f}", tok_s=f"{row['tokens_per_s']:,.0f}")
                    tqdm.write(format_row(row))
                losses.append(mean_loss)
                state.tokens += int(tokens_all)
                state.losses.append(mean_loss)
                window_tokens, window_loss, window_micro = 0, torch.zeros((), device=device), 0
                window_checkpoint_s = 0.0
                host_lead.start_window()
                window_start = time.perf_counter()
            if not ctx.enabled:  # a signal that came during this step's logging still stops here
                stopping = stopping or stop.signal_name is not None
            if state.step % t.checkpoint.interval_steps == 0 or stopping:
                saving_since = time.perf_counter()
                last_checkpoint = save_checkpoint(checkpoints, state, model, optimizer, scheduler,
                                                  keep_last=t.checkpoint.keep_last, ctx=ctx)
                window_checkpoint_s += time.perf_counter() - saving_since
                if ctx.is_main:
                    tqdm.write(f"checkpoint: {last_checkpoint}")
    bar.close()

    interrupted_by = stop.signal_name if stopping else None
    model_dir = None
    if not stopping:
        model_dir = output_dir / "final"
        save_final_model(model, hf_model, model_dir, ctx)
        if ctx.is_main and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(model_dir)
    final_loss = state.losses[-1] if state.losses else float("nan")
    summary = {"steps": state.step, "final_loss": final_loss, "tokens": state.tokens, "device": str(device),
               "dtype": str(dtype), "packing": collator.stats.as_dict() if t.packed_sequence else None,
               "hasten_active": handle.active, "hasten_inactive": handle.inactive,
               "fallbacks": fallback_counts(), "fallback_reasons": fallback_reasons(),
               "interrupted_by": interrupted_by, "world_size": ctx.world_size,
               "distributed": ctx.strategy,
               "resumed_from": str(resume_from) if resume_from else None,
               "last_checkpoint": str(last_checkpoint) if last_checkpoint else None}
    if ctx.is_main:
        (log_dir / "summary.json").write_text(json.dumps(redact(summary), indent=2))
        metrics.close()
    tensorboard.close()
    handle.undo()
    shutdown(ctx)
    return TrainResult(state.step, final_loss, losses, state.tokens, log_dir / "metrics.jsonl", model_dir,
                       interrupted_by, resume_from, last_checkpoint)

"""The training loop behind `hasten train`, in stages (as a torchtune recipe is): set-up (folders,
process group, what to resume, model and tokenizer, hasten, LoRA, the distributed wrapper, data,
optimizer, resumed state, metric sinks), the train loop, the end of a run (final model, summary),
and tear-down (hasten's patches undone, sinks closed, process group left), which runs also when a
stage raises.

A run never goes on silently wrong and never loses an earlier one: a folder that holds another
run's results is refused unless --resume or --overwrite says what to do with it, a resumed
checkpoint must come from the same config (keys that may change on resume: RESUME_MAY_CHANGE), a
loss or weights that stop being finite end the run before any checkpoint holds them, and batches
with no trainable token are counted and left out of the loss.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

import hasten
from hasten.config import Config, ConfigError
from hasten.data import ByteTokenizer, DataError, load_dataset
from hasten.data.tokenizer import check_tokenizer_fits, load_model_tokenizer
from hasten.integrations.transformers import patch_lora_layers
from hasten.observability import (count_host_syncs, fallback_counts, fallback_reasons, logger, record_fallback,
                                  reset_fallbacks)
from hasten.packing import IGNORE_INDEX, PackingCollator, TokenBudgetBatchSampler, move_batch
from hasten.training.compile import compile_decoder_layers
from hasten.training.checkpoint import (CheckpointError, CheckpointWriteError, TrainerState, load_checkpoint,
                                       read_trainer_state, remove_stale_temporaries, save_checkpoint,
                                       save_final_model)
from hasten.training.defaults import embedded_model_config
from hasten.training.distributed import all_reduce_sum, from_environment, gradient_sync, shutdown, wrap_model
from hasten.training.graphed_optimizer import GraphedAdamW, build_adamw, optimizer_graph_summary
from hasten.training.graphed_step import FALLBACK as STEP_GRAPH_FALLBACK
from hasten.training.graphed_step import StepGraphs, refusal as step_graph_refusal
from hasten.training.metrics import HostLeadMeter, MetricsLog, format_row, peak_memory_gib, profiled_step
from hasten.training.prefetch import NextBatchPrefetcher
from hasten.training.run_folder import (check_resume_config, config_record, guard_earlier_run, metrics_rows,
                                        parse_allowed_changes, resolve_resume)
from hasten.training.telemetry import GpuMonitor, TensorBoardSink, redact, version_record


class DivergenceError(RuntimeError):
    """The loss or the weights stopped being finite; the message names the step, the likely causes
    and the fix. The run stops before a checkpoint or final model could hold the broken weights."""


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


def load_model_and_tokenizer(config: Config, dtype: torch.dtype, device: torch.device | None = None):
    path = config.model.path
    if not path:
        model = __import__("transformers").Qwen3ForCausalLM(embedded_model_config(config.model.default_size))
        return model.to(dtype), ByteTokenizer()
    from transformers import AutoConfig

    from hasten.integrations.support import auto_model_class

    if not Path(path).is_dir():
        raise ConfigError(f"model.path {path} is not a folder; give a local transformers model folder "
                          "(config.json and weights), or leave it empty for the embedded default model")
    tokenizer = load_model_tokenizer(path)
    auto = auto_model_class(AutoConfig.from_pretrained(path, local_files_only=True))  # VL wrappers: text here
    model = auto.from_pretrained(path, dtype=dtype, local_files_only=True,
                                 **_quantization(config.lora.quantize, dtype, device,
                                                 sharded=config.training.distributed == "fsdp2"))
    check_tokenizer_fits(tokenizer, model, path)
    return model, tokenizer


def _quantization(quantize: str, dtype: torch.dtype, device: torch.device | None, sharded: bool = False) -> dict:
    """from_pretrained's arguments for lora.quantize: NF4 through bitsandbytes, double-quantized
    statistics, computing in the training dtype (hasten's fused QLoRA path takes bf16/fp16), the
    weights quantized on `device` as they load (a 4-bit model cannot be moved with .to())."""
    if quantize == "none":
        return {}
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"lora.quantize: {quantize} needs bitsandbytes: pip install bitsandbytes") from exc
    from transformers import BitsAndBytesConfig

    return {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quantize,
                                                      bnb_4bit_compute_dtype=dtype, bnb_4bit_use_double_quant=True,
                                                      **({"bnb_4bit_quant_storage": dtype} if sharded else {})),
            "device_map": {"": str(device or "cpu")}}


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


def _linear_names(model) -> list[str]:
    """The distinct last names of the model's Linear modules (what lora.target_modules can name)."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear) and name})


def _with_lora(model, config: Config, ctx):
    """LoRA adapters through PEFT on the (already hasten-patched) model; only they train."""
    try:
        import peft
    except ImportError as exc:
        raise ConfigError("lora.enabled needs PEFT: pip install peft") from exc
    lora = config.lora
    targets = [name.strip() for name in lora.target_modules.split(",") if name.strip()]
    linear = _linear_names(model)
    if not targets:
        raise ConfigError("lora.target_modules is empty; name some of this model's Linear modules: "
                          f"{', '.join(linear)}")
    # PEFT matches a target against a module's full name or its last part(s)
    names = [name for name, _ in model.named_modules() if name]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise ConfigError(f"lora.target_modules names modules this model does not have: {', '.join(missing)}; "
                          f"its Linear modules are: {', '.join(linear)}. Set lora.target_modules to some of "
                          "them, comma-separated (e.g. q_proj,v_proj)")
    try:
        wrapped = peft.get_peft_model(model, peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha,
                                                             lora_dropout=lora.dropout, target_modules=targets,
                                                             task_type="CAUSAL_LM"))
    except Exception as exc:  # PEFT's own checks (unsupported module types, bad values): its message
        raise ConfigError(f"PEFT could not add LoRA adapters ({type(exc).__name__}: {exc}); check the lora section "
                          f"(target_modules {lora.target_modules!r}; this model's Linear modules: "
                          f"{', '.join(linear)})") from exc
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


def _has_trainable_tokens(labels: torch.Tensor) -> bool:
    """Whether a host batch has any target after the causal shift (labels[..., 0] never is one)."""
    return bool((labels[..., 1:] != IGNORE_INDEX).any())


# --- the run, in stages --------------------------------------------------------------------------

@dataclass
class _Run:
    """What set-up builds, the loop uses and tear-down releases (None: not built yet)."""
    config: Config
    output_dir: Path
    log_dir: Path
    ctx: Any = None
    device: torch.device | None = None
    dtype: torch.dtype | None = None
    resume_from: Path | None = None
    last_checkpoint: Path | None = None
    model: Any = None             # as trained (DDP/FSDP2-wrapped under torchrun)
    hf_model: Any = None          # the transformers (or PEFT) model inside
    tokenizer: Any = None
    handle: Any = None            # hasten.accelerate's; undone at tear-down
    compiled: Any = None          # training.compile's CompiledLayers; undone at tear-down
    trainable: list = field(default_factory=list)
    sampler: TokenBudgetBatchSampler | None = None
    collator: PackingCollator | None = None
    loader: DataLoader | None = None
    optimizer: Any = None
    step_graphs: StepGraphs | None = None  # training.cuda_graphs step, where it runs
    scheduler: Any = None
    state: TrainerState | None = None
    metrics: MetricsLog | None = None
    tensorboard: TensorBoardSink | None = None
    gpu_monitor: GpuMonitor | None = None
    losses: list[float] = field(default_factory=list)
    masked_batches: int = 0       # batches with no trainable token (all labels -100), all ranks
    preflight: Any = None         # (forecast, kept layers, bytes allocated then): checked at the first step
    failed: bool = True           # until the run ends normally

    @property
    def checkpoints(self) -> Path:
        return self.output_dir / "checkpoints"


def train(config: Config, output_dir: str | Path, log_dir: str | Path, *, progress: bool = True,
          resume: str | None = None, overwrite: bool = False,
          allow_config_change: tuple[str, ...] | list[str] = ()) -> TrainResult:
    """Train per `config`; `resume` is None, "auto" (newest complete checkpoint, if any) or a checkpoint folder.

    `overwrite` replaces an earlier run in `output_dir` (deleting its model, checkpoints and logs);
    `allow_config_change` names config keys that may differ from the resumed checkpoint's."""
    run = _Run(config, Path(output_dir), Path(log_dir))
    try:
        done = _set_up(run, resume, overwrite, tuple(allow_config_change))
        if done is None:
            interrupted_by = _train_loop(run, progress)
            done = _finish(run, interrupted_by)
        run.failed = False
        return done
    finally:
        _tear_down(run)


def _set_up(run: _Run, resume: str | None, overwrite: bool, allowed: tuple[str, ...]) -> TrainResult | None:
    """Everything before the first step; returns a result instead when there is nothing to train."""
    config, t = run.config, run.config.training
    output_dir, log_dir = run.output_dir, run.log_dir
    for folder in (output_dir, log_dir):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create {folder}: {exc.strerror}; choose a writable folder") from exc
    device = resolve_device(t.device)
    run.ctx = ctx = from_environment(t.distributed, device.type)
    if device.type == "cuda" and ctx.enabled:
        device = torch.device("cuda", ctx.local_rank)
    run.device = device

    # what to continue from, or what is in the way
    parse_allowed_changes(",".join(allowed), config)
    guard_earlier_run(output_dir, log_dir, run.checkpoints, resume, overwrite, ctx)
    run.resume_from = run.last_checkpoint = resolve_resume(resume, run.checkpoints, output_dir=output_dir,
                                                            log_dir=log_dir)
    if run.resume_from is not None:
        check_resume_config(run.resume_from, config, allowed)
        saved = read_trainer_state(run.resume_from)
        if (output_dir / "final").is_dir() and max(saved.step, _finished_steps(log_dir)) >= t.max_steps:
            logger.warning("hasten: %s holds a run finished at step %d and training.max_steps is %d: nothing was "
                           "trained or changed; raise --max_steps to train further", output_dir,
                           max(saved.step, _finished_steps(log_dir)), t.max_steps)
            return TrainResult(saved.step, saved.losses[-1] if saved.losses else float("nan"), [], saved.tokens,
                               log_dir / "metrics.jsonl", output_dir / "final", None, run.resume_from,
                               run.resume_from)
    if ctx.is_main:
        for stale in remove_stale_temporaries(run.checkpoints):
            logger.warning("hasten: removed %s, the temporary folder of a checkpoint save that never finished "
                           "(a killed process or a full disk)", stale)

    # model
    reset_fallbacks()
    torch.manual_seed(t.seed)
    run.dtype = dtype = resolve_dtype(t.dtype, device)
    model, run.tokenizer = load_model_and_tokenizer(config, dtype, device)
    if not getattr(model, "is_loaded_in_4bit", False):  # a 4-bit model was loaded onto the device
        model.to(device)
    model.train()
    run.handle = hasten.accelerate(model, config)
    if ctx.is_main:
        for line in run.handle.report().splitlines():
            logger.info(line)
    if t.packed_sequence and run.handle.packing_refusal is not None:
        raise ConfigError(f"training.packed_sequence is true, but this model cannot train on packed batches: "
                          f"{run.handle.packing_refusal}. Set training.packed_sequence: false (padded batches, "
                          "correct for it)")
    if config.lora.enabled:
        model = _with_lora(model, config, ctx)
        patch_lora_layers(model, config, run.handle)  # the adapters are PEFT's; their forward hasten's
        if ctx.is_main:
            logger.info("hasten: LoRA layers: %s", "; ".join(item for item in run.handle.active + run.handle.inactive
                                                           if "LoRA" in item))
    run.hf_model = model
    run.model = wrap_model(model, ctx, device, reshard_after_forward=t.fsdp2_reshard_after_forward,
                           layers_per_unit=t.fsdp2_layers_per_unit)
    if ctx.enabled and ctx.is_main:
        logger.info("hasten: %s over %d processes", ctx.strategy, ctx.world_size)
    if t.compile:  # after hasten's patches and the wrappers: the layers are traced as they will run
        run.compiled = compile_decoder_layers(run.model)
        if ctx.is_main:
            logger.info("hasten: training.compile: %d decoder layers compile with torch.compile (each layer one "
                        "graph, dynamic shapes, shared by the layers); the first steps include the compile time",
                        len(run.compiled.layers))

    _set_up_data(run)
    run.trainable = [p for p in run.model.parameters() if p.requires_grad]
    _memory_preflight(run)  # before the optimizer makes its state: its bytes are part of the forecast

    # optimizer, and the state to continue from
    # fused AdamW on CUDA; training.cuda_graphs optimizer captures its step in a CUDA graph (a
    # GraphedAdamW: gradients zeroed in place, the LR read from a device tensor), or says once why not
    run.optimizer = build_adamw(run.trainable, lr=t.learning_rate, weight_decay=t.weight_decay, device=device,
                                cuda_graphs=t.cuda_graphs, distributed=ctx.strategy)
    if t.cuda_graphs == "step":
        _set_up_step_graphs(run)
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer,
                                                      lambda s: _lr_factor(s, t.warmup_steps, t.max_steps))
    run.state = TrainerState(step=0, epoch=0, batches_in_epoch=0)
    if run.resume_from is not None:
        try:
            run.state = load_checkpoint(run.resume_from, run.model, run.optimizer, run.scheduler, ctx)
        except CheckpointError as exc:
            raise ConfigError(f"--resume: {exc}. Resume it with the config it was written with "
                              f"({run.resume_from / 'config.json'}), or start a new run with --overwrite or in a new "
                              "--output_dir") from exc
        logger.info("hasten: resumed from %s at step %d", run.resume_from, run.state.step)

    # sinks: rank 0 reports for the whole job; the other ranks write nothing
    if ctx.is_main:
        rows = metrics_rows(log_dir / "metrics.jsonl")
        if rows:
            logger.info("hasten: appending to %s, which holds %d rows of the run being continued (a step trained "
                        "again gets a later row, which wins)", log_dir / "metrics.jsonl", rows)
        run.metrics = MetricsLog(log_dir)
    run.tensorboard = TensorBoardSink(log_dir, config.logging.tensorboard if ctx.is_main else "false")
    run.gpu_monitor = GpuMonitor(device) if config.logging.gpu_monitor and ctx.is_main else None
    if ctx.is_main:
        (log_dir / "config.json").write_text(json.dumps(redact(config.to_dict()), indent=2))
        (log_dir / "versions.json").write_text(json.dumps(redact(version_record()), indent=2))
    return None


def _set_up_step_graphs(run: _Run) -> None:
    """training.cuda_graphs step: a StepGraphs for the loop, or the reason it cannot run, said once."""
    t, handle = run.config.training, run.handle
    reason = step_graph_refusal(
        device=run.device, distributed=run.ctx.enabled, model=run.hf_model,
        optimizer_captured=isinstance(run.optimizer, GraphedAdamW) and run.optimizer.disabled_reason is None)
    if reason is not None:
        record_fallback(STEP_GRAPH_FALLBACK, f"training.cuda_graphs step: {reason}; micro-batches run eagerly "
                                             "(same results; the optimizer step as with cuda_graphs: optimizer)")
        handle.inactive.append(f"CUDA graphs per micro-batch (training.cuda_graphs step: {reason})")
        return
    run.step_graphs = StepGraphs(run.model, run.trainable, max_tokens=t.max_tokens,
                                 pad_token_id=run.collator.pad_token_id,
                                 accumulation=t.gradient_accumulation_steps, device=run.device)


def _memory_preflight(run: _Run) -> None:
    """training.memory_preflight (hasten.memory.preflight): probe steps measure this run's memory
    per token; a max_tokens past the GPU's (or, offloading, the host's) free memory stops the run
    before its first step, with the largest batch that fits. The probes leave no trace: gradients
    dropped, the random generators restored, offload calibration and MoE counts started afresh."""
    t, ctx, device = run.config.training, run.ctx, run.device
    if not t.memory_preflight or device.type != "cuda":
        return
    if ctx.enabled:
        logger.info("hasten: training.memory_preflight runs in one process only; skipped under torchrun")
        return
    from hasten.memory import preflight

    config = run.hf_model.config
    vocab = (config.get_text_config() if hasattr(config, "get_text_config") else config).vocab_size
    gen = torch.Generator().manual_seed(0)

    def probe_step(tokens: int) -> None:
        ids = torch.randint(0, vocab, (tokens,), generator=gen).tolist()
        batch = move_batch(PackingCollator(max_tokens=tokens)([{"input_ids": ids}]), device)
        try:
            run.model(**batch).loss.backward()
        finally:
            run.model.zero_grad(set_to_none=True)

    offload = run.handle.offload
    offloaded = (lambda: offload.offload.engine.stats().bytes_offloaded) if offload is not None else None
    rng = torch.get_rng_state(), torch.cuda.get_rng_state_all()
    sizes = preflight.probe_sizes(t.max_tokens)
    try:
        probes, failed_at = preflight.measure(probe_step, sizes, preflight.CudaMemory(device), offloaded)
    finally:
        torch.set_rng_state(rng[0])
        torch.cuda.set_rng_state_all(rng[1])
        if offload is not None:
            offload.restart_calibration()
        if run.handle.moe_stats is not None:
            run.handle.moe_stats.summary(reset=True)
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(device)
    if not probes:
        raise ConfigError(f"training.max_tokens={t.max_tokens:,}: even a probe step of {min(sizes):,} tokens ran out "
                          f"of memory on {name} (measured before the first step); lower training.max_tokens, or "
                          "lower the memory per token (training.checkpoint.activations: full, offload: all, "
                          "mlp_tile_tokens)")
    forecast = preflight.forecast(probes, preflight.optimizer_state_bytes(run.trainable), device,
                                  with_offload=offloaded is not None,
                                  host_layers=offload.host_layers if offload is not None else 0,
                                  host_limit=offload.host_limit_bytes if offload is not None else None)
    refusal = forecast.refusal(t.max_tokens, name)
    if refusal is None and failed_at is not None:
        refusal = (f"training.max_tokens={t.max_tokens:,} ran out of memory in a probe step of {failed_at:,} tokens "
                   f"on {name} (measured before the first step); the line through the smaller probes puts the "
                   f"largest batch at about {min(forecast.largest_tokens(), failed_at - 1):,} tokens: lower "
                   "training.max_tokens to it, or set training.memory_preflight: false to try anyway")
    if refusal is not None:
        raise ConfigError(refusal)
    kept = forecast.host_layers_kept(t.max_tokens)
    if kept:
        logger.warning("hasten: memory preflight: the host cannot hold all %d offloaded layers' checkpointed inputs of "
                       "a %s-token batch; the last %d stay on %s (%.1f GiB there)", offload.host_layers,
                       f"{t.max_tokens:,}", kept, name, forecast.device_bytes(t.max_tokens, kept) / 2**30)
        offload.keep_on_device(kept)
    run.preflight = (forecast, kept or 0, torch.cuda.memory_allocated(device))
    logger.info("hasten: memory preflight (%s): a %s-token batch needs about %.1f GiB beyond the weights of %.1f "
                "GiB free%s; the largest that fits is about %s tokens", ", ".join(f"{p.tokens:,}" for p in probes),
                f"{t.max_tokens:,}", forecast.device_bytes(t.max_tokens, kept) / 2**30, forecast.device_limit / 2**30,
                "" if forecast.host_limit is None else
                f", and {forecast.host_bytes(t.max_tokens, kept) / 2**30:.1f} GiB of host memory of "
                f"{forecast.host_limit / 2**30:.1f}", f"{forecast.largest_tokens():,}")


def _check_preflight(run: _Run, tokens: int) -> dict:
    """The preflight's forecast against the first step's peak (hasten.memory.preflight.first_step_check);
    a warning where the step went past it. Read from the allocator's counters: no device sync."""
    from hasten.memory import preflight

    forecast, kept, allocated = run.preflight
    run.preflight = None
    check = preflight.first_step_check(forecast, kept, allocated, tokens, torch.cuda.max_memory_allocated(run.device))
    if (message := preflight.first_step_warning(check, forecast.largest_tokens(),
                                                torch.cuda.get_device_name(run.device))) is not None:
        logger.warning(message)
    return check


def _finished_steps(log_dir: Path) -> int:
    """Steps of the run whose summary is in log_dir, if it ended without a signal; else 0."""
    try:
        summary = json.loads((log_dir / "summary.json").read_text())
        return int(summary["steps"]) if summary.get("interrupted_by") is None else 0
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0


# Batches inspected at start: when none of them has a token to learn from, the data (or
# training.max_tokens) is wrong and the run is refused before it starts.
UNTRAINABLE_PROBE_BATCHES = 8


def _set_up_data(run: _Run) -> None:
    config, t, ctx = run.config, run.config.training, run.ctx
    tokenizer = run.tokenizer
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
    _refuse_untrainable_start(samples, sampler, config, pad_id)
    if ctx.world_size > 1 and ctx.is_main:
        # every collective waits for the slowest rank: say how even the work is (sampler balances it)
        logger.info("hasten: rank balance over an epoch: the busiest rank's compute is %.2fx the mean "
                    "(1.00 is even; long outlier samples raise it)", sampler.rank_imbalance())
    run.collator = collator = PackingCollator(t.max_tokens, overlong=t.overlong, pad_token_id=pad_id)
    collate = collator if t.packed_sequence else _pad_collate(collator, pad_id)
    run.sampler = sampler
    run.loader = DataLoader(samples, batch_sampler=sampler, collate_fn=collate, pin_memory=run.device.type == "cuda")


def _first_target(labels) -> int | None:
    """Position of a sample's first trainable label (never 0: a sample's first token is no target)."""
    for position, label in enumerate(labels[1:], start=1):
        if label != IGNORE_INDEX:
            return position
    return None


def _refuse_untrainable_start(samples: list[dict], sampler: TokenBudgetBatchSampler, config: Config,
                              pad_id: int) -> None:
    """DataError when none of the first batches (of every rank, so all ranks decide alike) has a
    token with loss: e.g. training.max_tokens so small that each sample's completion is cut off."""
    t = config.training
    probe = PackingCollator(t.max_tokens, overlong=t.overlong, pad_token_id=pad_id)  # its own stats
    sampler.set_epoch(0)
    looked, ids = 0, []
    for batch in sampler.all_batches():
        prepared = probe.prepare_samples([samples[i] for i in batch])
        if not prepared:
            continue  # the loop skips batches whose samples were all dropped
        if any(bool((labels[1:] != IGNORE_INDEX).any()) for _, labels in prepared):
            return
        looked += 1
        ids += batch
        if looked == UNTRAINABLE_PROBE_BATCHES:
            break
    if not looked:
        return
    source = config.data.path or "the embedded corpus"
    firsts = [_first_target(samples[i].get("labels") or samples[i]["input_ids"]) for i in ids]
    cut = [f for f in firsts if f is not None]
    head = (f"{source}: the first {looked} batches have no trainable tokens ({looked} of {looked} with every label "
            f"-100 after each sample is cut to training.max_tokens={t.max_tokens}); the loss would be empty and "
            "nothing would train. ")
    if cut:
        longest = max(len(samples[i]["input_ids"]) for i in ids)
        raise DataError(head + f"In {len(cut)} of their {len(ids)} samples the loss starts at token {min(cut)} or "
                        f"later, past max_tokens (the prompt alone fills it). Fix: raise training.max_tokens to at least "
                        f"{min(cut) + 1} (the longest of these samples has {longest} tokens), or shorten the prompts")
    raise DataError(head + f"Their {len(ids)} samples have no completion or assistant tokens at all. Fix: check that "
                    "the records have a non-empty completion / assistant turn")


def _train_loop(run: _Run, progress: bool) -> str | None:
    """Steps until training.max_steps or a signal; returns the signal's name when one stopped it."""
    config, t, ctx, device = run.config, run.config.training, run.ctx, run.device
    model, optimizer, scheduler, state = run.model, run.optimizer, run.scheduler, run.state
    collator, handle, log_dir = run.collator, run.handle, run.log_dir
    # the next batch's copy to the GPU runs on a side stream while the current step computes
    # under training.cuda_graphs step the host batch is padded to its bucket before the copy
    graphs = run.step_graphs
    host_batch_of = (lambda item: item[2]) if graphs is None else (lambda item: graphs.pad(item[2]))
    batches = NextBatchPrefetcher(_batches_from(run.loader, run.sampler, state.epoch, state.batches_in_epoch), device,
                                  batch_of=host_batch_of)
    window_tokens, window_loss, window_micro = 0, torch.zeros((), device=device), 0
    window_masked = 0  # micro-batches without a trainable token: no loss, left out of the mean
    window_first = state.step + 1  # the window's first step, for messages
    window_checkpoint_s = 0.0  # checkpoint writing inside the window: reported apart from the step rate
    window_syncs = 0  # host syncs of the window's first step
    sync_sites_reported = masked_reported = False
    preflight_check = None  # the memory preflight's forecast against the first step, for its metrics row
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
    try:
        with _StopRequest() as stop:
            while state.step < t.max_steps and not stopping:
                # The first step of each logging window counts its host syncs (torch's sync debug mode;
                # cheap when there are none, which is the point). 0 without CUDA.
                syncs_probe = (count_host_syncs(record_sites=not sync_sites_reported) if window_micro == 0
                               else contextlib.nullcontext())
                profiler = (profiled_step(log_dir, state.step + 1, ctx.rank, device)
                            if config.logging.profile_step == state.step + 1 else contextlib.nullcontext())
                with profiler, syncs_probe as probed:
                    step_tokens = 0  # the step's largest micro-batch, for the preflight's check
                    for micro in range(t.gradient_accumulation_steps):
                        (state.epoch, state.batches_in_epoch, host_batch), batch = next(batches)
                        # non-padding tokens and whether any has loss, on the host copy (no device read-back)
                        window_tokens += int(host_batch["input_ids"].numel() if t.packed_sequence
                                             else host_batch["attention_mask"].sum())
                        step_tokens = max(step_tokens, int(host_batch["input_ids"].numel()))
                        has_targets = _has_trainable_tokens(host_batch["labels"])
                        with gradient_sync(model, ctx, last_micro_batch=micro == t.gradient_accumulation_steps - 1):
                            if graphs is not None:  # forward and backward replayed (or run) as one
                                loss = graphs.forward_backward(batch)
                                host_lead.mark(step_start=micro == 0)
                            else:
                                loss = model(**batch).loss / t.gradient_accumulation_steps
                                host_lead.mark(step_start=micro == 0)
                                loss.backward()  # all labels -100: a NaN loss (0/0) but zero gradients
                            host_lead.mark()
                        if has_targets:
                            window_loss += loss.detach()
                        else:
                            window_masked += 1
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
                if run.preflight is not None:  # once: the forecast against the first step that ran
                    preflight_check = _check_preflight(run, step_tokens)
                # Alone, a signal stops after this step; under torchrun the ranks agree at the next logging step.
                stopping = stop.signal_name is not None and not ctx.enabled
                if state.step % t.logging_steps == 0 or state.step == t.max_steps or stopping:
                    # one read-back (and, under torchrun, one small all-reduce) per logging step
                    signalled = float(stop.signal_name is not None)
                    window_loss_sum = float(window_loss)  # waits for the GPU: the window's events are done
                    tokens_all, loss_all, micro_all, stop_all, masked_all, *leads = all_reduce_sum(
                        [window_tokens, window_loss_sum, window_micro, signalled, window_masked,
                         *host_lead.rank_slots(ctx.rank, ctx.world_size)], ctx, device)
                    if not math.isfinite(loss_all):  # every rank sees the reduced value: all stop here
                        raise DivergenceError(_diverged(run, f"the loss is {loss_all}", window_first, state.step))
                    stopping = stopping or stop_all > 0
                    counted = micro_all - masked_all
                    mean_loss = loss_all * t.gradient_accumulation_steps / counted if counted else None
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
                           "masked_batches": int(masked_all),
                           "fallbacks": fallback_counts()}
                    if preflight_check is not None:
                        row["preflight"], preflight_check = preflight_check, None
                    if handle.moe_stats is not None:
                        row["moe"] = handle.moe_stats.summary()
                    if handle.offload is not None:
                        row["offload"] = handle.offload.summary()
                    if run.gpu_monitor is not None and (gpu := run.gpu_monitor.read()) is not None:
                        row["gpu"] = gpu
                    run.masked_batches += int(masked_all)
                    if ctx.is_main:
                        if masked_all and not masked_reported:
                            masked_reported = True
                            logger.warning(
                                "hasten: %d batch(es) in steps %d-%d had no trainable token (every label -100: "
                                "training.max_tokens cutting off the completion or assistant part, or records with "
                                "none); they add nothing to the loss and are counted as masked_batches in "
                                "metrics.jsonl and summary.json (said once)", int(masked_all), window_first,
                                state.step)
                        host_lead.report(row["host_lead_ms"])
                        run.metrics.write(row)
                        run.tensorboard.write(row)
                        bar.set_postfix(loss="-" if mean_loss is None else f"{mean_loss:.3f}",
                                        tok_s=f"{row['tokens_per_s']:,.0f}")
                        tqdm.write(format_row(row))
                    if mean_loss is not None:
                        run.losses.append(mean_loss)
                        state.losses.append(mean_loss)
                    state.tokens += int(tokens_all)
                    window_tokens, window_loss, window_micro = 0, torch.zeros((), device=device), 0
                    window_masked, window_first = 0, state.step + 1
                    window_checkpoint_s = 0.0
                    host_lead.start_window()
                    window_start = time.perf_counter()
                if not ctx.enabled:  # a signal that came during this step's logging still stops here
                    stopping = stopping or stop.signal_name is not None
                if state.step % t.checkpoint.interval_steps == 0 or stopping:
                    saving_since = time.perf_counter()
                    _refuse_non_finite(run, window_loss, window_first, state.step)
                    run.last_checkpoint = save_checkpoint(run.checkpoints, state, model, optimizer, scheduler,
                                                          keep_last=t.checkpoint.keep_last, ctx=ctx,
                                                          config=config_record(config))
                    window_checkpoint_s += time.perf_counter() - saving_since
                    if ctx.is_main:
                        tqdm.write(f"checkpoint: {run.last_checkpoint}")
    finally:
        bar.close()
    return stop.signal_name if stopping else None


def _refuse_non_finite(run: _Run, window_loss: torch.Tensor | None, first: int, step: int) -> None:
    """Before a checkpoint or the final model: DivergenceError when the loss of the window not yet
    logged, or any trainable weight, is NaN or inf on any rank. One read-back per checkpoint (which
    waits for the GPU anyway); the per-step loop reads nothing more."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in run.trainable]  # FSDP2: this rank's shard
    no = torch.zeros((), dtype=torch.bool, device=run.device)
    weights_bad = torch.stack([torch.isfinite(p).all().logical_not() for p in local]).any() if local else no
    loss_bad = torch.isfinite(window_loss).logical_not() if window_loss is not None else no
    weights_bad, loss_bad = all_reduce_sum(torch.stack([weights_bad, loss_bad]).float().tolist(), run.ctx, run.device)
    if loss_bad:
        raise DivergenceError(_diverged(run, "the loss is not finite (NaN or inf)", first, step))
    if weights_bad:
        raise DivergenceError(_diverged(run, "the weights hold NaN or inf values", step, step))


def _diverged(run: _Run, problem: str, first: int, last: int) -> str:
    t = run.config.training
    where = f"at step {last}" if first >= last else f"in steps {first}-{last}"
    if run.last_checkpoint is not None:
        good = f"the last good checkpoint is {run.last_checkpoint}"
        fix = ("Fix the cause, then continue from that checkpoint with --resume auto (with "
               "--allow_config_change training.learning_rate if you lowered it), or start over with --overwrite")
    else:
        good = "no checkpoint was written before it"
        fix = "Fix the cause and start over with --overwrite (or in a new --output_dir)"
    overflow = (f"float16/bfloat16 overflow (this run computes in {str(run.dtype).removeprefix('torch.')}: try "
                "training.dtype float32), " if run.dtype in (torch.float16, torch.bfloat16) else "")
    return (f"training diverged {where}: {problem}. The run stopped before writing a checkpoint or final model with "
            f"it; {good}. Likely causes: a learning rate too high (training.learning_rate {t.learning_rate:g}; a "
            f"longer training.warmup_steps also helps), {overflow}a batch with every label -100 (hasten counts "
            "those as masked_batches and leaves them out of the loss), or bad data (token ids out of the "
            f"vocabulary, corrupt records). {fix}")


def _save_final(run: _Run) -> Path:
    """The final model (and tokenizer) in OUTPUT_DIR/final, built in a temporary folder and renamed
    into place, so a failed write leaves no half model where a finished one is expected."""
    final = run.output_dir / "final"
    tmp = run.output_dir / f".tmp-final-{os.getpid()}"
    main = run.ctx.is_main
    try:
        if main and tmp.exists():
            shutil.rmtree(tmp)
        save_final_model(run.model, run.hf_model, tmp, run.ctx)
        if main:
            if hasattr(run.tokenizer, "save_pretrained"):
                run.tokenizer.save_pretrained(tmp)
            if final.exists():  # a resumed run trained further: its model replaces the earlier one
                old = run.output_dir / f".tmp-final-old-{os.getpid()}"
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old)
                logger.info("hasten: %s now holds this run's model (step %d)", final, run.state.step)
            else:
                os.replace(tmp, final)
    except OSError as exc:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        kept = f"the last checkpoint {run.last_checkpoint} is intact" if run.last_checkpoint else "no checkpoint exists"
        where = f" ({exc.filename})" if exc.filename else ""
        raise CheckpointWriteError(f"cannot write the final model to {final}: {exc.strerror or exc}{where}; the "
                                   f"partial folder was removed and {kept}. Free disk space or choose another "
                                   "--output_dir, then finish with --resume auto") from exc
    return final


def _finish(run: _Run, interrupted_by: str | None) -> TrainResult:
    """The end of a run that was not stopped by an error: final model, summary."""
    ctx, state, t = run.ctx, run.state, run.config.training
    model_dir = None
    if interrupted_by is None:
        _refuse_non_finite(run, None, state.step, state.step)
        model_dir = _save_final(run)
    final_loss = state.losses[-1] if state.losses else float("nan")
    summary = {"steps": state.step, "final_loss": final_loss, "tokens": state.tokens, "device": str(run.device),
               "dtype": str(run.dtype), "packing": run.collator.stats.as_dict() if t.packed_sequence else None,
               "masked_batches": run.masked_batches,
               "hasten_active": run.handle.active, "hasten_inactive": run.handle.inactive,
               "fallbacks": fallback_counts(), "fallback_reasons": fallback_reasons(),
               "optimizer_graph": optimizer_graph_summary(run.optimizer),
               "step_graphs": None if run.step_graphs is None else run.step_graphs.summary(),
               "interrupted_by": interrupted_by, "world_size": ctx.world_size,
               "distributed": ctx.strategy,
               "compile": (None if run.compiled is None else
                           {"layers": len(run.compiled.layers), "failure": run.compiled.failure}),
               "resumed_from": str(run.resume_from) if run.resume_from else None,
               "last_checkpoint": str(run.last_checkpoint) if run.last_checkpoint else None}
    if ctx.is_main:
        (run.log_dir / "summary.json").write_text(json.dumps(redact(summary), indent=2))
    return TrainResult(state.step, final_loss, run.losses, state.tokens, run.log_dir / "metrics.jsonl", model_dir,
                       interrupted_by, run.resume_from, run.last_checkpoint)


def _tear_down(run: _Run) -> None:
    """After every run, also one that raised: sinks closed, hasten's patches undone, the process
    group left. Each step runs even when an earlier one fails. After a failure the ranks do not
    wait for each other at the end (a rank that failed alone would wait there for ever)."""
    with contextlib.ExitStack() as stack:  # callbacks run last-registered first
        if run.ctx is not None:
            stack.callback(shutdown, run.ctx, wait_for_ranks=not run.failed)
        if run.handle is not None:
            stack.callback(run.handle.undo)
        if run.compiled is not None:  # before hasten's undo (callbacks run last-registered first)
            stack.callback(run.compiled.undo)
        if run.tensorboard is not None:
            stack.callback(run.tensorboard.close)
        if run.metrics is not None:
            stack.callback(run.metrics.close)

"""Training checkpoints that are written atomically and verified before they are loaded.

Layout: OUTPUT_DIR/checkpoints/checkpoint-000120/
    model/              save_pretrained (safetensors; loadable by transformers)
    optimizer.pt        optimizer state (tensors and numbers only: loaded with weights_only=True)
    scheduler.pt        LR scheduler state
    rng.pt              torch CPU/CUDA, Python and NumPy RNG states
    trainer_state.json  step, epoch, batches consumed in the epoch, tokens, losses so far
    config.json         the run's config (compared with the config of a run that resumes it;
                        checkpoints written before it existed load without the comparison)
    manifest.json       size and sha256 of every file above, written last

A checkpoint is built in a temporary folder (.tmp-checkpoint-<step>-<pid>), every file fsynced,
the manifest written, then the folder renamed into place (atomic on POSIX) and the parent
fsynced. Loading checks the manifest first, so a partial or corrupt checkpoint is skipped with a
message, never loaded. A write that fails (a full disk) removes its temporary folder and raises
CheckpointWriteError; the checkpoints already in place are untouched. Rotation (`keep_last`)
deletes only checkpoints older than the one just written, once that one is in place and its
files have the sizes its manifest lists, so the newest good checkpoint always survives.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from hasten.observability import logger

PREFIX = "checkpoint-"
TMP_PREFIX = f".tmp-{PREFIX}"
MANIFEST = "manifest.json"
CONFIG = "config.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the folder and the problem."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint (or the final model) could not be written: the message names the folder, the
    OS error and the space it needs; the partial folder is removed, earlier checkpoints are intact."""


@dataclass
class TrainerState:
    step: int                      # optimizer steps completed
    epoch: int                     # data epoch in progress
    batches_in_epoch: int          # batches of that epoch already consumed
    tokens: int = 0
    losses: list[float] = field(default_factory=list)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    # Python and NumPy states hold tuples of ints and a numpy array; store them as plain data
    # so that weights_only loading accepts them.
    state["python"] = [state["python"][0], list(state["python"][1]), state["python"][2]]
    np_state = state["numpy"]
    state["numpy"] = [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]]
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def _gather_rng_states(ctx) -> list[dict[str, Any]]:
    if ctx is None or not ctx.enabled:
        return [_rng_state()]
    import torch.distributed as dist

    states: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(states, _rng_state())
    return states


def save_checkpoint(root: Path, state: TrainerState, model, optimizer, scheduler, *, keep_last: int,
                    ctx=None, config: dict[str, Any] | None = None) -> Path:
    """Write checkpoint-<step> under `root` atomically; keep the newest `keep_last`.

    `config` (the run's config as a dict) is stored beside the state, for the resume check.
    Under torchrun (`ctx` enabled) every rank must call this: the full model and optimizer
    states are gathered to rank 0 (DDP and FSDP2 alike), which writes; all ranks return
    after the checkpoint is in place, or all raise CheckpointWriteError when rank 0 could not
    write it."""
    final = root / f"{PREFIX}{state.step:06d}"
    distributed = ctx is not None and ctx.enabled
    model_state = optimizer_state = None
    if distributed:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = _full_model_state(model)
        optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
    rng_states = _gather_rng_states(ctx)
    failure: str | None = None
    if ctx is None or ctx.is_main:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f"{TMP_PREFIX}{state.step:06d}-{os.getpid()}"
        try:
            _write_checkpoint(tmp, final, state, model, optimizer, scheduler, rng_states, model_state,
                              optimizer_state, ctx, config)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            failure = _write_failure_message(final, exc, _estimate_bytes(root, model, optimizer, optimizer_state),
                                             root)
        if failure is None:
            _rotate(root, final, keep_last)
    if distributed:  # every rank learns whether rank 0's write worked (in place of a barrier)
        import torch.distributed as dist

        shared = [failure]
        dist.broadcast_object_list(shared, src=0)
        failure = shared[0]
    if failure is not None:
        raise CheckpointWriteError(failure)
    return final


def _write_checkpoint(tmp: Path, final: Path, state: TrainerState, model, optimizer, scheduler, rng_states,
                      model_state, optimizer_state, ctx, config) -> None:
    distributed = ctx is not None and ctx.enabled
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    hf_model = getattr(model, "module", model)
    if distributed and _is_peft(hf_model):  # the adapters, gathered (sharded under FSDP2)
        hf_model.save_pretrained(tmp / "model", state_dict=model_state, safe_serialization=True)
    elif distributed:
        weights = {k: v for k, v in model_state.items() if k not in ctx.tied_names}
        hf_model.save_pretrained(tmp / "model", state_dict=weights, safe_serialization=True)
    else:
        hf_model.save_pretrained(tmp / "model", safe_serialization=True)
    torch.save(optimizer_state if distributed else optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save({"per_rank": rng_states}, tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(asdict(state)))
    if config is not None:
        (tmp / CONFIG).write_text(json.dumps(config, indent=1))
    files = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(tmp.rglob("*")) if p.is_file()}
    (tmp / MANIFEST).write_text(json.dumps({"step": state.step, "files": files}, indent=1))
    _fsync_tree(tmp)
    if final.exists():  # a previous run wrote this step: replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def _rotate(root: Path, newest: Path, keep_last: int) -> None:
    """Delete checkpoints older than `newest` beyond the `keep_last` newest, never `newest` itself
    and never a checkpoint of a later step (one left by an earlier run, broken or not: it is not
    this rotation's to judge). Nothing is deleted unless `newest` is whole by its manifest's sizes
    (a cheap check; the checksums were computed from the same files a moment ago)."""
    try:
        verify(newest, checksums=False)
    except CheckpointError as exc:
        logger.warning("hasten: not rotating checkpoints: the one just written does not check out (%s)", exc)
        return
    step = _step_of(newest)
    older = sorted((p for p in _candidates(root) if _step_of(p) < step), key=_step_of)
    for old in older[:max(0, len(older) - (keep_last - 1))]:
        shutil.rmtree(old, ignore_errors=True)


def _step_of(folder: Path) -> int:
    return int(folder.name[len(PREFIX):])


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _estimate_bytes(root: Path, model, optimizer, optimizer_state=None) -> int:
    """About what one checkpoint takes: the newest complete one's files, else the weights that
    save_pretrained writes plus the optimizer state."""
    for folder in sorted(_candidates(root), key=_step_of, reverse=True):
        try:
            files = json.loads((folder / MANIFEST).read_text())["files"]
            return sum(int(meta["bytes"]) for meta in files.values())
        except (OSError, ValueError, KeyError, TypeError):
            continue
    hf_model = getattr(model, "module", model)
    params = [p for p in hf_model.parameters() if p.requires_grad] if _is_peft(hf_model) else list(
        {id(p): p for p in hf_model.parameters()}.values())
    weights = sum(p.numel() * p.element_size() for p in params)
    return weights + _tensor_bytes(optimizer_state if optimizer_state is not None else optimizer.state_dict())


def _human(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


def _write_failure_message(final: Path, exc: OSError, need: int, root: Path) -> str:
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    where = f" ({exc.filename})" if exc.filename else ""
    earlier = sorted((p for p in _candidates(root) if p != final), key=_step_of)
    kept = f"the earlier checkpoint {earlier[-1].name} is intact" if earlier else "no earlier checkpoint exists"
    space = f"; {_human(free)} free there" if free is not None else ""
    fix = ("free disk space (a lower training.checkpoint.keep_last keeps fewer checkpoints) or train into an "
           "--output_dir on a larger disk" if exc.errno in (errno.ENOSPC, errno.EDQUOT)
           else "make the folder writable or choose another --output_dir")
    return (f"cannot write checkpoint {final}: {reason}{where}. A checkpoint needs about {_human(need)} "
            f"({need} bytes){space}. The partial folder was removed and {kept}. Fix: {fix}, then continue "
            "with --resume auto")


def remove_stale_temporaries(root: Path) -> list[Path]:
    """Remove the temporary folders of checkpoint saves that never finished (a killed process, a
    full disk), which hold partial copies and can fill the disk again on every restart. Call it
    before this run writes its first checkpoint (from the one writing process)."""
    removed = []
    if root.is_dir():
        for folder in sorted(root.glob(f"{TMP_PREFIX}*")):
            if folder.is_dir():
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
    return removed


def saved_config(folder: Path) -> dict[str, Any] | None:
    """The config the checkpoint was written with; None for checkpoints from before it was saved."""
    path = folder / CONFIG
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder}: unreadable {CONFIG} ({exc})") from exc


def read_trainer_state(folder: Path) -> TrainerState:
    try:
        return TrainerState(**json.loads((folder / "trainer_state.json").read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{folder}: unreadable trainer_state.json ({exc})") from exc


def _candidates(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]


def verify(folder: Path, *, checksums: bool = True) -> None:
    """Raise CheckpointError unless every file the manifest lists is there, whole and unchanged
    (`checksums` False: only the sizes are compared)."""
    if not folder.exists():
        raise CheckpointError(f"{folder} does not exist")
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is a file, not a checkpoint folder")
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{folder}: no {MANIFEST} (the checkpoint was not finished)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = {str(name): int(meta["bytes"]) for name, meta in manifest["files"].items()}
        sums = {str(name): meta["sha256"] for name, meta in manifest["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{folder}: unreadable {MANIFEST} ({exc})") from exc
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{folder}: {name} is missing")
        if path.stat().st_size != size:
            raise CheckpointError(f"{folder}: {name} has {path.stat().st_size} bytes, the manifest says {size} "
                                  "(truncated or overwritten)")
        if checksums and _sha256(path) != sums[name]:
            raise CheckpointError(f"{folder}: {name} does not match its checksum (corrupt)")


def latest_valid(root: Path) -> Path | None:
    """The newest checkpoint under `root` that verifies; broken ones are skipped with a warning."""
    for folder in sorted(_candidates(root), key=_step_of, reverse=True):
        try:
            verify(folder)
        except CheckpointError as exc:
            logger.warning("hasten: skipping checkpoint: %s", exc)
            continue
        return folder
    return None


def _read_model_weights(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
        "model.safetensors"]
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(safetensors.torch.load_file(folder / shard, device="cpu"))
    return weights


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config")


def _full_model_state(model) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) state on rank 0's CPU, {} on the other ranks; every rank must
    call it. A LoRA model gives its trainable parameters only (the adapters; the frozen base, 4-bit
    or not, is the model folder's and is not copied), named as the PEFT model's state_dict names
    them, which is what PEFT's save_pretrained(state_dict=...) takes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    peft = _is_peft(getattr(model, "module", model))
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                ignore_frozen_params=peft))


def _load_adapters_distributed(model, folder: Path) -> None:
    """Every rank reads the adapters file (small) and loads it through torch's distributed
    state-dict API, which shards each tensor where FSDP2 shards the parameter (and copies it
    whole into a DDP replica). The file names a parameter as PEFT saves it, without the adapter
    name (`...q_proj.lora_A.weight` for the model's `...q_proj.lora_A.default.weight`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    hf_model = getattr(model, "module", model)
    saved = safetensors.torch.load_file(_adapters_file(folder), device="cpu")
    adapter = hf_model.active_adapter
    trainable = [name.removeprefix("module.") for name, p in model.named_parameters() if p.requires_grad]
    by_saved_name = {name.replace(f".{adapter}", ""): name for name in trainable}
    unexpected = sorted(set(saved) - set(by_saved_name))
    missing = sorted(set(by_saved_name) - set(saved))
    if unexpected or missing:
        raise CheckpointError(f"{folder}: the adapters do not fit this model's LoRA layers (in the file only: "
                              f"{unexpected[:3]}; in the model only: {missing[:3]}); it was written for another "
                              "LoRA setup (target_modules, r)")
    set_model_state_dict(model, {by_saved_name[k]: v for k, v in saved.items()},
                         options=StateDictOptions(full_state_dict=True, strict=False))


def _adapters_file(folder: Path) -> Path:
    """A LoRA checkpoint's adapters (PEFT's save_pretrained), or CheckpointError when the folder
    holds a run without LoRA."""
    adapters_file = folder / "adapter_model.safetensors"
    if not adapters_file.is_file():
        raise CheckpointError(f"{folder.parent}: holds full model weights, no LoRA adapters, and this run has "
                              "lora.enabled true: it was written by a run without LoRA")
    return adapters_file


def _load_model_weights(model, folder: Path) -> None:
    adapters_file = folder / "adapter_model.safetensors"
    if _is_peft(model):  # LoRA: the checkpoint holds the adapters (save_pretrained of the PEFT model)
        import peft

        adapters = safetensors.torch.load_file(_adapters_file(folder), device="cpu")
        result = peft.set_peft_model_state_dict(model, adapters)
        if getattr(result, "unexpected_keys", None):
            raise CheckpointError(f"{folder}: adapter weights this model does not have: {result.unexpected_keys[:5]}")
        return
    if adapters_file.is_file() and not any(folder.glob("model*.safetensors")):
        raise CheckpointError(f"{folder.parent}: holds LoRA adapters, not full model weights, and this run has "
                              "lora.enabled false: it was written by a run with LoRA")
    weights = _read_model_weights(folder)
    result = model.load_state_dict(weights, strict=False)
    if result.unexpected_keys:
        raise CheckpointError(f"{folder}: weights for parameters this model does not have: "
                              f"{sorted(result.unexpected_keys)[:5]}")
    # Tied weights are saved once: a parameter counts as loaded when any name sharing its storage was.
    by_storage: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        by_storage.setdefault(tensor.data_ptr(), []).append(name)
    missing = [names[0] for names in by_storage.values() if not set(weights).intersection(names)]
    if missing:
        raise CheckpointError(f"{folder}: no weights for {missing[:5]}; the checkpoint belongs to another model")


def _short(exc: BaseException, limit: int = 600) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + " ..."


def load_checkpoint(folder: Path, model, optimizer, scheduler, ctx=None) -> TrainerState:
    """Restore everything `save_checkpoint` wrote (after verifying it) and return the trainer state.
    Under torchrun every rank calls this; rank 0 reads the weights and broadcasts them. A checkpoint
    that does not fit this model or optimizer (another model's shapes, LoRA on in one and off in
    the other, another LoRA rank) raises CheckpointError naming it, never a bare load error."""
    verify(folder)
    try:
        return _load_checkpoint(folder, model, optimizer, scheduler, ctx)
    except CheckpointError:
        raise
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError, OSError) as exc:
        raise CheckpointError(f"{folder} does not fit this model and optimizer ({type(exc).__name__}: "
                              f"{_short(exc)}); it was written for another model or LoRA setup") from exc


def _load_checkpoint(folder: Path, model, optimizer, scheduler, ctx) -> TrainerState:
    if ctx is not None and ctx.enabled:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        hf_model = getattr(model, "module", model)
        if _is_peft(hf_model):
            _load_adapters_distributed(model, folder / "model")
        else:
            model_state = _read_model_weights(folder / "model") if ctx.is_main else {}
            set_model_state_dict(model, model_state, options=options)
        optimizer_state = torch.load(folder / "optimizer.pt", weights_only=True) if ctx.is_main else {}
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)
        rank = ctx.rank
    else:
        _load_model_weights(getattr(model, "module", model), folder / "model")
        device = next(model.parameters()).device
        optimizer.load_state_dict(torch.load(folder / "optimizer.pt", map_location=device, weights_only=True))
        rank = 0
    scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
    per_rank = torch.load(folder / "rng.pt", weights_only=True)["per_rank"]
    if rank >= len(per_rank):
        logger.warning("hasten: checkpoint %s was written by %d ranks; rank %d reuses rank %d's RNG state",
                       folder, len(per_rank), rank, rank % len(per_rank))
    _set_rng_state(per_rank[rank % len(per_rank)])
    return read_trainer_state(folder)


def save_final_model(model, hf_model, folder: Path, ctx=None) -> None:
    """The trained model as a transformers folder; under torchrun the full weights are gathered to
    rank 0 (every rank must call this)."""
    if ctx is None or not ctx.enabled:
        hf_model.save_pretrained(folder, safe_serialization=True)
        return
    weights = _full_model_state(model)
    if not ctx.is_main:
        return
    if _is_peft(hf_model):  # the adapters, gathered (sharded under FSDP2)
        hf_model.save_pretrained(folder, state_dict=weights, safe_serialization=True)
    else:
        hf_model.save_pretrained(folder, state_dict={k: v for k, v in weights.items() if k not in ctx.tied_names},
                                 safe_serialization=True)

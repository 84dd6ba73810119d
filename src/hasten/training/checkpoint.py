"""Training checkpoints that are written atomically and verified before they are loaded.

Layout: OUTPUT_DIR/checkpoints/checkpoint-000120/
    model/              save_pretrained (safetensors; loadable by transformers)
    optimizer.pt        optimizer state (tensors and numbers only: loaded with weights_only=True)
    scheduler.pt        LR scheduler state
    rng.pt              torch CPU/CUDA, Python and NumPy RNG states
    trainer_state.json  step, epoch, batches consumed in the epoch, tokens, losses so far
    manifest.json       size and sha256 of every file above, written last

A checkpoint is built in a temporary folder, every file fsynced, the manifest written, then
the folder renamed into place (atomic on POSIX) and the parent fsynced. Loading checks the
manifest first, so a partial or corrupt checkpoint is skipped with a message, never loaded.
"""

from __future__ import annotations

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
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the folder and the problem."""


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


def save_checkpoint(root: Path, state: TrainerState, model, optimizer, scheduler, *, keep_last: int) -> Path:
    """Write checkpoint-<step> under `root` atomically; keep the newest `keep_last`."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{state.step:06d}"
    tmp = root / f".tmp-{PREFIX}{state.step:06d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(tmp / "model", safe_serialization=True)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(_rng_state(), tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(asdict(state)))
    files = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(tmp.rglob("*")) if p.is_file()}
    (tmp / MANIFEST).write_text(json.dumps({"step": state.step, "files": files}, indent=1))
    _fsync_tree(tmp)
    if final.exists():  # a previous run wrote this step: replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in sorted(_candidates(root))[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _candidates(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]


def verify(folder: Path) -> None:
    """Raise CheckpointError unless every file the manifest lists is there, whole and unchanged."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{folder}: no {MANIFEST} (the checkpoint was not finished)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{folder}: unreadable {MANIFEST} ({exc})") from exc
    for name, meta in files.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{folder}: {name} is missing")
        if path.stat().st_size != meta["bytes"]:
            raise CheckpointError(f"{folder}: {name} has {path.stat().st_size} bytes, the manifest says {meta['bytes']} "
                                  "(truncated or overwritten)")
        if _sha256(path) != meta["sha256"]:
            raise CheckpointError(f"{folder}: {name} does not match its checksum (corrupt)")


def latest_valid(root: Path) -> Path | None:
    """The newest checkpoint under `root` that verifies; broken ones are skipped with a warning."""
    for folder in sorted(_candidates(root), reverse=True):
        try:
            verify(folder)
        except CheckpointError as exc:
            logger.warning("hasten: skipping checkpoint: %s", exc)
            continue
        return folder
    return None


def _load_model_weights(model, folder: Path) -> None:
    index = folder / "model.safetensors.index.json"
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
        "model.safetensors"]
    loaded: set[str] = set()
    for shard in shards:
        tensors = safetensors.torch.load_file(folder / shard, device="cpu")
        result = model.load_state_dict(tensors, strict=False)
        if result.unexpected_keys:
            raise CheckpointError(f"{folder}: weights for parameters this model does not have: "
                                  f"{sorted(result.unexpected_keys)[:5]}")
        loaded |= tensors.keys()
    # Tied weights are saved once: a parameter counts as loaded when any name sharing its storage was.
    by_storage: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        by_storage.setdefault(tensor.data_ptr(), []).append(name)
    missing = [names[0] for names in by_storage.values() if not loaded.intersection(names)]
    if missing:
        raise CheckpointError(f"{folder}: no weights for {missing[:5]}; the checkpoint belongs to another model")


def load_checkpoint(folder: Path, model, optimizer, scheduler) -> TrainerState:
    """Restore everything `save_checkpoint` wrote (after verifying it) and return the trainer state."""
    verify(folder)
    _load_model_weights(model, folder / "model")
    device = next(model.parameters()).device
    optimizer.load_state_dict(torch.load(folder / "optimizer.pt", map_location=device, weights_only=True))
    scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
    _set_rng_state(torch.load(folder / "rng.pt", weights_only=True))
    return TrainerState(**json.loads((folder / "trainer_state.json").read_text()))

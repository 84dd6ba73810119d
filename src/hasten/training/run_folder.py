"""What an output folder holds and what a run may do with it: refuse to train over another run's
results unless --resume continues it or --overwrite replaces it, find the checkpoint to resume,
and refuse a resume whose config differs from the checkpoint's (RESUME_MAY_CHANGE lists the keys
that may differ; --allow_config_change names others)."""

from __future__ import annotations

import difflib
import json
import shutil
from pathlib import Path
from typing import Any

from hasten.config import Config, ConfigError
from hasten.observability import logger
from hasten.training.checkpoint import PREFIX, CheckpointError, latest_valid, saved_config, verify
from hasten.training.telemetry import flatten, redact

# Files a run writes in its log folder (besides metrics.jsonl and summary.json), deleted by --overwrite.
_LOG_FILES = ("metrics.jsonl", "summary.json", "config.json", "versions.json", "tensorboard",
              "profile_step*_rank*.txt", "profile_step*_rank*.trace.json")


def _checkpoint_names(checkpoints: Path) -> list[str]:
    if not checkpoints.is_dir():
        return []
    return sorted(p.name for p in checkpoints.glob(f"{PREFIX}*") if p.is_dir())


def metrics_rows(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def _earlier_results(output_dir: Path, log_dir: Path) -> dict[str, str]:
    """What of a run that ended (or crashed) is here, by kind: its final model, summary, metrics rows."""
    held = {}
    if (output_dir / "final").exists():
        held["final"] = f"final model {output_dir / 'final'}"
    summary = log_dir / "summary.json"
    if summary.is_file():
        try:
            data = json.loads(summary.read_text())
            how = f"stopped by {data['interrupted_by']}" if data.get("interrupted_by") else "finished"
            held["summary"] = f"summary {summary}: {data.get('steps')} steps, {how}"
        except (OSError, ValueError, AttributeError):
            held["summary"] = f"summary {summary}"
    rows = metrics_rows(log_dir / "metrics.jsonl")
    if rows:
        held["metrics"] = f"{log_dir / 'metrics.jsonl'}: {rows} rows"
    return held


def guard_earlier_run(output_dir: Path, log_dir: Path, checkpoints: Path, resume: str | None, overwrite: bool,
                       ctx) -> None:
    """Refuse to train over another run's results unless --resume continues it or --overwrite
    replaces it; with --overwrite the rank-0 process deletes that run's files, naming them."""
    fresh = resume in (None, "", "none")
    if overwrite and not fresh:
        raise ConfigError(f"--overwrite replaces the earlier run in {output_dir} and --resume {resume} continues it; "
                          "pass one of them")
    names = _checkpoint_names(checkpoints)
    results = _earlier_results(output_dir, log_dir)
    if not names and not results:
        return
    if overwrite:
        if ctx.is_main:
            _delete_earlier_run(output_dir, log_dir, checkpoints)
        return
    if fresh:  # a fresh run here would mix its files with another run's, or replace them
        what = "checkpoints" if names else "the results"
        details = ([f"{checkpoints}: {names[-1]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")]
                   if names else []) + list(results.values())
        raise ConfigError(f"{output_dir} already holds {what} of an earlier run ({'; '.join(details)}); continue it "
                          "with --resume auto (raise --max_steps to train further), replace it with --overwrite "
                          "(deletes its model, checkpoints and logs first), or train into a new --output_dir")


def _delete_earlier_run(output_dir: Path, log_dir: Path, checkpoints: Path) -> None:
    doomed = [p for p in (output_dir / "final", checkpoints) if p.exists()]
    doomed += sorted(output_dir.glob(".tmp-final-*"))
    for pattern in _LOG_FILES:
        doomed += sorted(log_dir.glob(pattern))
    for path in doomed:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    logger.warning("hasten: --overwrite: deleted the earlier run's %s", ", ".join(str(p) for p in doomed))


def resolve_resume(resume: str | None, checkpoints: Path, *, output_dir: Path | None = None,
                   log_dir: Path | None = None) -> Path | None:
    """The checkpoint to continue from (None: a fresh run; guard_earlier_run has refused a fresh
    run over another run's checkpoints already)."""
    if resume in (None, "", "none"):
        return None
    if resume == "auto":
        found = latest_valid(checkpoints)
        if found is None:
            held = _earlier_results(output_dir, log_dir) if output_dir is not None and log_dir is not None else {}
            # metrics rows alone are an attempt that crashed before its first checkpoint: start it again
            ended = [text for kind, text in held.items() if kind != "metrics"]
            broken = _checkpoint_names(checkpoints)
            if ended:
                unusable = f" ({len(broken)} there, none complete: see the warnings above)" if broken else ""
                raise ConfigError(f"--resume auto: no complete checkpoint in {checkpoints}{unusable} to continue the "
                                  f"earlier run from ({'; '.join(ended)}); replace that run with --overwrite, or "
                                  "train into a new --output_dir")
            logger.info("hasten: --resume auto found no complete checkpoint in %s; starting fresh", checkpoints)
        return found
    path = Path(resume)
    if path.is_dir() and not (path / "manifest.json").exists():
        for parent in (path, path / "checkpoints"):  # an output folder or its checkpoints folder instead
            inside = _checkpoint_names(parent)
            if inside:
                raise ConfigError(f"--resume {resume} is not a checkpoint folder but holds checkpoints ({inside[-1]}, "
                                  f"...); pass one of them (e.g. --resume {parent / inside[-1]}), or --resume auto "
                                  "to take the newest complete checkpoint of --output_dir")
    try:
        verify(path)
    except CheckpointError as exc:
        raise ConfigError(f"--resume {resume}: {exc}; pass another checkpoint folder "
                          "(OUTPUT_DIR/checkpoints/checkpoint-NNNNNN) or --resume auto") from exc
    return path


# Config keys a resumed run may change freely: how long and how often (the LR schedule stretches to
# a new max_steps), where and how it runs (device, parallel strategy, kernels, memory tactics), and
# what it logs. They change neither the model, the data order nor the optimisation.
RESUME_MAY_CHANGE = (
    "training.max_steps", "training.logging_steps", "training.checkpoint.interval_steps",
    "training.checkpoint.keep_last", "training.checkpoint.activations", "training.checkpoint.offload",
    "training.checkpoint.double_buffer", "training.checkpoint.max_memory_gib", "training.device",
    "training.distributed", "training.fsdp2_reshard_after_forward", "training.fsdp2_layers_per_unit",
    "training.metadata_cache", "training.compile", "training.cuda_graphs", "training.moe.", "kernels.", "attention.",
    "logging.",
)


def config_record(config: Config) -> dict[str, Any]:
    """The config as a checkpoint stores it (JSON types)."""
    return json.loads(json.dumps(redact(config.to_dict())))


def parse_allowed_changes(value: str | None, config: Config | None = None) -> tuple[str, ...]:
    """--allow_config_change's comma-separated keys, each checked against the schema."""
    keys = tuple(k.strip() for k in (value or "").split(",") if k.strip())
    known = flatten((config or Config()).to_dict(), ".")
    for key in keys:
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]}?" if near else "; keys are dotted, e.g. training.learning_rate"
            raise ConfigError(f"--allow_config_change: unknown config key {key!r}{hint}")
    return keys


def _inert(key: str, before: dict[str, Any], now: dict[str, Any]) -> bool:
    """Keys that do nothing in both configs: LoRA's settings with LoRA off, the embedded model's
    size when a model folder is named."""
    if key.startswith("lora.") and key != "lora.enabled":
        return not before.get("lora.enabled") and not now.get("lora.enabled")
    if key == "model.default_size":
        return bool(before.get("model.path")) and bool(now.get("model.path"))
    return False


def check_resume_config(checkpoint: Path, config: Config, allowed: tuple[str, ...]) -> None:
    """Refuse to resume with a config that differs from the checkpoint's in a key outside
    RESUME_MAY_CHANGE, unless --allow_config_change names that key."""
    saved = saved_config(checkpoint)
    if saved is None:
        logger.warning("hasten: %s has no saved config (written by an older hasten): the resumed run's config "
                       "cannot be compared with it", checkpoint)
        return
    before, now = flatten(saved, "."), flatten(config_record(config), ".")
    changed = {key: (before[key], now[key]) for key in now if key in before and before[key] != now[key]
               and not _inert(key, before, now)}
    free = {k: v for k, v in changed.items() if k.startswith(RESUME_MAY_CHANGE)}
    allowed_now = {k: v for k, v in changed.items() if k in allowed and k not in free}
    refused = {k: v for k, v in changed.items() if k not in free and k not in allowed_now}
    for key, (old, new) in {**free, **allowed_now}.items():
        logger.info("hasten: resuming with %s %r (the checkpoint had %r)", key, new, old)
    if refused:
        listed = "; ".join(f"{k}: {old!r} in the checkpoint, {new!r} now" for k, (old, new) in refused.items())
        raise ConfigError(f"--resume {checkpoint}: the config differs from the one the checkpoint was written with "
                          f"({listed}); resuming would mix two different runs. Set "
                          f"{'them' if len(refused) > 1 else 'it'} back (the checkpoint's config is "
                          f"{checkpoint / 'config.json'}), or pass --allow_config_change {','.join(refused)} to "
                          "resume with the new value anyway")

"""`hasten train --config FILE --output_dir DIR --log_dir DIR`."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from hasten.config import Config, ConfigError


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train", help="train a model with hasten (the embedded default when no model or data is named)",
        description="Train with hasten. With no --config, or a config that names no model and no data, it trains "
                    "the embedded default: a small Qwen3-architecture model on a text corpus shipped with hasten.")
    parser.add_argument("--config", help="YAML config (keys: docs/configuration.md); default: built-in defaults")
    parser.add_argument("--output_dir", default="runs/default", help="where the trained model is saved")
    parser.add_argument("--log_dir", default=None, help="metrics.jsonl and summary.json (default: OUTPUT_DIR/logs)")
    parser.add_argument("--max_steps", type=int, help="override training.max_steps")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], help="override training.device")
    parser.add_argument("--resume", default="none", metavar="auto|none|PATH",
                        help="auto: continue from the newest complete checkpoint in OUTPUT_DIR/checkpoints "
                             "(fresh start if there is none); PATH: that checkpoint folder; none (default)")
    parser.add_argument("--overwrite", action="store_true",
                        help="OUTPUT_DIR holds an earlier run (final model, checkpoints, logs): delete those files "
                             "and train afresh (without it, such a folder is refused)")
    parser.add_argument("--allow_config_change", default="", metavar="KEY[,KEY...]",
                        help="with --resume: config keys (e.g. training.learning_rate) that may differ from the "
                             "checkpoint's config; other changes, besides those that never matter (max_steps, "
                             "logging, checkpoint interval, device, kernels: docs/design.md), are refused")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar (log lines only)")
    parser.set_defaults(func=run)
    return parser


def _check_model_is_kept(config: Config, output_dir: str) -> None:
    """A run that trains the model in OUTPUT_DIR/final would save over the model it started from."""
    if not config.model.path:
        return
    final = Path(output_dir) / "final"
    if final.resolve() == Path(config.model.path).resolve():
        raise ConfigError(f"model.path {config.model.path} is the folder this run saves its model into "
                          f"(--output_dir {output_dir}: {final}), so the model it starts from would be overwritten. "
                          f"Fix: pass another --output_dir (e.g. {output_dir.rstrip('/')}-next)")


def run(args: argparse.Namespace) -> int:
    from hasten.data import DataError
    from hasten.ops import ExtensionError
    from hasten.packing import PackingError
    from hasten.training.checkpoint import CheckpointError
    from hasten.training.loop import DivergenceError, parse_allowed_changes, train

    try:
        config = Config.from_yaml(args.config) if args.config else Config()
        overrides = {}
        if args.max_steps is not None:
            overrides["max_steps"] = args.max_steps
        if args.device is not None:
            overrides["device"] = args.device
        if overrides:
            merged = config.to_dict()
            merged["training"].update(overrides)
            config = Config.from_dict(merged, source="command line")
        _check_model_is_kept(config, args.output_dir)
        log_dir = args.log_dir or f"{args.output_dir}/logs"
        allowed = parse_allowed_changes(args.allow_config_change, config)
        if allowed and args.resume in (None, "", "none"):
            raise ConfigError("--allow_config_change applies when resuming; add --resume auto or --resume PATH")
        result = train(config, args.output_dir, log_dir, progress=not args.no_progress, resume=args.resume,
                       overwrite=args.overwrite, allow_config_change=allowed)
    except (ConfigError, DataError, PackingError, CheckpointError, DivergenceError, ExtensionError) as exc:
        print(f"hasten train: error: {exc}", file=sys.stderr)
        return 2
    if result.interrupted_by is not None:
        print(f"hasten train: stopped by {result.interrupted_by} after step {result.steps}; checkpoint "
              f"{result.last_checkpoint}; continue with --resume auto", file=sys.stderr)
        return 128 + int(getattr(signal, result.interrupted_by))
    if os.environ.get("RANK", "0") != "0":  # under torchrun, rank 0 speaks for the job
        return 0
    print(f"hasten train: {result.steps} steps, final loss {result.final_loss:.4f}; model in {result.model_dir}, "
          f"metrics in {result.metrics_path}")
    return 0

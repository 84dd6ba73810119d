"""default_job: the embedded default job (`make train`: hasten train with no config, the small
Qwen3-architecture model on the embedded corpus) eager, compiled and graphed, in one run.

Issue 16 asks for compiled and graphed rows against eager on this job beside W1 and W3. Each
variant is the whole `hasten train` (hasten.training.bench.run_variant: the same data and seed,
a metrics row per step), differing only in these settings:

  eager               the defaults (what `make train` runs)
  compiled            training.compile: true (each decoder layer under torch.compile)
  graphed_optimizer   training.cuda_graphs: optimizer (the AdamW step in a CUDA graph)
  compiled_graphed    both
  graphed_step        training.cuda_graphs: step (each micro-batch's forward and backward replayed
                      from a CUDA graph of its padded shape, and the AdamW step)
  baseline            hasten off (hasten bench's baseline: padded micro-batches through
                      transformers' own code), for scale

Rate: the median tokens/s of the steps after the first `--warmup` (the compile and the graph
capture fall in the first steps). Also per row: the median host lead (how far the host ran ahead
of the GPU: near 0 means the step is host-bound), host syncs in a step, the peak memory and the
fallbacks. `correct`: the variant's loss curve within `--tolerance` of eager's at every step
(the same batches; compile reorders float arithmetic, so not bitwise). Rows go to
default_job.jsonl (results/ or --out).

    python benchmarks/default_job.py [--steps 30] [--variants eager,compiled,...] [--size small]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from hasten.config import Config  # noqa: E402
from hasten.training.bench import read_summary, run_variant, variant_configs  # noqa: E402
from hasten.training.metrics import median_rates, read_metrics  # noqa: E402

VARIANTS = ("eager", "compiled", "graphed_optimizer", "compiled_graphed", "graphed_step", "baseline")
SETTINGS = {"eager": {}, "compiled": {"compile": True}, "graphed_optimizer": {"cuda_graphs": "optimizer"},
            "compiled_graphed": {"compile": True, "cuda_graphs": "optimizer"}, "graphed_step": {"cuda_graphs": "step"}}


def variant_config(name: str, steps: int, size: str) -> Config:
    """The default job's config for one variant: `steps` steps, a metrics row per step, no
    checkpoint inside them (hasten bench's settings), the named training switches."""
    configs = variant_configs(Config.from_dict({"model": {"default_size": size}}), steps)
    if name == "baseline":
        return configs["baseline"]
    raw = configs["hasten"].to_dict()
    raw["training"].update(SETTINGS[name])
    return Config.from_dict(raw, source=f"default_job ({name})")


def loss_check(reference: list[float], losses: list[float], tolerance: float) -> tuple[float, bool]:
    """The largest per-step loss difference from eager's curve, and whether the curve is whole and
    within `tolerance` of it."""
    n = min(len(reference), len(losses))
    worst = max((abs(a - b) for a, b in zip(reference[:n], losses[:n])), default=float("nan"))
    return worst, len(losses) == len(reference) and worst <= tolerance


def median_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return float(statistics.median(values)) if values else None


def run(name: str, steps: int, warmup: int, size: str, folder: Path, reference: list[float] | None,
        tolerance: float) -> dict:
    result = run_variant(name, variant_config(name, steps, size), folder, progress=False)
    rows = read_metrics(Path(result.log_dir) / "metrics.jsonl")[-len(result.curve_loss):]
    timed = rows[warmup:] or rows
    tokens_per_s, step_s = median_rates(rows, warmup)
    losses = [round(x, 5) for x in result.curve_loss]
    summary = read_summary(Path(result.log_dir))
    row = {"workload": "default_job", "variant": name, "model": f"embedded default ({size})",
           **common.environment(), "steps": steps, "warmup_steps": min(warmup, len(rows) - 1),
           "tokens_per_s": tokens_per_s, "step_s": step_s,
           "peak_gib": result.peak_gib, "host_lead_ms": median_of(timed, "host_lead_ms"),
           "host_syncs_per_step": max((r.get("host_syncs_per_step") or 0) for r in rows),
           "first_step_s": rows[0]["step_s"] if rows else None, "losses": losses,
           "fallbacks": result.fallbacks, "compile": summary.get("compile"), "step_graphs": summary.get("step_graphs"),
           "device": result.device, "dtype": result.dtype}
    if reference is not None and name != "baseline":
        row["loss_max_abs_diff_vs_eager"], row["correct"] = loss_check(reference, losses, tolerance)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the medians (compile, capture)")
    parser.add_argument("--variants", default="eager,compiled,graphed_optimizer,compiled_graphed,graphed_step,baseline")
    parser.add_argument("--size", default="small", choices=("tiny", "small", "qwen3-0.6b"),
                        help="model.default_size (the default job's is small)")
    parser.add_argument("--tolerance", type=float, default=2e-2, help="largest loss difference from eager, any step")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        print(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    if "eager" in names:  # the reference curve first
        names = ["eager"] + [n for n in names if n != "eager"]
    run_id, rows, reference = common.new_run_id(), [], None
    with tempfile.TemporaryDirectory(prefix="hasten-default-job-") as tmp:
        for name in names:
            try:
                row = run(name, args.steps, args.warmup, args.size, Path(tmp), reference, args.tolerance)
            except Exception as exc:  # noqa: BLE001 -- a failed variant is a row, the run goes on
                row = {"workload": "default_job", "variant": name, **common.environment(),
                       "error": f"{type(exc).__name__}: {exc}"[:2000]}
            row["run_id"] = run_id
            if name == "eager" and "losses" in row:
                reference = row["losses"]
            rows.append(row)
            common.write_rows([row], "default_job", args.out)
            if "error" in row:
                print(f"{name:>18}: ERROR {row['error']}", flush=True)
                continue
            lead = "n/a" if row["host_lead_ms"] is None else f"{row['host_lead_ms']:.1f} ms"
            print(f"{name:>18}: {row['tokens_per_s']:>10,.0f} tok/s  step {row['step_s'] * 1e3:7.1f} ms  "
                  f"first step {row['first_step_s'] * 1e3:.0f} ms  peak {row['peak_gib']:.2f} GiB  host lead {lead}  "
                  f"syncs {row['host_syncs_per_step']}  fallbacks {row['fallbacks'] or 'none'}  "
                  f"correct {row.get('correct', '-')} (max loss diff {row.get('loss_max_abs_diff_vs_eager', 0):.2e})",
                  flush=True)
    done = {r["variant"]: r for r in rows if r.get("tokens_per_s")}
    if "eager" in done:
        for name, row in done.items():
            if name != "eager":
                print(f"{name} vs eager: {row['tokens_per_s'] / done['eager']['tokens_per_s']:.3f}x tokens/s", flush=True)
    print(f"rows: {common.RESULTS if args.out is None else args.out}/default_job.jsonl; device "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

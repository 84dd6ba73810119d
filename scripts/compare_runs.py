"""Compare hasten train runs by their metrics.jsonl: median tokens/s (warm-up steps skipped),
scaling against the first run, and loss agreement on shared steps.

    python scripts/compare_runs.py --skip 3 one_gpu=runs/a/logs two_gpu=runs/b/logs [resumed=runs/c/logs]

Prints a table and writes the same numbers as JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from hasten.training.metrics import median_rates, read_metrics


def read_rows(log_dir: Path) -> list[dict]:
    path = log_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: did that run fail? (see its console log)")
    return read_metrics(path)


def summarise(name: str, rows: list[dict], skip: int) -> dict:
    tokens_per_s, step_s = median_rates(rows, warmup_rows=skip)
    gpu = [r.get("gpu") for r in rows if r.get("gpu")]
    leads = [r["host_lead_ms"] for r in rows[skip:] or rows if r.get("host_lead_ms") is not None]
    return {"run": name, "steps": [rows[0]["step"], rows[-1]["step"]], "tokens_per_s": tokens_per_s,
            "step_s": step_s, "peak_gib": max(r["peak_gib"] for r in rows),
            "host_lead_ms": statistics.median(leads) if leads else None,
            "losses": {r["step"]: r["loss"] for r in rows}, "gpu_last": gpu[-1] if gpu else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="NAME=LOG_DIR")
    parser.add_argument("--skip", type=int, default=3, help="warm-up rows (steps) left out of the medians")
    parser.add_argument("--json")
    args = parser.parse_args()
    runs = [summarise(name, read_rows(Path(path)), args.skip)
            for name, path in (item.split("=", 1) for item in args.runs)]
    reference = runs[0]
    for run in runs:
        run["speedup_vs_first"] = run["tokens_per_s"] / reference["tokens_per_s"]
        shared = sorted(set(run["losses"]) & set(reference["losses"]))
        run["max_loss_diff_vs_first"] = max((abs(run["losses"][s] - reference["losses"][s]) for s in shared),
                                            default=None)
        print(f"{run['run']:>14}: steps {run['steps'][0]}-{run['steps'][1]}  {run['tokens_per_s']:>10,.0f} tok/s  "
              f"step {run['step_s'] * 1000:7.1f} ms  peak {run['peak_gib']:6.1f} GiB  "
              f"x{run['speedup_vs_first']:.3f} vs {reference['run']}  "
              f"max |loss diff| on {len(shared)} shared steps: {run['max_loss_diff_vs_first']}"
              + (f"  host lead {run['host_lead_ms']:.1f} ms" if run["host_lead_ms"] is not None else ""))
        if run["gpu_last"]:
            print(f"{'':>16}NVML at the last step: {run['gpu_last']}")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1, default=str))


if __name__ == "__main__":
    main()

"""`hasten bench --config FILE [--steps N] [--output_dir DIR] [--json PATH] [--plot PATH]`.

The before/after comparison: the same job with hasten off (padded batches through
transformers' attention) and on (the config as given), same data and seed. Prints a
table, writes a JSON report and a PNG plot. Exit codes: 0 done; 2 configuration or
data error; 3 the optimized path did not engage (an unexpected fallback, or varlen
attention not active) -- the report is still written.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from hasten.config import Config, ConfigError

EXIT_OK, EXIT_ERROR, EXIT_NOT_ENGAGED = 0, 2, 3


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench", help="before/after comparison: the same job with hasten off and on",
        description="Train the same job twice, same data and seed: 'baseline' with hasten off (padded batches "
                    "through transformers' attention) and 'hasten' with the config as given (packed sequences). "
                    "Prints tokens/s, step time, peak memory, final loss and fallbacks side by side, writes a JSON "
                    "report and a PNG plot (needs matplotlib). Exit 3 when the optimized path did not engage.")
    parser.add_argument("--config", help="YAML config (keys: docs/configuration.md); default: built-in defaults")
    parser.add_argument("--steps", type=int, default=20, help="steps per variant (overrides training.max_steps; "
                        "default 20)")
    parser.add_argument("--output_dir", default="runs/bench", help="the runs go to OUTPUT_DIR/baseline and "
                        "OUTPUT_DIR/hasten (default runs/bench)")
    parser.add_argument("--json", dest="json_path", help="JSON report (default OUTPUT_DIR/bench.json)")
    parser.add_argument("--plot", dest="plot_path", help="PNG plot (default OUTPUT_DIR/bench.png)")
    parser.add_argument("--no_progress", action="store_true", help="no progress bars (log lines only)")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from hasten.data import DataError
    from hasten.packing import PackingError
    from hasten.training import bench

    output_dir = Path(args.output_dir)
    try:
        config = Config.from_yaml(args.config) if args.config else Config()
        report = bench.run_ab(config, args.steps, output_dir, progress=not args.no_progress)
    except (ConfigError, DataError, PackingError) as exc:
        print(f"hasten bench: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except bench.BenchInterrupted as exc:
        print(f"hasten bench: {exc}", file=sys.stderr)
        return 128 + int(getattr(signal, exc.signal_name, signal.SIGINT))

    print(bench.format_table(report))

    plot_path: Path | None = Path(args.plot_path) if args.plot_path else output_dir / "bench.png"
    try:
        plot_path = bench.write_plot(report, plot_path)
    except ImportError as exc:
        print(f"hasten bench: plot skipped: matplotlib is not importable ({exc}); `pip install matplotlib` "
              "for the PNG")
        plot_path = None
    else:
        print(f"hasten bench: plot in {plot_path}")

    json_path = Path(args.json_path) if args.json_path else output_dir / "bench.json"
    exit_code = EXIT_OK if report.engaged else EXIT_NOT_ENGAGED
    data = report.to_dict()
    data.update(plot=str(plot_path) if plot_path else None, config=args.config, exit_code=exit_code)
    try:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        print(f"hasten bench: error: cannot write {json_path}: {exc.strerror}", file=sys.stderr)
        return EXIT_ERROR
    print(f"hasten bench: report in {json_path}")

    if not report.engaged:
        print("hasten bench: the optimized path did not engage in the hasten run:", file=sys.stderr)
        for problem in report.problems:
            print(f"  - {problem}", file=sys.stderr)
    return exit_code

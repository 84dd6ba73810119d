"""The `hasten` command: train | bench | doctor.

Building the parser imports only argparse-level code: torch, transformers and the op library
(hasten._C) load when a subcommand runs, so `hasten --version` and `hasten doctor` work on an
install whose op library is missing or broken (doctor reports it).
"""

from __future__ import annotations

import argparse
import logging
import sys

from hasten._version import __version__


def build_parser() -> argparse.ArgumentParser:
    from hasten.cli import bench, doctor, train

    parser = argparse.ArgumentParser(prog="hasten", description="Training acceleration for LLM fine-tuning.")
    parser.add_argument("--version", action="version", version=f"hasten {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    train.add_parser(subparsers)
    doctor.add_parser(subparsers)
    bench.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    args = build_parser().parse_args(argv)  # --version and --help exit here
    from hasten.observability import cli_console  # (imports torch)

    with cli_console():
        return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

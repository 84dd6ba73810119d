"""Fallbacks from optimized paths: told to the user once, loudly, and counted.

Every layer reports through `record_fallback`; the training loop and the
benchmarks read `fallback_counts()` into their metrics, so "the optimized path was
not used" is never silent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import traceback
import warnings
from collections import Counter

import torch

logger = logging.getLogger("hasten")

_lock = threading.Lock()
_counts: Counter[str] = Counter()
_reasons: dict[str, str] = {}


# Under torch.compile, dynamo calls record_fallback while it traces (assume_constant_result: it runs
# the call with its constant arguments and keeps the result, None) instead of tracing its lock and
# logger, which would break the graph. The choice of a slower path is made at trace time, so a
# compiled graph that takes one warns the first time (the same message) and counts once per
# trace, not once per call. Callers pass strings of values that are constants at trace time (a
# shape that is symbolic would be specialised by the formatting).
@torch.compiler.assume_constant_result
def record_fallback(key: str, reason: str) -> None:
    """Count one use of a slower path; warn the first time `key` is seen."""
    with _lock:
        first = key not in _reasons
        _counts[key] += 1
        if first:
            _reasons[key] = reason
    if first:
        logger.warning("hasten fallback [%s]: %s", key, reason)


def fallback_counts() -> dict[str, int]:
    with _lock:
        return dict(_counts)


def fallback_reasons() -> dict[str, str]:
    with _lock:
        return dict(_reasons)


def reset_fallbacks() -> None:
    """Forget counts and reasons (tests, and each run of the training loop)."""
    with _lock:
        _counts.clear()
        _reasons.clear()


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (redirected, captured, or a tqdm bar's)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


@contextlib.contextmanager
def cli_console():
    """hasten's records while the `hasten` command runs: "LEVEL: message" on the current stderr,
    and only there (the command's root handler, configured for other libraries, would print them
    a second time). Undone on exit, so a caller that runs the command in process (tests, a
    notebook) keeps its own logging set-up.

    Library use installs nothing: with no handler configured anywhere, Python's last-resort
    handler prints hasten's warnings (fallbacks) to stderr, so they are never silent, and an
    application that configures logging gets them through its own handlers."""
    handler = _CurrentStderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


class HostSyncCount:
    """Result of `count_host_syncs`: `count` and, per sync, the innermost caller
    outside torch itself (`sites`), filled in when the block exits."""

    def __init__(self) -> None:
        self.count = 0
        self.sites: list[str] = []


def _caller_outside_torch() -> str:
    """The innermost frame that is neither torch, the warnings machinery nor this module,
    with the torch frame it called into."""
    skip = (os.path.dirname(torch.__file__), warnings.__file__, __file__)
    frames = traceback.extract_stack()
    for depth in range(len(frames) - 1, -1, -1):
        frame = frames[depth]
        if not frame.filename.startswith(skip):
            callee = frames[depth + 1] if depth + 1 < len(frames) else frame
            return f"{frame.filename}:{frame.lineno} ({frame.name}) -> {os.path.basename(callee.filename)}:{callee.lineno}"
    return "<torch>"


@contextlib.contextmanager
def count_host_syncs(record_sites: bool = True):
    """Count the synchronizing CUDA operations (item, nonzero, device-to-host copies,
    device synchronize, ...) issued inside the block, through torch's sync debug mode.
    Counts 0 without CUDA. `record_sites` False skips the stack walk that names each sync's
    caller (the count alone costs next to nothing, for probes on a training loop)."""
    result = HostSyncCount()
    if not torch.cuda.is_available():
        yield result
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        original_show = warnings.showwarning

        armed = False  # switching the debug mode on may itself warn; count only the block

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchronizing" in str(message) and armed:
                result.count += 1
                if record_sites:
                    result.sites.append(_caller_outside_torch())
            elif "synchronizing" not in str(message):
                original_show(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        armed = True
        try:
            yield result
        finally:
            torch.cuda.set_sync_debug_mode(previous)

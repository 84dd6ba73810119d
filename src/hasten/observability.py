"""Fallbacks from optimized paths: told to the user once, loudly, and counted.

Every layer reports through `record_fallback`; the training loop and the
benchmarks read `fallback_counts()` into their metrics, so "the optimized path was
not used" is never silent.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections import Counter

import torch

logger = logging.getLogger("hasten")

_lock = threading.Lock()
_counts: Counter[str] = Counter()
_reasons: dict[str, str] = {}


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


def _ensure_console_handler() -> None:
    # A user who never configured logging must still see fallback warnings.
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


_ensure_console_handler()


class HostSyncCount:
    """Result of `count_host_syncs`: `count` is set when the block exits."""

    count: int = 0
    sites: list[str]

    def __init__(self) -> None:
        self.sites = []


@contextlib.contextmanager
def count_host_syncs():
    """Count the synchronizing CUDA operations (item, nonzero, device-to-host copies, ...)
    issued inside the block, through torch's sync debug mode. A no-op count of 0
    without CUDA."""
    result = HostSyncCount()
    if not torch.cuda.is_available():
        yield result
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield result
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    syncs = [w for w in caught if "synchronizing" in str(w.message)]
    result.count = len(syncs)
    result.sites = [f"{w.filename}:{w.lineno}" for w in syncs]

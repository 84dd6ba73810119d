"""Per-logging-step metrics: console line, progress bar postfix, and a JSONL file; one profiled step."""

from __future__ import annotations

import contextlib
import json
import resource
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hasten.observability import logger


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is KiB on Linux, bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


class MetricsLog:
    """Appends one JSON object per logging step to `log_dir/metrics.jsonl`."""

    def __init__(self, log_dir: Path) -> None:
        self.path = log_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps({"time": time.time(), **row}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class HostLeadMeter:
    """How far the host runs ahead of the GPU, from CUDA events: no profiler, so no distortion.

    At marks in each step (each micro-batch's forward end and backward end, the optimizer step's
    end) the host records a timed event on the compute stream and its own clock. After the window's
    read-back (a sync), each event's GPU time, put on the host clock through an anchor event
    recorded while the GPU was idle, says how long after the host passed the mark the GPU did: the
    lead. A step's smallest lead is its margin. Near 0 ms, the GPU had drained its queue and waited
    for the host somewhere in the step: the step is host-bound (less Python or fewer kernel launches
    per step help; a faster GPU does not). Tens of ms: the host stayed ahead and the GPU is the limit.
    """

    # Margins seen on one H200 (Qwen3-0.6B shape): 0-4 ms with FSDP2 units of one layer (host-bound,
    # 0.65x the plain loop), 20-50 ms for the plain loop. Under this, the run says it is host-bound.
    HOST_BOUND_MS = 1.0

    def __init__(self, device: torch.device) -> None:
        self.enabled = device.type == "cuda"
        self._anchor: tuple[torch.cuda.Event, float] | None = None
        self._steps: list[list[tuple[torch.cuda.Event, float]]] = []  # per step: (event, host seconds)
        self._windows_reported = 0
        self._host_bound_said = False

    def _record(self) -> tuple[torch.cuda.Event, float]:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event, time.perf_counter()

    def start_window(self) -> None:
        """Call right after a sync, while the GPU has nothing queued."""
        if self.enabled:
            self._anchor = self._record()
            self._steps = []

    def mark(self, step_start: bool = False) -> None:
        if self.enabled and self._anchor is not None:
            if step_start or not self._steps:
                self._steps.append([])
            self._steps[-1].append(self._record())

    def margin_ms(self) -> float | None:
        """Median over the window's steps of each step's smallest lead (ms); None without CUDA.
        Call after a sync (every event recorded so far has completed)."""
        if not self.enabled or self._anchor is None or not self._steps:
            return None
        anchor, anchor_host = self._anchor
        margins = [min(max(0.0, anchor_host + anchor.elapsed_time(event) / 1e3 - host) for event, host in marks)
                   for marks in self._steps]
        return statistics.median(margins) * 1e3

    def rank_slots(self, rank: int, world_size: int) -> list[float]:
        """This rank's margin in its own slot of a world_size list (summed over ranks by the logging
        all-reduce, which gathers every rank's margin); [] without CUDA."""
        if not self.enabled:
            return []
        slots = [0.0] * world_size
        slots[rank] = self.margin_ms()
        return slots

    def report(self, lead_ms: float | None) -> None:
        """Say once per run that the step is host-bound: a window after the first (warm-up) whose
        lead, the most host-bound rank's, is under HOST_BOUND_MS."""
        self._windows_reported += 1
        if (lead_ms is None or lead_ms >= self.HOST_BOUND_MS or self._windows_reported == 1
                or self._host_bound_said):
            return
        self._host_bound_said = True
        logger.warning(
            "hasten: the step is host-bound: the GPU waits for Python in most steps (host lead %.1f ms; tens of ms "
            "when the GPU is the limit). More tokens per step (training.max_tokens), larger FSDP2 units "
            "(training.fsdp2_layers_per_unit) or DDP for a model that fits on one GPU give the host more GPU work "
            "to hide behind; see 'Several GPUs' in docs/deployment.md", lead_ms)


def format_row(row: dict[str, Any]) -> str:
    loss = "-" if row["loss"] is None else f"{row['loss']:.4f}"  # None: every batch of the window was masked
    text = (f"step {row['step']:>5} | loss {loss} | lr {row['lr']:.2e} | "
            f"{row['tokens_per_s']:,.0f} tok/s | step {row['step_s'] * 1000:.1f} ms | "
            f"peak {row['peak_gib']:.2f} GiB")
    if row.get("host_syncs_per_step"):
        text += f" | host syncs {row['host_syncs_per_step']}/step"
    if row.get("host_lead_ms") is not None:
        text += f" | host lead {row['host_lead_ms']:.1f} ms"
    if row.get("masked_batches"):
        text += f" | masked batches {row['masked_batches']}"
    if row.get("checkpoint_s"):
        text += f" | checkpoint {row['checkpoint_s']:.1f} s"
    if row.get("fallbacks"):
        text += " | fallbacks " + ", ".join(f"{k}={v}" for k, v in sorted(row["fallbacks"].items()))
    return text


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl, in order."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def median_rates(rows: list[dict[str, Any]], warmup_rows: int) -> tuple[float, float]:
    """Median tokens/s and step seconds over `rows` after the first `warmup_rows` (over all rows
    when that would leave none)."""
    timed = rows[warmup_rows:] or rows
    return (float(statistics.median(r["tokens_per_s"] for r in timed)),
            float(statistics.median(r["step_s"] for r in timed)))


@contextlib.contextmanager
def profiled_step(log_dir: Path, step: int, rank: int, device: torch.device) -> Iterator[None]:
    """Runs the block under torch.profiler and writes, for this rank, the operators by their own GPU
    time and by their own CPU time (LOG_DIR/profile_step<N>_rank<R>.txt) and a trace for Perfetto or
    chrome://tracing (.trace.json): where a slow step spends its time, GPU busy or host-bound."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    stem = Path(log_dir) / f"profile_step{step}_rank{rank}"
    averages = prof.key_averages()
    sections = []
    if device.type == "cuda":
        sections.append(("by own GPU time", averages.table(sort_by="self_cuda_time_total", row_limit=30)))
    sections.append(("by own CPU time", averages.table(sort_by="self_cpu_time_total", row_limit=30)))
    stem.with_suffix(".txt").write_text("".join(f"== step {step}, rank {rank}, operators {title}\n{table}\n"
                                                for title, table in sections), encoding="utf-8")
    prof.export_chrome_trace(str(stem.with_suffix(".trace.json")))

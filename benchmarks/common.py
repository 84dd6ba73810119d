"""Shared pieces of hasten's benchmarks: timing, result rows (see BENCHMARKS in docs)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def commit(root: Path | None = None) -> str:
    """The commit a row names: HASTEN_COMMIT where set (device runs pass this machine's), else the
    checkout's HEAD, marked -dirty where its tracked files differ from that commit (the device's
    copy of the tree can carry a stale .git: a run at 76c41f5 labelled itself 1735314)."""
    if os.environ.get("HASTEN_COMMIT"):
        return os.environ["HASTEN_COMMIT"]
    root = root or RESULTS.parent.parent

    def git(*args: str) -> str:
        return subprocess.check_output(["git", *args], cwd=root, text=True, stderr=subprocess.DEVNULL).strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def new_run_id() -> str:
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"{now}-{commit()}"


def environment() -> dict:
    """The row's provenance: hasten's commit, the GPU, torch and transformers (the baselines are
    transformers' code: a row measured on a newer carried release says so)."""
    import transformers

    return {"commit": commit(), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__}


def sync() -> None:
    """Wait for the GPU (nothing without CUDA, where the scripts' CPU smoke runs go)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class GpuClocks:
    """The GPU's SM clock and board power while a block runs, from nvidia-smi every `period` seconds
    on a thread (the process waits on the subprocess, not on the GIL). Why rows carry them: W4's step
    runs at the H200's 700 W limit, where the clock falls to 1.5-1.65 GHz and what a board sustains
    there moves the row by 3-4% from machine to machine. `fields()`: {"sm_clock_mhz", "power_w",
    "clock_samples"} (means over the samples), or {} where there is no nvidia-smi (the CPU)."""

    QUERY = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"]

    def __init__(self, period: float = 0.25) -> None:
        self.period, self.samples, self._stop = period, [], threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        index = visible or (str(torch.cuda.current_device()) if torch.cuda.is_available() else "0")
        self.command = [*self.QUERY, "-i", index]

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(self.command, capture_output=True, text=True, timeout=5).stdout
            except (OSError, subprocess.SubprocessError):
                return  # no nvidia-smi: no fields
            self.samples.extend(parse_clock_samples(out))
            self._stop.wait(self.period)

    def __enter__(self) -> "GpuClocks":
        if shutil.which(self.QUERY[0]):
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def fields(self) -> dict:
        if not self.samples:
            return {}
        return {"sm_clock_mhz": round(statistics.mean(c for c, _ in self.samples)),
                "power_w": round(statistics.mean(p for _, p in self.samples), 1), "clock_samples": len(self.samples)}


def parse_clock_samples(text: str) -> list[tuple[float, float]]:
    """nvidia-smi's "clock, power" lines (csv, no header, no units) as (MHz, W); lines that are not
    two numbers ("[N/A]", errors) are skipped."""
    samples = []
    for line in text.splitlines():
        parts = [part.strip() for part in line.split(",")]
        try:
            if len(parts) == 2:
                samples.append((float(parts[0]), float(parts[1])))
        except ValueError:
            continue
    return samples


def time_us(fn, iters: int = 50) -> float:
    """Microseconds per call of `fn()` on the GPU: 3 warm-up calls, then `iters` between two events
    (back to back, no sync between calls: a kernel's own time, launch gaps hidden)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def time_steps(step, warmup: int, iters: int) -> list[float]:
    """Seconds per call of `step()`, each measured with a device sync around it."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return times


def training_step(model, inputs: list[dict], optimizer, losses: list):
    """One optimizer step over the micro-batches `inputs` (gradients accumulated, each loss scaled
    by 1 / len(inputs)); the step's loss, a device tensor, is appended to `losses` (no host sync)."""

    def step():
        total = 0.0
        for micro in inputs:
            loss = model(**micro).loss / len(inputs)
            loss.backward()
            total = total + loss.detach()
        losses.append(total)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def measure_training(build, steps: int, tokens: int, after=None) -> dict:
    """`build()` -> (model, micro-batches, handles to undo, notes); train it with fused AdamW: 2
    warm-up steps, `steps` timed, one more with host syncs counted. Returns a row's measured fields.
    The peak is the training's, the model's memory included, reset after the build (a process's
    first 4-bit variant writes the bf16 checkpoint it quantizes from). `after(step, handles)` runs
    before the handles are undone and returns extra fields (a profile, offload counters). The
    handles are undone and the model freed, whatever happens."""
    import gc

    from hasten.observability import count_host_syncs, fallback_counts, reset_fallbacks

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    reset_fallbacks()
    model, inputs, handles, notes = build()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-5, fused=True)
        losses = []
        step = training_step(model, inputs, optimizer, losses)
        started = time.perf_counter()
        time_steps(step, warmup=2, iters=0)  # compiles, first allocations
        sync()
        warmup_s = time.perf_counter() - started
        with GpuClocks() as clocks:
            times = time_steps(step, warmup=0, iters=steps)
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
        with count_host_syncs() as syncs:
            step()
        extra = after(step, handles) if after is not None else {}
        step_s = median(times)
        return {"tokens_per_s": tokens / step_s, "step_s": step_s, "peak_gib": peak, "warmup_s": round(warmup_s, 2),
                **clocks.fields(),
                "host_syncs_per_step": syncs.count, **extra, "losses": [round(float(v), 5) for v in losses],
                "trainable_params": sum(p.numel() for p in params),
                "notes": f"steps {[round(t, 3) for t in times]}; fallbacks {fallback_counts()}"
                         + "".join(f"; {n}" for n in notes)}
    finally:
        for handle in reversed(handles):
            handle.undo()
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def write_rows(rows: list[dict], workload: str, out_dir: Path | None = None) -> Path:
    out_dir = out_dir or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{workload}.jsonl"
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def variants_asked(argv: list[str]) -> list[str]:
    """The --variants list on a command line, read before argparse runs: a script decides from it,
    before it imports transformers, whether this process is one of Unsloth's (which must be imported
    first)."""
    for i, arg in enumerate(argv):
        if arg.startswith("--variants="):
            return arg.split("=", 1)[1].split(",")
        if arg == "--variants" and i + 1 < len(argv):
            return argv[i + 1].split(",")
    return []


def earlier_row(out: Path | None, workload: str, variant: str) -> dict | None:
    """`variant`'s last measured row at this commit in `out` (or the results folder): what a variant
    that runs alone in its process (Unsloth's) is compared with."""
    path = (out or RESULTS) / f"{workload}.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    found = [r for r in rows if r.get("variant") == variant and r.get("commit") == commit() and r.get("losses")]
    return found[-1] if found else None


def earlier_first_loss(out: Path | None, workload: str, variant: str) -> float | None:
    """The first loss of earlier_row(out, workload, variant), or None."""
    row = earlier_row(out, workload, variant)
    return row["losses"][0] if row is not None else None


def check_first_loss(row: dict, reference: str, reference_loss: float | None, tolerance: float) -> None:
    """Marks `row` correct when its first loss is within `tolerance` of `reference`'s (the same
    weights and batch: a variant that computes something else shows there)."""
    if row["step_s"] is None or reference_loss is None or row["variant"] == reference:
        return
    row[f"first_loss_diff_vs_{reference}"] = abs(row["losses"][0] - reference_loss)
    row["correct"] = row[f"first_loss_diff_vs_{reference}"] <= tolerance


def print_training_row(row: dict, reference: str, width: int = 18) -> None:
    """One line per training-step variant: tokens/s, step, peak, syncs, first loss against `reference`."""
    name = row["variant"]
    if row["step_s"] is None:
        print(f"{name:>{width}}: FAILED {row['error']}", flush=True)
        return
    diff = row.get(f"first_loss_diff_vs_{reference}")
    against = f"vs {reference} {diff:.1e}" if diff is not None else (
        "the reference" if name == reference else f"{reference} not run: unchecked")
    print(f"{name:>{width}}: {row['tokens_per_s']:>8,.0f} tok/s  {row['step_s']:.3f} s  {row['peak_gib']:6.1f} GiB  "
          f"syncs {row['host_syncs_per_step']:>3}  loss {row['losses'][0]:.4f}  ({against})"
          + (f"  {row['sm_clock_mhz']} MHz {row['power_w']:.0f} W" if "sm_clock_mhz" in row else ""), flush=True)


def print_ratio(mine: dict, theirs: dict) -> None:
    print(f"{mine['variant']} vs {theirs['variant']}: {mine['tokens_per_s'] / theirs['tokens_per_s']:.2f}x tokens/s, "
          f"peak {mine['peak_gib']:.1f} vs {theirs['peak_gib']:.1f} GiB")

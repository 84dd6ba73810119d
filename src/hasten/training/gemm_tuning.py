"""`training.gemm_tuning`: each GEMM shape on the fastest cuBLAS / cuBLASLt algorithm, measured.

cuBLAS picks a GEMM's algorithm by heuristics. W4's base projections (T = 16,384) run at about
695 TFLOP/s under them, against 792 measured for the best shape on the same H200: the heuristics'
pick is not always the fastest. PyTorch's TunableOp (`torch.cuda.tunable`) times cuBLAS's default
and every cuBLASLt algorithm its heuristics offer for a shape at the shape's first call, keeps the
fastest, and runs it from then on: every `at::mm` / `addmm` of the process, hasten's fused LoRA
projection and fused loss included. The result is the same product computed by another kernel
(float32 accumulation either way; the summation order may differ within bf16 rounding).

Costs: the first call of each shape takes up to `max_ms` per candidate (a few seconds per shape
in all). Packed batches from PackingCollator have a fixed token count per row count, so a run
meets few shapes. What was tuned goes to `results_file` (PyTorch appends each result as it is
found, or, in older releases, writes the file at exit; the device ordinal is inserted into the
name) and is read at the next start, so a resumed run does not tune again; results of another
PyTorch, CUDA or cuBLAS version are rejected by PyTorch's own validators. Process-wide while
enabled; `undo()` restores PyTorch's earlier TunableOp settings.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hasten.observability import record_fallback

# hasten train's results file, in the run's output directory (PyTorch adds the device ordinal)
GEMM_TUNING_FILE = "gemm_tuning.csv"
# Each candidate algorithm is timed for at most this long per shape (PyTorch's default is 30 ms).
DEFAULT_MAX_MS = 10


class GemmTuning:
    """TunableOp switched on for this process; `undo()` writes the tuned results and restores."""

    def __init__(self, results_file: Path, max_ms: int = DEFAULT_MAX_MS) -> None:
        tunable = torch.cuda.tunable
        self.results_file = results_file
        self._before = (tunable.is_enabled(), tunable.tuning_is_enabled(), tunable.get_filename(),
                        tunable.get_max_tuning_duration())
        results_file.parent.mkdir(parents=True, exist_ok=True)
        # always a file of ours: PyTorch's default would be tunableop_results<N>.csv in the working
        # directory. One per device (torchrun ranks tune their own GPUs): the ordinal in the name.
        tunable.set_filename(str(results_file), insert_device_ordinal=True)
        tunable.set_max_tuning_duration(max_ms)
        tunable.enable(True)
        tunable.tuning_enable(True)
        self._done = False

    def tuned_shapes(self) -> int:
        """How many GEMM shapes have a tuned algorithm so far."""
        return len(torch.cuda.tunable.get_results())

    def undo(self) -> None:
        if self._done:
            return
        self._done = True
        tunable = torch.cuda.tunable
        write_file = getattr(tunable, "write_file", None)  # PyTorch releases that write at exit only
        if write_file is not None and self.tuned_shapes():
            write_file()
        enabled, tuning, filename, max_ms = self._before
        tunable.tuning_enable(tuning)
        tunable.enable(enabled)
        tunable.set_filename(filename)
        tunable.set_max_tuning_duration(max_ms)


def enable_gemm_tuning(device: torch.device, results_file: Path,
                       max_ms: int = DEFAULT_MAX_MS) -> GemmTuning | None:
    """TunableOp on for the GEMMs of this process (see the module's docstring), or None with the
    reason recorded once where it cannot apply (not a CUDA device)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        record_fallback("gemm_tuning", f"training.gemm_tuning: GEMMs on {device} have no cuBLAS algorithms to "
                                       "choose from; they run as PyTorch calls them")
        return None
    return GemmTuning(results_file, max_ms)

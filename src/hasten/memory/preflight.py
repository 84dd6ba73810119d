"""Before the first step: does a batch of training.max_tokens fit this GPU, and with activation
offload this host? (training.memory_preflight)

Measured, not guessed: one or two probe steps (forward and backward of one packed sample of
random tokens, no optimizer step; a quarter and a half of the batch, see probe_sizes) under the
run's own settings (checkpointing, offload, tiles, LoRA), each recording the device's peak above
what was allocated before it and the bytes the offload engine sent to the host. Activation memory
grows linearly with the batch's tokens on every path hasten runs (varlen attention keeps no tokens
x tokens matrix, the fused loss works in chunks), so a line through the probes gives the step's
memory at any length:

  device(T) = optimizer state (AdamW: two tensors per trainable parameter, made at the first step)
              + per_token * T + constant (the gradients, workspaces)
  host(T)   = host_per_token * T                                    (offload only)

against what is free now (the device's free memory plus the allocator's cached blocks, less a 5%
margin for fragmentation; the host's MemAvailable, 80% of it shared among the processes on the host, the
offload guard's own limit).

Where the host cannot hold every offloaded layer's checkpoint but the device has room, the batch is
split (`host_layers_kept`): the last k of the offloaded layers keep their checkpointed input on the
device (host_per_token / host_layers bytes a token each, the decoder's layers being alike), the
fewest k that bring the host under its limit. The highest layers stay: their backward comes first,
so the copies the lower layers make have the most time. A batch that no split fits stops the run
before its first step, naming the largest that fits. Batches up to PROBE_EXACT tokens are probed at
their own size (the forecast is the measurement).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hasten.memory.offload import host_share_bytes

PROBE_EXACT = 8192
DEVICE_MARGIN = 0.95
HOST_FRACTION = 0.8


@dataclass(frozen=True)
class Probe:
    tokens: int
    device_bytes: int  # peak above the allocation before the step
    host_bytes: int    # sent to the host by activation offload during the step


def fit_line(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through (tokens, bytes); one point: through 0."""
    if not points:
        raise ValueError("no probe to fit")
    if len(points) == 1 or len({t for t, _ in points}) == 1:
        tokens, value = points[0]
        return value / tokens, 0.0
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    slope = sum((t - mean_t) * (v - mean_v) for t, v in points) / sum((t - mean_t) ** 2 for t, _ in points)
    return slope, mean_v - slope * mean_t


@dataclass
class MemoryForecast:
    optimizer_bytes: int
    per_token: float
    constant: float
    device_limit: int  # bytes this step may add to what is allocated now
    host_per_token: float = 0.0
    host_limit: int | None = None
    host_layers: int = 0  # decoder layers whose checkpoints went to the host in the probes (0: no split)

    def _layer_per_token(self) -> float:
        """Host bytes a token of one offloaded layer: what keeping it on the device moves there."""
        return self.host_per_token / self.host_layers if self.host_layers > 0 else 0.0

    def device_bytes(self, tokens: int, kept: int = 0) -> float:
        """With `kept` of the offloaded layers' checkpoints on the device instead of the host."""
        return (self.optimizer_bytes + (self.per_token + kept * self._layer_per_token()) * tokens
                + self.constant)

    def host_bytes(self, tokens: int, kept: int = 0) -> float:
        return (self.host_per_token - kept * self._layer_per_token()) * tokens

    def _kept_for_host(self, tokens: int) -> int | None:
        """The fewest offloaded layers to keep on the device so that the host holds the rest (None:
        even keeping every one of them leaves the host over its limit)."""
        if self.host_limit is None or self.host_bytes(tokens) <= self.host_limit:
            return 0
        per_layer = self._layer_per_token() * tokens
        if per_layer <= 0:
            return None
        kept = math.ceil((self.host_bytes(tokens) - self.host_limit) / per_layer)
        return kept if kept <= self.host_layers else None

    def host_layers_kept(self, tokens: int) -> int | None:
        """How many of the offloaded layers (the last ones) keep their checkpointed input on the
        device for a batch of `tokens`: 0 when the host holds them all, None when no split fits."""
        kept = self._kept_for_host(tokens)
        if kept is None or self.device_bytes(tokens, kept) > self.device_limit:
            return None
        return kept

    def largest_tokens(self) -> int:
        room = self.device_limit - self.optimizer_bytes - self.constant
        if self.per_token <= 0 and (self.host_limit is None or self.host_per_token <= 0):
            return 2**62 if room >= 0 else 0
        # the fits are monotone in tokens: bisect between 0 and the device's bound without the host
        high = int(room / self.per_token) + 1 if self.per_token > 0 else 2**62
        if self.host_limit is not None and self.host_per_token > 0 and self.host_layers == 0:
            high = min(high, int(self.host_limit / self.host_per_token) + 1)
        low = 0
        while low < high - 1:
            middle = (low + high) // 2
            if self.host_layers_kept(middle) is None:
                high = middle
            else:
                low = middle
        return low if self.host_layers_kept(low) is not None else 0

    def refusal(self, tokens: int, where: str) -> str | None:
        """Why `tokens` does not fit (None when it does), naming the largest batch that would."""
        if self.host_layers_kept(tokens) is not None:
            return None
        gib = 2**30
        kept_for_host = self._kept_for_host(tokens)
        kept = self.host_layers if kept_for_host is None else kept_for_host
        problems = []
        if self.device_bytes(tokens, kept) > self.device_limit:
            split = (f", keeping {kept} of the {self.host_layers} offloaded layers' checkpoints there because the "
                     "host cannot hold them" if kept else "")
            problems.append(f"about {self.device_bytes(tokens, kept) / gib:.1f} GiB on {where} beyond the weights"
                            f"{split}, with {self.device_limit / gib:.1f} GiB free there "
                            f"({self.per_token * 1000 / 2**20:.1f} MiB of activations per 1,000 tokens, "
                            f"{self.optimizer_bytes / gib:.2f} GiB of optimizer state)")
        if self.host_limit is not None and self.host_bytes(tokens, kept) > self.host_limit:
            problems.append(f"about {self.host_bytes(tokens, kept) / gib:.1f} GiB of host memory for the offloaded "
                            f"activations, with {self.host_limit / gib:.1f} GiB to spare on this machine")
        largest = self.largest_tokens()
        return (f"training.max_tokens={tokens:,} needs " + " and ".join(problems) + f" (measured before the first "
                f"step). The largest batch that fits with these settings is about {largest:,} tokens: lower "
                "training.max_tokens to it, or lower the memory per token (training.checkpoint.activations: full, "
                "offload: all, mlp_tile_tokens), or set training.memory_preflight: false to try anyway")


# The first real step's peak above the forecast by more than this: the forecast was too low here
FIRST_STEP_SLACK = 0.05


def first_step_check(forecast: MemoryForecast, kept: int, allocated_before: int, tokens: int,
                     peak_bytes: int) -> dict:
    """The forecast set against the first training step that ran: `allocated_before` the bytes
    allocated when the forecast was made (weights, adapters), `tokens` the step's largest batch,
    `peak_bytes` its measured peak. The line is drawn through probes shorter than the batch; where
    the peak per token grows with the length (one long sequence), this is where it shows."""
    predicted = allocated_before + forecast.device_bytes(tokens, kept)
    return {"tokens": tokens, "forecast_gib": round(predicted / 2**30, 3), "peak_gib": round(peak_bytes / 2**30, 3),
            "peak_over_forecast": round(peak_bytes / predicted, 4) if predicted > 0 else None}


def first_step_warning(check: dict, largest: int, where: str) -> str | None:
    """A message when the first step peaked above its forecast by more than FIRST_STEP_SLACK."""
    ratio = check["peak_over_forecast"]
    if ratio is None or ratio <= 1 + FIRST_STEP_SLACK:
        return None
    return (f"hasten: memory preflight: the first step ({check['tokens']:,} tokens) peaked at {check['peak_gib']:.1f} "
            f"GiB on {where}, {100 * (ratio - 1):.0f}% above the forecast of {check['forecast_gib']:.1f} GiB: the "
            f"largest batch it stated (about {largest:,} tokens) is too high for this model; leave that much headroom "
            "below it")


def probe_sizes(max_tokens: int) -> list[int]:
    """The batch itself when small; else a quarter and a half of it. Why that close: the line is
    extrapolated from the larger probe to the batch, and what is not linear in the tokens shows
    only near it. At 5a4a550 (Llama-8B + LoRA under full checkpointing with offload, one H200) a
    line through 16,384 and 32,768 gave 99 KiB a token against 138 measured at 131,072 and 154 at
    393,216: cuDNN's attention backward workspace was sized on a power-of-two token bucket (and in
    one call). Since bfa7b90 probes at 131,072 and 262,144 give 93 KiB a token and forecast 393,216's
    peak within 0.2%. Half the batch costs about a quarter of a step's attention."""
    if max_tokens <= PROBE_EXACT:
        return [max_tokens]
    return [max(PROBE_EXACT // 2, max_tokens // 4), max(PROBE_EXACT, max_tokens // 2)]


def optimizer_state_bytes(params: Sequence[torch.Tensor]) -> int:
    """AdamW's exp_avg and exp_avg_sq, one of each per trainable parameter in its dtype."""
    return 2 * sum(p.numel() * p.element_size() for p in params)


class CudaMemory:
    """The device's allocation counters around one probe step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def begin(self) -> int:
        # garbage in reference cycles (an earlier model, loading temporaries) freed by a collection
        # during the probe would lower its peak below the allocation it started from; collect first
        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def release(self) -> None:
        torch.cuda.empty_cache()


def measure(step: Callable[[int], None], sizes: Sequence[int], memory,
            offloaded: Callable[[], int] | None = None) -> tuple[list[Probe], int | None]:
    """Runs `step(tokens)` (forward and backward of a probe batch) at each size; returns the probes
    and the smallest size that ran out of memory, below which a quarter and a half of it are probed
    instead. `memory`: begin() -> bytes allocated, peak() -> the peak since, release()."""
    probes: list[Probe] = []
    failed_at = None
    queue = list(sizes)
    while queue:
        tokens = queue.pop(0)
        start = memory.begin()
        sent = offloaded() if offloaded is not None else 0
        try:
            step(tokens)
            peak = memory.peak() - start
        except torch.OutOfMemoryError:
            failed_at = tokens if failed_at is None else min(failed_at, tokens)
            memory.release()
            smaller = tokens // 4
            if smaller >= 256 and not any(p.tokens <= smaller for p in probes):
                queue = [smaller, tokens // 2] + [t for t in queue if t < smaller]
            else:
                queue = [t for t in queue if t < tokens]
            continue
        host = (offloaded() - sent) if offloaded is not None else 0
        probes.append(Probe(tokens, peak, host))
    return probes, failed_at


def forecast(probes: Sequence[Probe], optimizer_bytes: int, device: torch.device,
             with_offload: bool, host_layers: int = 0, host_limit: int | None = None) -> MemoryForecast:
    """`host_layers`: the decoder layers that sent their checkpoints to the host in the probes
    (training.checkpoint.offload: all under activations: full); 0 forecasts without a split.
    `host_limit`: the offload guard's own limit (OffloadManager.host_limit_bytes), taken before the
    probes ran. Why not MemAvailable now: the host pool keeps the probes' page-locked buffers for
    reuse, which MemAvailable no longer counts; after probes at 131,072 and 262,144 tokens of a
    Llama-8B shape that is 60 GiB, and the limit read then was 46.7 GiB instead of about 100 (the
    statement fell from about 595K tokens to 452K; 1abb0f8). None: HOST_FRACTION of MemAvailable
    now, shared among the host's processes (a caller without a guard)."""
    per_token, constant = fit_line([(p.tokens, float(p.device_bytes)) for p in probes])
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    limit = int((free + cached) * DEVICE_MARGIN)
    host_per_token = 0.0
    if not with_offload:
        host_limit = None
    else:
        host_per_token, _ = fit_line([(p.tokens, float(p.host_bytes)) for p in probes])
        if host_limit is None:
            host_limit = host_share_bytes(HOST_FRACTION)
    return MemoryForecast(optimizer_bytes, max(per_token, 0.0), max(constant, 0.0), limit, max(host_per_token, 0.0),
                          host_limit, host_layers if with_offload else 0)

"""Chooses keep / offload / recompute per decoder layer from what one step measured.

Inputs, per layer i (from a calibration step in which every layer but the last was offloaded):
  bytes_i    what layer i saves for backward
  forward_i  its forward time (its backward is taken as twice that)
and the link's bandwidth each way. The cost model:

  offload i   the copy back of bytes_i starts when layer i+1's backward starts (double buffer)
              or when layer i's own starts (one buffer); what does not fit in that window is
              exposed: max(0, bytes_i / bandwidth - window_i), window_i = 2 * forward_{i+1} with
              a double buffer, 0 with one (and 0 for the last layer, whose backward comes first)
  recompute i costs forward_i, keeps about nothing of the layer
  keep i      costs nothing, keeps bytes_i

Without a memory budget the plan takes every choice that costs nothing (offloads whose copies
hide). With a budget it then takes, cheapest time per byte first, offloads or recomputes until
the predicted peak fits; if even recomputing everything left does not fit it says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# An offload whose copy fills its window to this fraction counts as hidden: copies share the link
# with the other direction and with the allocator's own traffic.
HIDE_MARGIN = 0.85


@dataclass
class LayerMeasure:
    bytes: int
    forward_s: float


@dataclass
class Plan:
    choices: list[str]
    predicted_peak_bytes: int | None
    predicted_extra_s: float
    budget_met: bool = True
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        counts = {c: self.choices.count(c) for c in ("keep", "offload", "recompute")}
        return ", ".join(f"{n} {c}" for c, n in counts.items() if n) + f" of {len(self.choices)} layers"


def exposed_copy_s(layers: Sequence[LayerMeasure], index: int, bandwidth_bps: float, double_buffer: bool) -> float:
    copy_s = layers[index].bytes / bandwidth_bps
    if not double_buffer or index + 1 >= len(layers):
        return copy_s
    window_s = 2.0 * layers[index + 1].forward_s * HIDE_MARGIN
    return max(0.0, copy_s - window_s)


def plan_layers(layers: Sequence[LayerMeasure], bandwidth_bps: float, *, double_buffer: bool,
                calibration_choices: Sequence[str], calibration_peak_bytes: int | None = None,
                budget_bytes: int | None = None) -> Plan:
    """`calibration_choices` is what the measured step ran (offload or keep per layer), so the peak
    of any other plan can be predicted from `calibration_peak_bytes`."""
    n = len(layers)
    if bandwidth_bps <= 0:
        raise ValueError("the link bandwidth must be positive")
    measured = [m.bytes for m, c in zip(layers, calibration_choices, strict=True) if c == "offload"]
    typical = sum(measured) // len(measured) if measured else 0
    sizes = [m.bytes if c == "offload" else typical for m, c in zip(layers, calibration_choices, strict=True)]

    choices = ["keep"] * n
    extra_s = 0.0
    for i in range(n):
        if sizes[i] and exposed_copy_s(layers, i, bandwidth_bps, double_buffer) == 0.0:
            choices[i] = "offload"

    def predicted_peak() -> int | None:
        if calibration_peak_bytes is None:
            return None
        peak = calibration_peak_bytes
        for i in range(n):  # relative to the calibration step, where "offload" layers held ~nothing
            held_now = sizes[i] if choices[i] == "keep" else 0
            held_then = sizes[i] if calibration_choices[i] == "keep" else 0
            peak += held_now - held_then
        return peak

    plan = Plan(choices, predicted_peak(), extra_s)
    if budget_bytes is None or plan.predicted_peak_bytes is None:
        return plan

    def cheapest(i: int) -> tuple[float, str]:
        offload_s = exposed_copy_s(layers, i, bandwidth_bps, double_buffer)
        return (offload_s, "offload") if offload_s <= layers[i].forward_s else (layers[i].forward_s, "recompute")

    candidates = sorted((cheapest(i)[0] / max(sizes[i], 1), i) for i in range(n) if choices[i] == "keep")
    for _, i in candidates:
        if predicted_peak() <= budget_bytes:
            break
        cost, choice = cheapest(i)
        choices[i] = choice
        extra_s += cost
    plan = Plan(choices, predicted_peak(), extra_s)
    if plan.predicted_peak_bytes > budget_bytes:
        plan.budget_met = False
        plan.notes.append(f"the budget of {budget_bytes / 2**30:.1f} GiB cannot be met by activations alone: the "
                          f"lowest reachable peak is about {plan.predicted_peak_bytes / 2**30:.1f} GiB (weights, "
                          "optimizer state and the loss take the rest)")
    return plan

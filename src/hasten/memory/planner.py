"""Chooses keep / offload / recompute per decoder layer by simulating a step's copy timeline.

Measured once (hasten.memory.offload.OffloadManager, from a calibration step):
  bytes_i     what layer i saves for backward
  forward_i   layer i's forward time; its backward is taken as twice that
  head_s      from the end of the last layer's forward to the start of its backward (LM head,
              loss, and their backward): the step's memory peak sits at its start
  bandwidth   of the pinned link, each way (the H200 has separate copy engines per direction)

The simulation (`simulate`) follows what the engine does:
  forward   layer i's offload copy starts when its forward ends, after the copies queued before
            it (one device-to-host stream). A layer frees device memory only once its copy is
            done: a copy still running at the peak saves nothing there.
  backward  when layer i's backward starts, layer i is fetched if it is not already, and the next
            offloaded layers below it are prefetched while the bytes restored but not yet used
            stay within two layers' worth (the double buffer); one host-to-device stream. A
            layer whose copy is not back when its backward should start stalls the step.
  recompute adds forward_i to layer i's backward and saves its bytes without any copy.

Without a memory budget the plan offloads, lowest layers first (their copies have the most time),
every layer that lowers the peak while the simulated stall stays under STALL_TOLERANCE of the
step. With a budget it then buys the remaining bytes cheapest time per byte first (offload or
recompute) until the predicted peak fits, and says so when it cannot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

STALL_TOLERANCE = 0.02  # of the simulated step time: what "hidden" allows


@dataclass
class LayerMeasure:
    bytes: int
    forward_s: float


@dataclass
class Timeline:
    step_s: float
    stall_s: float
    recompute_s: float
    saved_at_peak: int  # bytes that offload or recompute removed from the device at the peak
    late_copies: list[int] = field(default_factory=list)  # offloaded layers still copying at the peak

    @property
    def extra_s(self) -> float:
        return self.stall_s + self.recompute_s


@dataclass
class Plan:
    choices: list[str]
    predicted_peak_bytes: int | None
    predicted_extra_s: float
    budget_met: bool = True
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        counts = {c: self.choices.count(c) for c in ("keep", "offload", "recompute", "recompute_offload")}
        return ", ".join(f"{n} {c}" for c, n in counts.items() if n) + f" of {len(self.choices)} layers"


def simulate(layers: Sequence[LayerMeasure], choices: Sequence[str], bandwidth_bps: float, head_s: float,
             double_buffer: bool = True) -> Timeline:
    n = len(layers)
    end_forward, t = [], 0.0
    for m in layers:
        t += m.forward_s
        end_forward.append(t)
    peak_at = t  # the peak: all layers' activations alive, the loss about to run

    stored_at: dict[int, float] = {}
    d2h_free = 0.0
    for i in range(n):
        if choices[i] == "offload":
            start = max(d2h_free, end_forward[i])
            d2h_free = stored_at[i] = start + layers[i].bytes / bandwidth_bps
    late = [i for i, done in stored_at.items() if done > peak_at]
    saved = sum(layers[i].bytes for i in stored_at if i not in late)
    saved += sum(layers[i].bytes for i in range(n) if choices[i] == "recompute")

    offloaded_below = sorted(stored_at, reverse=True)
    buffer_bytes = 2 * max((layers[i].bytes for i in stored_at), default=0) if double_buffer else 0
    restored_at: dict[int, float] = {}
    held: dict[int, int] = {}  # restored, not yet used up
    h2d_free = 0.0
    tau = peak_at + head_s
    stall = recompute = 0.0

    def issue(k: int, now: float) -> None:
        nonlocal h2d_free
        start = max(h2d_free, now, stored_at[k])
        h2d_free = restored_at[k] = start + layers[k].bytes / bandwidth_bps
        held[k] = layers[k].bytes

    for i in range(n - 1, -1, -1):
        if choices[i] == "offload" and i not in restored_at:
            issue(i, tau)
        if double_buffer:
            for k in offloaded_below:
                if k >= i or k in restored_at:
                    continue
                if sum(held.values()) + layers[k].bytes > buffer_bytes:
                    break
                issue(k, tau)
        if i in restored_at and restored_at[i] > tau:
            stall += restored_at[i] - tau
            tau = restored_at[i]
        work = 2.0 * layers[i].forward_s
        if choices[i] == "recompute":
            work += layers[i].forward_s
            recompute += layers[i].forward_s
        tau += work
        held.pop(i, None)
    return Timeline(step_s=tau, stall_s=stall, recompute_s=recompute, saved_at_peak=saved, late_copies=late)


def plan_layers(layers: Sequence[LayerMeasure], bandwidth_bps: float, *, head_s: float, double_buffer: bool,
                keep_all_peak_bytes: int | None = None, budget_bytes: int | None = None,
                may_recompute: bool = True) -> Plan:
    """`keep_all_peak_bytes`: the peak with every layer kept (estimated by the caller from its
    calibration step); without it no peak is predicted and a budget cannot be planned for.
    `may_recompute` false: the budget is met by offload alone (the layers are checkpointed
    already, and `bytes` is what their checkpoints keep)."""
    n = len(layers)
    if bandwidth_bps <= 0:
        raise ValueError("the link bandwidth must be positive")
    choices = ["keep"] * n
    base = simulate(layers, choices, bandwidth_bps, head_s, double_buffer)

    def acceptable(timeline: Timeline) -> bool:
        return timeline.stall_s <= STALL_TOLERANCE * base.step_s and not timeline.late_copies

    current = base
    for i in range(n):
        if layers[i].bytes == 0:
            continue
        choices[i] = "offload"
        trial = simulate(layers, choices, bandwidth_bps, head_s, double_buffer)
        if acceptable(trial):
            current = trial
        else:
            choices[i] = "keep"

    def peak(timeline: Timeline) -> int | None:
        return None if keep_all_peak_bytes is None else keep_all_peak_bytes - timeline.saved_at_peak

    notes = []
    if budget_bytes is not None and keep_all_peak_bytes is not None:
        while peak(current) > budget_bytes:
            best = None  # (extra seconds per byte saved, layer, choice, timeline)
            for i in range(n):
                if choices[i] != "keep" or layers[i].bytes == 0:
                    continue
                for choice in ("offload", "recompute") if may_recompute else ("offload",):
                    trial_choices = list(choices)
                    trial_choices[i] = choice
                    trial = simulate(layers, trial_choices, bandwidth_bps, head_s, double_buffer)
                    gained = trial.saved_at_peak - current.saved_at_peak
                    if gained <= 0:
                        continue
                    cost = (trial.extra_s - current.extra_s) / gained
                    if best is None or cost < best[0]:
                        best = (cost, i, choice, trial)
            if best is None:
                break
            _, i, choice, current = best
            choices[i] = choice
    plan = Plan(choices, peak(current), current.extra_s, notes=notes)
    if budget_bytes is not None:
        if keep_all_peak_bytes is None:
            plan.budget_met = False
            notes.append("no peak was measured (CPU), so the memory budget could not be planned for")
        elif plan.predicted_peak_bytes > budget_bytes:
            plan.budget_met = False
            notes.append(f"the budget of {budget_bytes / 2**30:.1f} GiB cannot be met by activations alone: the "
                         f"lowest reachable peak is about {plan.predicted_peak_bytes / 2**30:.1f} GiB (weights, "
                         "optimizer state and the loss take the rest)")
    return plan

"""The offload planner's timeline simulation and choices (hasten.memory.planner)."""

import pytest

from hasten.memory.planner import LayerMeasure, plan_layers, simulate

GB = 1e9
BW = 50 * GB  # bytes per second, each way


def _layers(n, gb_each, forward_ms):
    return [LayerMeasure(int(gb_each * GB), forward_ms / 1000) for _ in range(n)]


def test_keeping_everything_costs_nothing_and_saves_nothing():
    t = simulate(_layers(4, 1.0, 10.0), ["keep"] * 4, BW, head_s=0.02)
    assert t.stall_s == 0 and t.recompute_s == 0 and t.saved_at_peak == 0
    assert t.step_s == pytest.approx(0.04 + 0.02 + 0.08)  # forward, head, backward = 2 x forward


def test_a_copy_still_running_at_the_peak_saves_nothing_there():
    # 1 GB takes 20 ms; the last layer's forward ends 10 ms after layer 2's
    t = simulate(_layers(4, 1.0, 10.0), ["keep", "keep", "offload", "keep"], BW, head_s=0.02)
    assert t.late_copies == [2] and t.saved_at_peak == 0
    early = simulate(_layers(4, 1.0, 10.0), ["offload", "keep", "keep", "keep"], BW, head_s=0.02)
    assert early.late_copies == [] and early.saved_at_peak == int(GB)


def test_one_buffer_stalls_where_two_hide():
    layers = _layers(6, 0.5, 10.0)  # 10 ms copies, 20 ms backward per layer
    choices = ["offload"] * 3 + ["keep"] * 3
    assert simulate(layers, choices, BW, head_s=0.02, double_buffer=True).stall_s == pytest.approx(0.0)
    assert simulate(layers, choices, BW, head_s=0.02, double_buffer=False).stall_s == pytest.approx(0.03)


def test_recompute_costs_a_forward_and_saves_its_bytes():
    t = simulate(_layers(3, 1.0, 10.0), ["recompute", "keep", "keep"], BW, head_s=0.0)
    assert t.recompute_s == pytest.approx(0.01) and t.saved_at_peak == int(GB)


def test_without_a_budget_the_plan_offloads_what_hides_and_frees_by_the_peak():
    layers = _layers(8, 0.5, 10.0)  # 10 ms per copy: a copy per layer of forward fits
    plan = plan_layers(layers, BW, head_s=0.02, double_buffer=True, keep_all_peak_bytes=int(20 * GB))
    offloaded = [i for i, c in enumerate(plan.choices) if c == "offload"]
    assert offloaded and offloaded[0] == 0 and plan.choices[-1] == "keep"  # the last copy cannot be done in time
    assert plan.predicted_extra_s <= 0.02 * simulate(layers, ["keep"] * 8, BW, 0.02).step_s
    assert plan.predicted_peak_bytes == int(20 * GB) - len(offloaded) * int(0.5 * GB)


def test_copies_too_slow_for_the_link_are_not_offloaded():
    layers = _layers(4, 4.0, 10.0)  # 80 ms copies, 40 ms of forward in all
    plan = plan_layers(layers, BW, head_s=0.02, double_buffer=True, keep_all_peak_bytes=int(30 * GB))
    assert plan.choices.count("offload") <= 1


def test_a_budget_buys_the_cheapest_bytes_first():
    layers = _layers(4, 4.0, 10.0)
    plan = plan_layers(layers, BW, head_s=0.02, double_buffer=True, keep_all_peak_bytes=int(30 * GB),
                       budget_bytes=int(20 * GB))
    assert plan.budget_met and plan.predicted_peak_bytes <= 20 * GB
    assert "recompute" in plan.choices  # 10 ms of recompute beats a 60 ms stall


def test_an_unreachable_budget_is_reported():
    plan = plan_layers(_layers(2, 1.0, 10.0), BW, head_s=0.02, double_buffer=True,
                       keep_all_peak_bytes=int(10 * GB), budget_bytes=int(1 * GB))
    assert not plan.budget_met and "cannot be met" in plan.notes[0]
    assert "keep" not in plan.choices

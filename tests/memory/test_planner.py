"""The offload planner's choices under its cost model (hasten.memory.planner)."""

import pytest

from hasten.memory.planner import HIDE_MARGIN, LayerMeasure, exposed_copy_s, plan_layers

GB = 1e9


def _layers(n, gb_each, forward_ms):
    return [LayerMeasure(int(gb_each * GB), forward_ms / 1000) for _ in range(n)]


def test_copies_that_fit_the_next_layers_backward_are_hidden():
    layers = _layers(4, 0.5, 10.0)  # 10 ms copy at 50 GB/s, window 2 x 10 ms x margin
    assert exposed_copy_s(layers, 0, 50 * GB, double_buffer=True) == 0.0
    assert exposed_copy_s(layers, 3, 50 * GB, double_buffer=True) == pytest.approx(0.01)  # the last: no window
    assert exposed_copy_s(layers, 0, 50 * GB, double_buffer=False) == pytest.approx(0.01)


def test_without_a_budget_only_free_offloads_are_taken():
    calibration = ["offload"] * 3 + ["keep"]
    plan = plan_layers(_layers(4, 0.5, 10.0), 50 * GB, double_buffer=True, calibration_choices=calibration,
                       calibration_peak_bytes=int(10 * GB))
    assert plan.choices == ["offload", "offload", "offload", "keep"] and plan.predicted_extra_s == 0.0
    assert plan.predicted_peak_bytes == int(10 * GB)  # same as the calibration step
    slow = plan_layers(_layers(4, 2.0, 10.0), 50 * GB, double_buffer=True, calibration_choices=calibration,
                       calibration_peak_bytes=int(10 * GB))
    assert slow.choices == ["keep"] * 4  # 40 ms copies cannot hide in 17 ms windows
    assert slow.predicted_peak_bytes == int(16 * GB)  # three layers of 2 GB now stay


def test_a_budget_buys_the_cheapest_bytes_first():
    layers = _layers(4, 2.0, 10.0)  # offload exposes 40 - 17 = 23 ms > recompute 10 ms
    calibration = ["offload"] * 3 + ["keep"]
    plan = plan_layers(layers, 50 * GB, double_buffer=True, calibration_choices=calibration,
                       calibration_peak_bytes=int(10 * GB), budget_bytes=int(13 * GB))
    assert plan.budget_met and plan.choices.count("recompute") == 2 and plan.choices.count("keep") == 2
    assert plan.predicted_extra_s == pytest.approx(0.02)
    assert plan.predicted_peak_bytes <= 13 * GB


def test_an_unreachable_budget_is_reported():
    plan = plan_layers(_layers(2, 1.0, 10.0), 50 * GB, double_buffer=True, calibration_choices=["offload", "keep"],
                       calibration_peak_bytes=int(10 * GB), budget_bytes=int(1 * GB))
    assert not plan.budget_met and "cannot be met" in plan.notes[0]
    assert "keep" not in plan.choices


def test_margin_is_applied():
    bytes_that_just_fit = int(2 * 0.010 * HIDE_MARGIN * 50 * GB)
    layers = [LayerMeasure(bytes_that_just_fit, 0.010), LayerMeasure(1, 0.010)]
    assert exposed_copy_s(layers, 0, 50 * GB, double_buffer=True) == pytest.approx(0.0, abs=1e-9)

"""HostLeadMeter tells a host-bound loop from a GPU-bound one."""

import time

import torch

from hasten.training.metrics import HostLeadMeter


def _cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def _window(meter: HostLeadMeter, steps: int, gpu_ms: float, host_ms: float) -> float:
    """`steps` steps that each queue about gpu_ms of GPU work, then spend host_ms on the host."""
    cycles_per_ms = _cycles_per_ms()
    torch.cuda.synchronize()
    meter.start_window()
    for _ in range(steps):
        torch.cuda._sleep(int(gpu_ms * cycles_per_ms))
        meter.mark(step_start=True)
        time.sleep(host_ms / 1e3)
        torch.cuda._sleep(int(gpu_ms * cycles_per_ms / 10))
        meter.mark()
    torch.cuda.synchronize()
    return meter.margin_ms()


def test_host_bound_steps_have_no_lead_and_gpu_bound_steps_do():
    meter = HostLeadMeter(torch.device("cuda"))
    # The host sleeps 20 ms after queueing 2 ms of GPU work: the GPU drains and waits every step.
    assert _window(meter, steps=5, gpu_ms=2, host_ms=20) < 1.5
    # 30 ms of GPU work per step and 1 ms of host: the host runs ahead, the queue grows each step.
    assert _window(meter, steps=5, gpu_ms=30, host_ms=1) > 10


def test_no_marks_no_margin():
    meter = HostLeadMeter(torch.device("cuda"))
    assert meter.margin_ms() is None
    meter.start_window()
    assert meter.margin_ms() is None
    assert HostLeadMeter(torch.device("cpu")).margin_ms() is None

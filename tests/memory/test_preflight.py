"""The memory preflight's arithmetic and probing (CPU, with a stand-in for the device's counters):
the line through the probes, the forecast against the free memory, the refusal naming the largest
batch that fits, a probe that runs out of memory, and the host's share under offload."""

import pytest
import torch

from hasten.memory.preflight import MemoryForecast, Probe, fit_line, measure, optimizer_state_bytes, probe_sizes

GIB = 2**30


def test_the_line_through_the_probes():
    assert fit_line([(1000, 3e6 + 1e6), (3000, 9e6 + 1e6)]) == pytest.approx((3000.0, 1e6))
    assert fit_line([(2048, 4096.0)]) == (2.0, 0.0)  # one probe: through the origin
    with pytest.raises(ValueError):
        fit_line([])


def test_small_batches_are_probed_at_their_size_large_ones_at_a_quarter_and_a_half():
    assert probe_sizes(4096) == [4096]
    assert probe_sizes(393216) == [98304, 196608]
    assert probe_sizes(16384) == [4096, 8192]
    assert probe_sizes(20000) == [5000, 10000]


def test_a_batch_that_fits_passes_and_one_that_does_not_names_the_largest():
    forecast = MemoryForecast(optimizer_bytes=1 * GIB, per_token=2**20, constant=2 * GIB, device_limit=100 * GIB)
    assert forecast.refusal(90_000, "an H200") is None
    message = forecast.refusal(200_000, "an H200")
    assert message.startswith("training.max_tokens=200,000 needs about 198.3 GiB on an H200")
    assert f"about {97 * 1024:,} tokens" in message and "training.memory_preflight: false" in message
    assert forecast.largest_tokens() == 97 * 1024


def test_the_host_limits_an_offloaded_run():
    forecast = MemoryForecast(optimizer_bytes=0, per_token=1024, constant=0, device_limit=100 * GIB,
                              host_per_token=2**20, host_limit=50 * GIB)
    message = forecast.refusal(60 * 1024, "an H200")
    assert "GiB of host memory for the offloaded activations" in message
    assert forecast.largest_tokens() == 50 * 1024


class _Memory:
    """Allocations of a step that costs `per_token` bytes a token over `constant`, running out past `limit`."""

    def __init__(self, per_token, constant, limit):
        self.per_token, self.constant, self.limit = per_token, constant, limit
        self.allocated, self.high = 5 * GIB, 0
        self.released = 0

    def begin(self):
        self.high = self.allocated
        return self.allocated

    def step(self, tokens):
        need = self.per_token * tokens + self.constant
        if need > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory")
        self.high = self.allocated + need

    def peak(self):
        return self.high

    def release(self):
        self.released += 1


def test_probes_measure_the_step_and_back_off_when_one_runs_out():
    memory = _Memory(per_token=4096, constant=GIB, limit=40 * GIB)
    sent = [0]

    def step(tokens):
        memory.step(tokens)
        sent[0] += 512 * tokens

    probes, failed = measure(step, [8192], memory, offloaded=lambda: sent[0])
    assert failed is None and probes == [Probe(8192, 4096 * 8192 + GIB, 512 * 8192)]
    probes, failed = measure(memory.step, [16_000_000], memory)  # 61 GiB: out of memory
    assert failed == 16_000_000 and memory.released == 1
    assert [p.tokens for p in probes] == [4_000_000, 8_000_000]  # a quarter and a half of it
    per_token, constant = fit_line([(p.tokens, p.device_bytes) for p in probes])
    assert per_token == pytest.approx(4096) and constant == pytest.approx(GIB)


def test_adamw_state_is_two_tensors_per_trainable_parameter():
    params = [torch.zeros(10, 4), torch.zeros(3, dtype=torch.bfloat16)]
    assert optimizer_state_bytes(params) == 2 * (40 * 4 + 3 * 2)


def test_a_host_too_small_for_every_layer_keeps_the_last_ones_on_the_device():
    """Four offloaded layers of 1 MiB a token each (host 4 MiB a token), a host of 40 GiB and a
    device of 100 GiB with 2 MiB a token of its own: 12,288 tokens need 48 GiB of host, so the last
    layer keeps its share on the device (host 36 GiB, device 36 GiB)."""
    forecast = MemoryForecast(optimizer_bytes=0, per_token=2 * 2**20, constant=0, device_limit=100 * GIB,
                              host_per_token=4 * 2**20, host_limit=40 * GIB, host_layers=4)
    assert forecast.host_layers_kept(10 * 1024) == 0  # 40 GiB: the host holds all four
    assert forecast.host_layers_kept(12 * 1024) == 1
    assert forecast.device_bytes(12 * 1024, 1) == 36 * GIB and forecast.host_bytes(12 * 1024, 1) == 36 * GIB
    assert forecast.refusal(12 * 1024, "an H200") is None
    # whole layers move: 20,480 tokens fit with two kept (host 40, device 80 GiB) or three (host 20,
    # device 100); one token more needs three kept for the host and then overflows the device
    assert forecast.largest_tokens() == 20 * 1024
    assert forecast.host_layers_kept(20 * 1024) == 2 and forecast.host_layers_kept(20 * 1024 + 1) is None
    message = forecast.refusal(30 * 1024, "an H200")
    assert "keeping 3 of the 4 offloaded layers' checkpoints there because the host cannot hold them" in message
    assert f"about {20 * 1024:,} tokens" in message and "host memory" not in message


def test_without_the_layer_count_the_host_bound_stays_as_it_was():
    forecast = MemoryForecast(optimizer_bytes=0, per_token=2 * 2**20, constant=0, device_limit=100 * GIB,
                              host_per_token=4 * 2**20, host_limit=40 * GIB)
    assert forecast.host_layers_kept(12 * 1024) is None and forecast.largest_tokens() == 10 * 1024


def test_the_first_step_is_set_against_its_forecast_and_a_step_past_it_warns():
    from hasten.memory.preflight import first_step_check, first_step_warning

    forecast = MemoryForecast(optimizer_bytes=1 * GIB, per_token=2**20, constant=2 * GIB, device_limit=100 * GIB)
    # 10 GiB allocated before; 8,192 tokens forecast 1 + 8 + 2 = 11 GiB more: 21 GiB
    within = first_step_check(forecast, 0, 10 * GIB, 8192, int(21.5 * GIB))
    assert within == {"tokens": 8192, "forecast_gib": 21.0, "peak_gib": 21.5, "peak_over_forecast": round(21.5 / 21, 4)}
    assert first_step_warning(within, forecast.largest_tokens(), "an H200") is None  # 2.4%: within the slack
    past = first_step_check(forecast, 0, 10 * GIB, 8192, 25 * GIB)
    message = first_step_warning(past, forecast.largest_tokens(), "an H200")
    assert message is not None and "19% above the forecast of 21.0 GiB" in message
    assert f"about {forecast.largest_tokens():,} tokens" in message and "too high" in message

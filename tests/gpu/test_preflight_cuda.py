"""The memory preflight tells the truth on the GPU: the line through two probe steps predicts the
peak of a step four times longer than the larger probe within 10%, with and without full
checkpointing with the inputs on the host (whose host bytes it predicts too); and the split, when the
host is made too small for every layer's input: the last layers keep theirs on the GPU, and the
forecast of both sides holds for the step that runs that way."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hasten
from hasten.config import Config
from hasten.memory import preflight
from hasten.packing import move_batch


def _model_and_step(checkpoint):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).train()
    handle = hasten.accelerate(model, Config.from_dict({"training": {"checkpoint": checkpoint}}))
    gen = torch.Generator().manual_seed(0)

    def step(tokens):
        ids = torch.randint(0, 4096, (tokens,), generator=gen).tolist()
        batch = move_batch(hasten.PackingCollator(max_tokens=tokens)([{"input_ids": ids}]), "cuda")
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)

    return model, handle, step


def test_a_host_too_small_keeps_the_last_layers_inputs_on_the_gpu():
    model, handle, step = _model_and_step({"activations": "full", "offload": "all"})
    manager = handle.offload
    engine = manager.offload.engine
    step(2048)
    memory = preflight.CudaMemory(torch.device("cuda"))
    probes, _ = preflight.measure(step, [4096, 8192], memory, lambda: engine.stats().bytes_offloaded)
    forecast = preflight.forecast(probes, 0, torch.device("cuda"), with_offload=True,
                                  host_layers=manager.host_layers)
    assert manager.host_layers == 3  # every layer but the last
    # a host that holds two of the three layers' inputs at 32,768 tokens
    forecast.host_limit = int(forecast.host_bytes(32768) * 2 / 3) + 1
    kept = forecast.host_layers_kept(32768)
    assert kept == 1 and forecast.largest_tokens() >= 32768
    manager.keep_on_device(kept)
    (measured,), _ = preflight.measure(step, [32768], memory, lambda: engine.stats().bytes_offloaded)
    print(f"split: device predicted {forecast.device_bytes(32768, kept) / 2**20:.0f} MiB, measured "
          f"{measured.device_bytes / 2**20:.0f}; host predicted {forecast.host_bytes(32768, kept) / 2**20:.0f} MiB, "
          f"measured {measured.host_bytes / 2**20:.0f}")
    assert abs(forecast.host_bytes(32768, kept) - measured.host_bytes) <= 0.1 * measured.host_bytes
    assert measured.host_bytes <= forecast.host_limit
    assert abs(forecast.device_bytes(32768, kept) - measured.device_bytes) <= 0.1 * measured.device_bytes
    handle.undo()


@pytest.mark.parametrize("checkpoint", [{}, {"activations": "full", "offload": "all"}], ids=["kept", "offloaded"])
def test_the_forecast_predicts_a_longer_step(checkpoint):
    model, handle, step = _model_and_step(checkpoint)
    engine = handle.offload.offload.engine if handle.offload is not None else None
    offloaded = (lambda: engine.stats().bytes_offloaded) if engine is not None else None
    step(2048)  # warm-up: kernels, pools
    memory = preflight.CudaMemory(torch.device("cuda"))
    probes, failed = preflight.measure(step, [4096, 8192], memory, offloaded)
    assert failed is None and len(probes) == 2
    forecast = preflight.forecast(probes, 0, torch.device("cuda"), with_offload=engine is not None)
    (measured,), _ = preflight.measure(step, [32768], memory, offloaded)
    predicted = forecast.device_bytes(32768)
    print(f"{checkpoint}: predicted {predicted / 2**20:.0f} MiB, measured {measured.device_bytes / 2**20:.0f} MiB; "
          f"host predicted {forecast.host_bytes(32768) / 2**20:.0f} MiB, measured {measured.host_bytes / 2**20:.0f}")
    assert abs(predicted - measured.device_bytes) <= 0.1 * measured.device_bytes
    if engine is not None:
        assert measured.host_bytes > 0
        assert abs(forecast.host_bytes(32768) - measured.host_bytes) <= 0.1 * measured.host_bytes
    handle.undo()


def test_hasten_train_sets_its_forecast_against_the_first_step(tmp_path):
    """`hasten train`'s preflight on the GPU (its glue in the loop had no GPU test): the first metrics
    row carries the forecast against the first step's measured peak, within the 5% the log allows
    (the refusal's arithmetic is tests/memory/test_preflight.py's)."""
    import json

    from hasten.training import loop

    raw = {"model": {"default_size": "tiny"},
           "training": {"max_tokens": 16384, "max_steps": 2, "logging_steps": 1, "memory_preflight": True,
                        "checkpoint": {"activations": "full"}}}
    loop.train(Config.from_dict(raw), tmp_path / "a", tmp_path / "a" / "logs", progress=False)
    rows = [json.loads(line) for line in (tmp_path / "a" / "logs" / "metrics.jsonl").read_text().splitlines()]
    check = rows[0]["preflight"]
    print(f"\nfirst step against the forecast: {check}")
    assert check["tokens"] <= 16384 and 0 < check["peak_over_forecast"] <= 1.05, check
    assert all("preflight" not in row for row in rows[1:])

"""The memory preflight tells the truth on the GPU: the line through two probe steps predicts the
peak of a step four times longer than the larger probe within 10%, with and without full
checkpointing with the inputs on the host (whose host bytes it predicts too)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hasten
from hasten.config import Config
from hasten.memory import preflight
from hasten.packing import move_batch


@pytest.mark.parametrize("checkpoint", [{}, {"activations": "full", "offload": "all"}], ids=["kept", "offloaded"])
def test_the_forecast_predicts_a_longer_step(checkpoint):
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

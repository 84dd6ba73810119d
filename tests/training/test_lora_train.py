import json

import pytest

from hasten.config import Config, ConfigError
from hasten.training import loop

peft = pytest.importorskip("peft")

LORA = {"model": {"default_size": "tiny"}, "lora": {"enabled": True, "r": 4, "target_modules": "q_proj,v_proj"},
        "training": {"max_tokens": 384, "max_steps": 4, "learning_rate": 0.01, "warmup_steps": 1,
                     "logging_steps": 1, "checkpoint": {"interval_steps": 2}},
        "logging": {"tensorboard": "false"}}


def test_lora_trains_adapters_only_and_resumes_on_the_same_losses(tmp_path, monkeypatch):
    config = Config.from_dict(LORA)
    straight = loop.train(config, tmp_path / "a", tmp_path / "a" / "logs", progress=False)
    assert (straight.model_dir / "adapter_model.safetensors").is_file()
    assert not (straight.model_dir / "model.safetensors").exists()  # only adapters are saved
    assert straight.losses[-1] < straight.losses[0]
    summary = json.loads((tmp_path / "a" / "logs" / "summary.json").read_text())
    # q_proj and v_proj of each layer read one input: a group of two (k_proj has no adapter)
    assert any(item.startswith("grouped LoRA projections (4 layers") for item in summary["hasten_active"]), summary
    # resume from the step-2 checkpoint of the same run: steps 3-4 repeat exactly
    resumed = loop.train(config, tmp_path / "b", tmp_path / "b" / "logs", progress=False,
                         resume=str(tmp_path / "a" / "checkpoints" / "checkpoint-000002"))
    rows = [json.loads(line) for line in (tmp_path / "b" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 4]
    for r, want in zip(rows, straight.losses[2:]):
        assert r["loss"] == pytest.approx(want, abs=1e-6)
    assert resumed.resumed_from is not None and resumed.steps == 4


def test_lora_checks():
    with pytest.raises(ConfigError, match="lora.r"):
        Config.from_dict({"lora": {"enabled": True, "r": 0}})


def test_qlora_trains_nf4_base_with_fused_4bit_lora_layers(tmp_path):
    """lora.quantize: nf4 on the CPU: model.path loads in 4 bits (bitsandbytes), PEFT's 4-bit LoRA
    layers run on hasten's fused path, the adapters train and are saved alone."""
    pytest.importorskip("bitsandbytes")
    from transformers import Qwen3ForCausalLM

    from hasten.data import ByteTokenizer
    from hasten.training.defaults import embedded_model_config

    folder = tmp_path / "model"
    Qwen3ForCausalLM(embedded_model_config("tiny")).save_pretrained(folder)
    ByteTokenizer().save_pretrained(folder)
    settings = {**LORA, "model": {"path": str(folder)}, "training": {**LORA["training"], "dtype": "bfloat16"},
                "lora": {**LORA["lora"], "quantize": "nf4"}}
    result = loop.train(Config.from_dict(settings), tmp_path / "out", tmp_path / "out" / "logs", progress=False)
    assert (result.model_dir / "adapter_model.safetensors").is_file()
    assert not (result.model_dir / "model.safetensors").exists()
    assert result.losses[-1] < result.losses[0]
    summary = json.loads((tmp_path / "out" / "logs" / "summary.json").read_text())
    assert any(item.startswith("fused LoRA projections (") for item in summary["hasten_active"]), summary
    # the 4-bit MLPs are checked in their compute dtype and fused (they were not: "could not be checked")
    assert any(item.startswith("fused kernels (") and "SwiGLU MLP" in item for item in summary["hasten_active"]), \
        summary


def test_qlora_checks():
    with pytest.raises(ConfigError, match="lora.enabled: true"):
        Config.from_dict({"lora": {"quantize": "nf4"}, "model": {"path": "/x"}})
    with pytest.raises(ConfigError, match="model.path"):
        Config.from_dict({"lora": {"enabled": True, "quantize": "nf4"}})

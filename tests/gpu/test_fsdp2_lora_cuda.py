"""LoRA and QLoRA under FSDP2 on the GPU, through `hasten train` under torchrun.

On the GPU the 4-bit base runs bitsandbytes' CUDA dequantization of the packed bytes FSDP2
gathered (stored as bf16 under fsdp2), inside hasten's fused 4-bit LoRA op. With one GPU the run
is a group of one (FSDP2 still gathers each Params4bit into a plain Parameter, the case the
quantization state's lookup is for) against the same run without torchrun's strategy; with two
GPUs, FSDP2 over two ranks against DDP over two."""

import json

import pytest
import torch

from tests.torchrun import hasten_train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _train(tmp_path, name, settings, nproc):
    return hasten_train(settings, tmp_path / name, nproc=nproc, timeout=240)


@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_fsdp2_lora_on_the_gpu_trains_like_the_reference_strategy(tmp_path, quantize):
    pytest.importorskip("peft")
    if quantize == "nf4":
        pytest.importorskip("bitsandbytes")
    from safetensors.torch import load_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hasten.data import ByteTokenizer

    folder = tmp_path / "model"
    torch.manual_seed(0)
    # sizes off block multiples; 4-bit blocks of 64 need in-features divisible by 64
    Qwen3ForCausalLM(Qwen3Config(vocab_size=300, hidden_size=192, intermediate_size=448, num_hidden_layers=3,
                                 num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                                 tie_word_embeddings=False)).save_pretrained(folder)
    ByteTokenizer().save_pretrained(folder)
    nproc = min(2, torch.cuda.device_count())
    settings = {"model": {"path": str(folder)},
                "lora": {"enabled": True, "r": 8, "quantize": quantize,
                         "target_modules": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"},
                "training": {"max_tokens": 1000, "max_steps": 4, "learning_rate": 0.01, "warmup_steps": 1,
                             "logging_steps": 1, "device": "cuda", "dtype": "bfloat16",
                             "checkpoint": {"interval_steps": 2}},
                "logging": {"tensorboard": "false", "gpu_monitor": False}}
    reference = "ddp" if nproc > 1 else "none"
    ref_out, ref_rows, _ = _train(tmp_path, reference, {**settings, "training": {**settings["training"],
                                                                                 "distributed": reference}}, nproc)
    out, rows, err = _train(tmp_path, "fsdp2", {**settings, "training": {**settings["training"],
                                                                         "distributed": "fsdp2"}}, nproc)
    summary = json.loads((out / "logs" / "summary.json").read_text())
    assert summary["distributed"] == "fsdp2" and "fsdp2 keeps" in err
    assert any(item.startswith("fused LoRA projections (") for item in summary["hasten_active"]), summary
    assert not summary["fallbacks"].get("lora_not_fused"), summary["fallback_reasons"]
    # bf16 noise: the same step math, another order of the gradient reduction at most
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref_rows], abs=2e-2)
    assert rows[-1]["loss"] < rows[0]["loss"]
    want, got = (load_file(run / "final" / "adapter_model.safetensors") for run in (ref_out, out))
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape, name
        torch.testing.assert_close(got[name].float(), tensor.float(), atol=5e-3, rtol=5e-2)

"""examples/trl_sft_padding_free.py runs end to end with TRL's SFTTrainer (padding_free) on a tiny
Qwen3 model and a character tokenizer built offline, and hasten's packed attention serves it."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trl_sft_padding_free.py"


def _tiny_model_folder(folder: Path) -> Path:
    from transformers import Qwen3ForCausalLM

    from hasten.training.defaults import embedded_model_config
    from tests.data.test_datasets import build_hf_tokenizer

    tokenizer = build_hf_tokenizer()
    config = embedded_model_config("tiny")
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 130, 128, 129
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_trl_sft_padding_free_example_trains_through_hasten_attention(tmp_path):
    spec = importlib.util.spec_from_file_location("trl_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = _tiny_model_folder(tmp_path / "model")
    history = example.main(["--model", str(model), "--max_steps", "3", "--batch_size", "4",
                            "--max_sample_tokens", "64", "--output_dir", str(tmp_path / "out")])
    steps = [row for row in history if "loss" in row]
    assert len(steps) == 3 and all(math.isfinite(float(row["loss"])) for row in steps)
    assert all("mean_token_accuracy" in row for row in steps)  # TRL's own metrics still work
    # every step's flattened batch went through hasten's varlen attention: on the CPU that path runs
    # one sequence at a time and is counted, on a GPU it is the varlen kernel and nothing is counted
    counted = steps[-1].get("hasten/fallback/attention_per_sequence", 0)
    assert (counted > 0) == (not torch.cuda.is_available())

"""The embedded model sizes build, and the benchmark shape is Qwen3-0.6B's."""

from pathlib import Path

import pytest
import torch
import transformers

from hasten.config import Config
from hasten.training.defaults import embedded_model_config


def test_qwen3_0_6b_shape_has_that_models_parameter_count():
    with torch.device("meta"):  # no memory: only the shapes are built
        model = transformers.Qwen3ForCausalLM(embedded_model_config("qwen3-0.6b"))
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(596e6, rel=0.01)
    assert model.config.vocab_size == 151_936 and model.config.tie_word_embeddings


def test_the_benchmark_config_selects_it():
    config = Config.from_yaml(Path(__file__).parents[2] / "configs" / "qwen3_0.6b_shape.yaml")
    assert config.model.default_size == "qwen3-0.6b" and config.training.max_tokens == 16384


def test_unknown_size_names_the_choices():
    with pytest.raises(ValueError, match="choose one of"):
        embedded_model_config("huge")

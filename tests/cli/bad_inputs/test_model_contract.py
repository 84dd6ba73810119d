"""Bad-input cases of the model contract through `hasten train`: a model whose layers carry state
along the sequence is refused packed batches before the first step, trains padded; a model whose
attention hasten does not compute trains packed on its own attention, and the run says so."""

import json

import pytest

from hasten.data import ByteTokenizer
from tests import model_zoo as zoo
from tests.cli.bad_inputs.harness import TINY, run_train


def _folder(tmp_path, model_type, **override):
    folder = tmp_path / model_type
    zoo.build(zoo.ENTRIES[model_type], vocab_size=300, **override).save_pretrained(folder)
    ByteTokenizer().save_pretrained(folder)
    return folder


def _config(folder, packed=True):
    text = TINY.replace("model:\n  default_size: tiny\n", f"model:\n  path: {folder}\n")
    return text.replace("training:\n", f"training:\n  packed_sequence: {'true' if packed else 'false'}\n")


@pytest.mark.parametrize("model_type,layers", [("granitemoehybrid", "'linear_attention' layers")])
def test_stateful_model_with_packing_is_refused_before_training(capsys, tmp_path, model_type, layers):
    folder = _folder(tmp_path, model_type)
    outcome = run_train(capsys, tmp_path, config=_config(folder))
    outcome.assert_refused("cannot train on packed batches", layers, "carry state along the sequence",
                           "training.packed_sequence: false")
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_stateful_model_trains_padded(capsys, tmp_path):
    folder = _folder(tmp_path, "granitemoehybrid")
    outcome = run_train(capsys, tmp_path, config=_config(folder, packed=False))
    assert outcome.rc == 0, outcome.err
    outcome.assert_nothing_lost()


@pytest.mark.parametrize("model_type,layers", [("qwen3_next", "Qwen3NextGatedDeltaNet"), ("lfm2", "Lfm2ShortConv")])
def test_hybrid_model_in_the_table_trains_packed(capsys, tmp_path, model_type, layers):
    """Issue 19: the table's hybrids train on packed batches, each sample's state from zero."""
    folder = _folder(tmp_path, model_type)
    outcome = run_train(capsys, tmp_path, config=_config(folder))
    assert outcome.rc == 0, outcome.err
    summary = json.loads((tmp_path / "out" / "logs" / "summary.json").read_text())
    assert any(item.startswith("varlen stateful layers") and layers in item for item in summary["hasten_active"])
    assert "packing_refused_stateful_layers" not in summary["fallbacks"]
    outcome.assert_nothing_lost()


# DeepSeek-V3 with value heads (32) wider than its query/key heads (16 + 8): hasten pads only narrower ones
@pytest.mark.parametrize("model_type,override,feature", [("deepseek_v3", dict(v_head_dim=32),
                                                          "wider than the query/key heads")])
def test_model_with_unsupported_attention_trains_packed_on_its_own_attention(capsys, tmp_path, model_type, override,
                                                                             feature):
    folder = _folder(tmp_path, model_type, **override)
    outcome = run_train(capsys, tmp_path, config=_config(folder))
    assert outcome.rc == 0, outcome.err
    assert feature in outcome.err and "block-diagonal mask" in outcome.err  # said once, with the feature
    summary = json.loads((tmp_path / "out" / "logs" / "summary.json").read_text())
    assert summary["fallbacks"].get("attention_feature_not_implemented", 0) >= 1
    assert any(feature in item for item in summary["hasten_inactive"])
    outcome.assert_nothing_lost()


def test_gpt_oss_trains_packed_on_hasten_attention_with_its_sinks(capsys, tmp_path):
    """gpt-oss's attention sinks are computed by hasten's varlen attention (no fallback for them),
    and its experts run on the fused path with the clamped SwiGLU kernel and their biases."""
    folder = _folder(tmp_path, "gpt_oss")
    outcome = run_train(capsys, tmp_path, config=_config(folder))
    assert outcome.rc == 0, outcome.err
    summary = json.loads((tmp_path / "out" / "logs" / "summary.json").read_text())
    assert "attention_feature_not_implemented" not in summary["fallbacks"]
    assert any(item.startswith("varlen attention") for item in summary["hasten_active"])
    assert any(item.startswith("fused MoE experts") and "fused clamped SwiGLU" in item and "biases" in item
               for item in summary["hasten_active"])
    outcome.assert_nothing_lost()


def test_a_vision_language_model_trains_on_text_packed(capsys, tmp_path):
    """Qwen2.5-VL is no causal LM for transformers' auto classes: hasten train loads its image-text
    class and trains it on text, packed, on hasten's attention in its text model."""
    entry = zoo.ENTRIES["qwen2_5_vl"]
    folder = tmp_path / "qwen2_5_vl"  # the byte tokenizer's 300 ids live in the text config
    zoo.build(entry, text_config={**entry.config["text_config"], "vocab_size": 300}).save_pretrained(folder)
    ByteTokenizer().save_pretrained(folder)
    outcome = run_train(capsys, tmp_path, config=_config(folder))
    assert outcome.rc == 0, outcome.err
    summary = json.loads((tmp_path / "out" / "logs" / "summary.json").read_text())
    assert any(item.startswith("varlen attention (packed") for item in summary["hasten_active"]), summary
    outcome.assert_nothing_lost()


def test_a_model_that_reads_its_mask_as_a_tensor_stops_with_exit_2_and_the_fix(capsys, tmp_path):
    """Doge (not in the table) computes a dynamic mask from the attention mask it is given, reading
    it as a tensor; hasten's packed path hands it a band, not a tensor: the first step stops with
    exit 2, naming the fix, and nothing is written as if the run had finished."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import torch
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "doge" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no doge")
    folder = tmp_path / "doge"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("doge", **{**zoo.BASE, "vocab_size": 300})).save_pretrained(folder)
    ByteTokenizer().save_pretrained(folder)
    outcome = run_train(capsys, tmp_path, config=_config(folder))
    outcome.assert_refused("reads its attention mask as a tensor", "training.packed_sequence: false")
    assert not (tmp_path / "out" / "checkpoints").exists()

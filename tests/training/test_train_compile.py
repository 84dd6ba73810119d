"""training.compile: the loop compiles each decoder layer (with activation checkpointing inside the
graph) and trains as the eager loop does; a layer that fails to compile runs eagerly, said once;
combinations that would put host work inside every layer are refused by config validation."""

import contextlib
import json
import logging

import pytest
import torch

import hasten
from hasten.cli.main import main
from hasten.config import Config, ConfigError
from hasten.observability import fallback_counts, fallback_reasons, reset_fallbacks
from hasten.training import loop
from hasten.training.compile import compile_decoder_layers

TINY = {"model": {"default_size": "tiny"},
        "training": {"max_tokens": 256, "max_steps": 2, "learning_rate": 0.003, "warmup_steps": 1,
                     "logging_steps": 1, "checkpoint": {"interval_steps": 2}},
        "logging": {"tensorboard": "false", "gpu_monitor": False}}


def _with(**training) -> dict:
    return {**TINY, "training": {**TINY["training"], **training}}


@contextlib.contextmanager
def _hasten_info_records():
    records, handler, hasten_logger = [], logging.Handler(), logging.getLogger("hasten")
    handler.emit = records.append
    old_level = hasten_logger.level
    hasten_logger.addHandler(handler)
    hasten_logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        hasten_logger.removeHandler(handler)
        hasten_logger.setLevel(old_level)


def test_compiled_layers_train_like_eager(tmp_path):
    eager = loop.train(Config.from_dict(_with()), tmp_path / "eager", tmp_path / "eager_logs", progress=False)
    torch._dynamo.reset()
    with _hasten_info_records() as records:
        compiled = loop.train(Config.from_dict(_with(compile=True, checkpoint={"activations": "full",
                                                                             "interval_steps": 2})),
                              tmp_path / "compiled", tmp_path / "compiled_logs", progress=False)
    assert compiled.steps == eager.steps == 2
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-6, abs=1e-6)
    summary = json.loads((tmp_path / "compiled_logs" / "summary.json").read_text())
    assert summary["compile"] == {"layers": 2, "failure": None}
    assert "torch_compile" not in summary["fallbacks"]
    said = [r.getMessage() for r in records if "training.compile" in r.getMessage()]
    assert len(said) == 1 and "2 decoder layers compile" in said[0], said
    assert json.loads((tmp_path / "eager_logs" / "summary.json").read_text())["compile"] is None


def test_compiled_checkpointed_layers_with_the_off_by_default_kernels_train_like_eager(tmp_path):
    """kernels.fused_qk_norm_rope (the attention's forward rewritten onto hasten::rms_norm_rope) and
    kernels.fused_linear_groups (members run one by one under compile) inside compiled, fully
    checkpointed layers: the eager run's losses, with both in the handle's report."""
    switches = {"kernels": {"fused_qk_norm_rope": True, "fused_linear_groups": True}}
    eager = loop.train(Config.from_dict({**_with(), **switches}), tmp_path / "eager", tmp_path / "eager_logs",
                       progress=False)
    torch._dynamo.reset()
    compiled = loop.train(Config.from_dict({**_with(compile=True, checkpoint={"activations": "full",
                                                                             "interval_steps": 2}), **switches}),
                          tmp_path / "compiled", tmp_path / "compiled_logs", progress=False)
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-6, abs=1e-6)
    summary = json.loads((tmp_path / "compiled_logs" / "summary.json").read_text())
    assert summary["compile"] == {"layers": 2, "failure": None}
    assert "fused_qk_norm_rope" not in summary["fallbacks"], summary["fallbacks"]
    active = " | ".join(summary["hasten_active"])
    assert "head RMSNorm + RoPE" in active and "shared-input projections" in active, active


def test_a_layer_that_fails_to_compile_runs_eagerly_said_once(monkeypatch):
    """HASTEN_VERIFY re-derives the metadata on the host inside every layer: the fullgraph compile
    fails, the layers run eagerly (verification included) and the fallback is said once."""
    from transformers import Qwen3ForCausalLM

    from hasten.training.defaults import embedded_model_config

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(embedded_model_config("tiny"))
    handle = hasten.accelerate(model)
    batch = hasten.PackingCollator(max_tokens=64)([{"input_ids": list(range(3, 3 + n))} for n in (9, 1, 20)])
    want = model(**batch).loss
    reset_fallbacks()
    torch._dynamo.reset()
    compiled = compile_decoder_layers(model)
    monkeypatch.setenv("HASTEN_VERIFY", "1")
    try:
        got = model(**batch).loss
        again = model(**batch).loss
    finally:
        compiled.undo()
        handle.undo()
    assert compiled.failure is not None
    assert fallback_counts()["torch_compile"] == 1 and "runs eagerly" in fallback_reasons()["torch_compile"]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(again, want)
    assert all("forward" not in layer.__dict__ for layer in compiled.layers)  # undone


def test_compiling_lets_dynamo_skip_replaying_side_effects_in_the_checkpoint_recompute_until_undone():
    """transformers 5.25's layers set and reset a context variable around each attention forward (the
    `kernels` package's class wrapper); inside a traced activation checkpoint that side effect made
    every layer fail to compile. While layers are compiled dynamo skips its replay; undo restores."""
    import torch._dynamo.config as dynamo_config
    from transformers import Qwen3ForCausalLM

    from hasten.training.compile import _SKIP_REPLAY
    from hasten.training.defaults import embedded_model_config

    if not hasattr(dynamo_config, _SKIP_REPLAY):
        pytest.skip(f"this torch has no torch._dynamo.config.{_SKIP_REPLAY}")
    before = getattr(dynamo_config, _SKIP_REPLAY)
    compiled = compile_decoder_layers(Qwen3ForCausalLM(embedded_model_config("tiny")))
    assert getattr(dynamo_config, _SKIP_REPLAY) is True
    compiled.undo()
    assert getattr(dynamo_config, _SKIP_REPLAY) == before


@pytest.mark.parametrize("training,attention,named", [
    ({"checkpoint": {"offload": "auto"}}, {}, "training.checkpoint.offload: auto"),
    ({"checkpoint": {"double_buffer": True}}, {}, "training.checkpoint.double_buffer: true"),
    ({"metadata_cache": False}, {}, "training.metadata_cache: false"),
    ({}, {"verify": True}, "attention.verify: true"),
])
def test_compile_with_host_work_in_every_layer_is_refused(training, attention, named):
    with pytest.raises(ConfigError, match="training.compile: true") as raised:
        Config.from_dict({"training": {"compile": True, **training}, "attention": attention})
    assert named in str(raised.value)
    Config.from_dict({"training": training, "attention": attention})  # fine without compile


def test_cli_exits_2_on_a_refused_combination(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("training:\n  compile: true\n  metadata_cache: false\n")
    rc = main(["train", "--config", str(config), "--output_dir", str(tmp_path / "o"), "--no_progress"])
    assert rc == 2
    assert "training.metadata_cache: false" in capsys.readouterr().err

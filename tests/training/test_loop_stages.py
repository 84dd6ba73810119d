"""The loop's stages and its safety nets, unit by unit: tear-down after a failure, checkpoint
rotation and stale temporaries, a failed checkpoint write, the saved config and the resume
comparison, the start-up check for data with nothing to learn."""

import errno
import json

import numpy as np
import pytest
import torch

from hasten.config import Config, ConfigError
from hasten.data import DataError
from hasten.packing import TokenBudgetBatchSampler
from hasten.training import loop
from hasten.training.checkpoint import (CheckpointWriteError, TrainerState, _rotate, latest_valid,
                                        remove_stale_temporaries, save_checkpoint, verify)
from hasten.training.metrics import format_row
from hasten.training.run_folder import RESUME_MAY_CHANGE, check_resume_config, config_record
from hasten.training.telemetry import flatten

TINY = {"model": {"default_size": "tiny"},
        "training": {"max_tokens": 384, "max_steps": 3, "learning_rate": 0.003, "warmup_steps": 1,
                     "logging_steps": 1, "checkpoint": {"interval_steps": 1, "keep_last": 2}},
        "logging": {"tensorboard": "false", "gpu_monitor": False}}


def test_tear_down_runs_when_the_loop_raises(tmp_path, monkeypatch):
    """A failure mid-run still undoes hasten's patches (the model module's RoPE global among them)
    and closes the metrics file, as a run that ends normally does."""
    import transformers.models.qwen3.modeling_qwen3 as qwen3

    original_rope = qwen3.apply_rotary_pos_emb
    opened = []

    class Recorded(loop.MetricsLog):
        def __init__(self, log_dir):
            super().__init__(log_dir)
            opened.append(self)

        def write(self, row):
            super().write(row)
            if row["step"] == 2:
                assert qwen3.apply_rotary_pos_emb is not original_rope  # hasten's RoPE is in while training
                raise RuntimeError("a failure inside the loop")

    monkeypatch.setattr(loop, "MetricsLog", Recorded)
    with pytest.raises(RuntimeError, match="a failure inside the loop"):
        loop.train(Config.from_dict(TINY), tmp_path, tmp_path / "logs", progress=False)
    assert qwen3.apply_rotary_pos_emb is original_rope
    assert opened and opened[0]._file.closed
    assert not (tmp_path / "logs" / "summary.json").exists()  # a failed run writes no summary


def test_checkpoints_hold_the_config_and_list_it_in_the_manifest(tmp_path):
    config = Config.from_dict(TINY)
    loop.train(config, tmp_path, tmp_path / "logs", progress=False)
    newest = latest_valid(tmp_path / "checkpoints")
    assert json.loads((newest / "config.json").read_text()) == config_record(config)
    assert "config.json" in json.loads((newest / "manifest.json").read_text())["files"]


def _fake_checkpoint(root, step, whole=True):
    folder = root / f"checkpoint-{step:06d}"
    folder.mkdir(parents=True)
    (folder / "weights").write_bytes(b"w" * 10)
    size = 10 if whole else 99
    (folder / "manifest.json").write_text(json.dumps({"step": step, "files": {"weights": {"bytes": size,
                                                                                           "sha256": "x"}}}))
    return folder


def test_rotation_keeps_the_newest_and_never_judges_later_steps(tmp_path):
    for step in (1, 2, 3, 9):
        _fake_checkpoint(tmp_path, step)
    _rotate(tmp_path, tmp_path / "checkpoint-000003", keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-000002", "checkpoint-000003",
                                                          "checkpoint-000009"]
    _rotate(tmp_path, tmp_path / "checkpoint-000003", keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-000003", "checkpoint-000009"]


def test_rotation_deletes_nothing_when_the_new_checkpoint_is_not_whole(tmp_path):
    _fake_checkpoint(tmp_path, 1)
    _fake_checkpoint(tmp_path, 2, whole=False)
    _rotate(tmp_path, tmp_path / "checkpoint-000002", keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-000001", "checkpoint-000002"]


def test_stale_temporaries_are_removed_and_checkpoints_kept(tmp_path):
    _fake_checkpoint(tmp_path, 1)
    (tmp_path / ".tmp-checkpoint-000002-123" / "model").mkdir(parents=True)
    assert [p.name for p in remove_stale_temporaries(tmp_path)] == [".tmp-checkpoint-000002-123"]
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-000001"]
    assert remove_stale_temporaries(tmp_path / "missing") == []


def _tiny_model_and_optimizer():
    from hasten.training.defaults import embedded_model_config

    model = __import__("transformers").Qwen3ForCausalLM(embedded_model_config("tiny"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return model, optimizer, scheduler


def test_a_failed_checkpoint_write_removes_its_folder_and_keeps_the_earlier_one(tmp_path, monkeypatch):
    model, optimizer, scheduler = _tiny_model_and_optimizer()
    first = save_checkpoint(tmp_path, TrainerState(1, 0, 1), model, optimizer, scheduler, keep_last=1)
    real = torch.save

    def full(obj, f, *args, **kwargs):
        if str(f).endswith("scheduler.pt"):
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CheckpointWriteError, match=r"checkpoint-000002: No space left on device.*about [\d.]+ KiB "
                                                   r"\(\d+ bytes\).*checkpoint-000001 is intact"):
        save_checkpoint(tmp_path, TrainerState(2, 0, 2), model, optimizer, scheduler, keep_last=1)
    assert [p.name for p in tmp_path.iterdir()] == [first.name]
    verify(first)


def test_resume_config_comparison(tmp_path):
    checkpoint = tmp_path / "checkpoint-000002"
    checkpoint.mkdir()
    saved = Config.from_dict(TINY)
    (checkpoint / "config.json").write_text(json.dumps(config_record(saved)))

    def resumed(allowed=(), **training):
        raw = json.loads(json.dumps(TINY))
        raw["training"].update(training)
        check_resume_config(checkpoint, Config.from_dict(raw), allowed)

    resumed(max_steps=10, logging_steps=5, device="cpu", distributed="fsdp2")  # free to change
    with pytest.raises(ConfigError, match=r"training.seed: 0 in the checkpoint, 1 now.*--allow_config_change "
                                          r"training.seed"):
        resumed(seed=1)
    resumed(("training.seed",), seed=1)
    off = json.loads(json.dumps(TINY))
    off["lora"] = {"r": 4}  # LoRA off in both: its settings do nothing
    check_resume_config(checkpoint, Config.from_dict(off), ())


def test_resume_may_change_names_real_keys():
    keys = flatten(Config().to_dict(), ".")
    for entry in RESUME_MAY_CHANGE:
        assert any(k == entry or (entry.endswith(".") and k.startswith(entry)) for k in keys), entry


def _samples(labels_per_sample):
    return [{"input_ids": list(range(len(labels))), "labels": labels} for labels in labels_per_sample]


def test_start_check_refuses_data_without_any_target():
    samples = _samples([[-100] * 20 for _ in range(30)])
    sampler = TokenBudgetBatchSampler([20] * 30, 64)
    with pytest.raises(DataError, match=r"the first 8 batches have no trainable tokens.*no completion or "
                                        r"assistant tokens at all"):
        loop._refuse_untrainable_start(samples, sampler, Config.from_dict(TINY), 0)


def test_start_check_accepts_data_with_some_targets():
    masked = [[-100] * 20 for _ in range(30)]
    masked[7] = [-100] * 10 + list(range(10))
    sampler = TokenBudgetBatchSampler([20] * 30, 64)
    loop._refuse_untrainable_start(_samples(masked), sampler, Config.from_dict(TINY), 0)


def test_host_label_check_ignores_the_first_label_of_a_row():
    assert not loop._has_trainable_tokens(torch.tensor([[5, -100, -100]]))  # position 0 is never a target
    assert loop._has_trainable_tokens(torch.tensor([[-100, -100, 7]]))
    assert not loop._has_trainable_tokens(torch.from_numpy(np.full((2, 4), -100)))


def test_a_window_of_masked_batches_prints_without_a_loss():
    row = {"step": 3, "loss": None, "lr": 1e-3, "tokens_per_s": 10.0, "step_s": 0.1, "peak_gib": 0.1,
           "masked_batches": 2}
    assert "loss - |" in format_row(row) and "masked batches 2" in format_row(row)

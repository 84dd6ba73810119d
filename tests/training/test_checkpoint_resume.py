"""Checkpoints: atomic, verified, resumed onto the same loss trajectory; SIGTERM saves before exit."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hasten.config import Config, ConfigError
from hasten.training import loop
from hasten.training.checkpoint import CheckpointError, latest_valid, verify

TINY = {"model": {"default_size": "tiny"},
        "training": {"max_tokens": 384, "max_steps": 6, "learning_rate": 0.003, "warmup_steps": 1,
                     "logging_steps": 1, "checkpoint": {"interval_steps": 2, "keep_last": 2}}}


def _losses(log_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (log_dir / "metrics.jsonl").read_text().splitlines())}


def _stop_at(monkeypatch, step, sig=signal.SIGTERM):
    """Deliver `sig` to this process when the metrics row of `step` is written."""
    original = loop.MetricsLog.write

    def write(self, row):
        original(self, row)
        if row["step"] == step:
            os.kill(os.getpid(), sig)

    monkeypatch.setattr(loop.MetricsLog, "write", write)


def test_resume_after_signal_continues_the_same_loss_trajectory(tmp_path, monkeypatch):
    config = Config.from_dict(TINY)
    straight = loop.train(config, tmp_path / "a", tmp_path / "a" / "logs", progress=False)
    assert straight.steps == 6 and straight.interrupted_by is None

    _stop_at(monkeypatch, 3)
    stopped = loop.train(config, tmp_path / "b", tmp_path / "b" / "logs", progress=False)
    monkeypatch.undo()
    assert stopped.interrupted_by == "SIGTERM" and stopped.steps == 3 and stopped.model_dir is None
    assert stopped.last_checkpoint.name == "checkpoint-000003"  # saved before stopping, off the interval

    resumed = loop.train(config, tmp_path / "b", tmp_path / "b" / "logs", progress=False, resume="auto")
    assert resumed.resumed_from.name == "checkpoint-000003" and resumed.steps == 6
    want, got = _losses(tmp_path / "a" / "logs"), _losses(tmp_path / "b" / "logs")
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert got[step] == pytest.approx(want[step], abs=1e-6), f"step {step}"
    # keep_last=2: of checkpoints 2, 3, 4, 6 only the newest two remain
    names = sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir())
    assert names == ["checkpoint-000004", "checkpoint-000006"]


def test_corrupt_and_partial_checkpoints_are_skipped(tmp_path, caplog):
    config = Config.from_dict(TINY)
    loop.train(config, tmp_path, tmp_path / "logs", progress=False)
    root = tmp_path / "checkpoints"
    newest, older = root / "checkpoint-000006", root / "checkpoint-000004"
    weights = newest / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    (root / "checkpoint-000007").mkdir()  # partial: no manifest
    with pytest.raises(CheckpointError, match="truncated or overwritten"):
        verify(newest)
    caplog.clear()
    assert latest_valid(root) == older
    warned = caplog.text
    assert "no manifest.json" in warned and "truncated" in warned
    with pytest.raises(ConfigError, match="checkpoint-000006.*truncated"):
        loop.train(config, tmp_path, tmp_path / "logs", progress=False, resume=str(newest))
    flipped = older / "optimizer.pt"
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        verify(older)


def test_cli_sigterm_then_resume_auto(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({**TINY, "training": {**TINY["training"], "max_steps": 400,
                                                      "checkpoint": {"interval_steps": 1000}}}))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "hasten", "train", "--config", str(config), "--output_dir", str(out),
           "--no_progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "logs" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "stopped by SIGTERM" in err and "--resume auto" in err
    summary = json.loads((out / "logs" / "summary.json").read_text())
    stopped_at = summary["steps"]
    assert summary["interrupted_by"] == "SIGTERM" and 2 <= stopped_at < 400
    assert (out / "checkpoints" / f"checkpoint-{stopped_at:06d}" / "manifest.json").is_file()
    assert not (out / "final").exists()


def test_fresh_run_refuses_a_folder_with_earlier_checkpoints(tmp_path):
    config = Config.from_dict({**TINY, "training": {**TINY["training"], "max_steps": 2}})
    loop.train(config, tmp_path, tmp_path / "logs", progress=False)
    with pytest.raises(ConfigError, match="already holds checkpoints of an earlier run.*--resume auto"):
        loop.train(config, tmp_path, tmp_path / "logs", progress=False)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint-000002"]  # untouched

import json

import pytest

from hasten.cli.main import main

TINY = """
model:
  default_size: tiny
training:
  max_tokens: 512
  max_steps: 4
  learning_rate: 0.003
  warmup_steps: 1
  logging_steps: 2
"""


def test_embedded_default_trains_and_logs(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    out, logs = tmp_path / "out", tmp_path / "logs"
    rc = main(["train", "--config", str(config), "--output_dir", str(out), "--log_dir", str(logs), "--no_progress"])
    assert rc == 0
    rows = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]
    assert rows[-1]["loss"] < rows[0]["loss"]  # it learns
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0 and r["peak_gib"] > 0
        assert r["packing_efficiency"] == 1.0
        assert r["host_syncs_per_step"] == 0 and r["checkpoint_s"] == 0.0  # no CUDA: nothing to sync
    summary = json.loads((logs / "summary.json").read_text())
    assert summary["packing"]["samples_packed"] > 0
    on_cpu = summary["device"] == "cpu"
    for r in rows:  # the CPU path is a fallback, and the metrics say so; on a GPU there is none
        assert (r["fallbacks"].get("attention_per_sequence", 0) > 0) == on_cpu
        assert (r["host_lead_ms"] is None) == on_cpu  # measured with CUDA events
        if not on_cpu:
            assert 0 <= r["host_lead_ms"] == r["host_lead_ms_max"]  # one rank: its own lead both ways
    assert ("attention_per_sequence" in summary["fallback_reasons"]) == on_cpu
    assert (out / "final" / "model.safetensors").is_file()


def test_padded_baseline_runs(tmp_path):
    config = tmp_path / "padded.yaml"
    config.write_text(TINY.replace("training:\n", "training:\n  packed_sequence: false\n"))
    assert main(["train", "--config", str(config), "--output_dir", str(tmp_path / "o"), "--no_progress",
                 "--max_steps", "2"]) == 0


@pytest.mark.parametrize("text,message", [
    ("training:\n  max_stepz: 3\n", "unknown key `training.max_stepz`; did you mean `training.max_steps`"),
    ("training:\n  max_steps: many\n", "`training.max_steps` must be an integer"),
    ("data:\n  path: /nonexistent/data.jsonl\n", "/nonexistent/data.jsonl"),
    ("model:\n  path: /nonexistent/model\n", "model.path /nonexistent/model is not a folder"),
])
def test_bad_config_exits_nonzero_naming_the_problem(tmp_path, capsys, text, message):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    rc = main(["train", "--config", str(config), "--output_dir", str(tmp_path / "o"), "--no_progress"])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_unwritable_output_dir(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc = main(["train", "--output_dir", str(blocker / "sub"), "--no_progress", "--max_steps", "1"])
    assert rc == 2
    assert "cannot create" in capsys.readouterr().err


def test_data_with_nothing_trainable_is_an_error_not_a_hang(tmp_path, capsys):
    data = tmp_path / "empty.jsonl"
    data.write_text('{"text": ""}\n{"text": ""}\n')
    config = tmp_path / "c.yaml"
    config.write_text(f"model:\n  default_size: tiny\ndata:\n  path: {data}\n")
    rc = main(["train", "--config", str(config), "--output_dir", str(tmp_path / "o"), "--no_progress"])
    assert rc == 2
    assert "no sample can be trained on" in capsys.readouterr().err


def test_checkpoint_writing_is_reported_apart_from_the_step_rate(tmp_path, monkeypatch):
    """A slow disk, simulated on the loop's clock (no sleeping, so machine load cannot move it):
    each checkpoint "takes" 100 s, which must land in checkpoint_s and never in step_s."""
    import time
    import types

    import hasten.training.loop as loop

    clock = {"offset": 0.0}
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=lambda: time.perf_counter()
                                                            + clock["offset"]))
    real_save = loop.save_checkpoint

    def slow_save(*args, **kwargs):
        clock["offset"] += 100.0
        return real_save(*args, **kwargs)

    monkeypatch.setattr(loop, "save_checkpoint", slow_save)
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY + "  checkpoint:\n    interval_steps: 1\n")
    logs = tmp_path / "logs"
    assert main(["train", "--config", str(config), "--output_dir", str(tmp_path / "out"), "--log_dir", str(logs),
                 "--no_progress"]) == 0
    rows = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    # window 1-2 holds the checkpoint of step 1; window 3-4 those of steps 2 and 3 (step 2's is
    # written after its row); step 4's comes after the last row
    assert rows[0]["checkpoint_s"] >= 100 and rows[1]["checkpoint_s"] >= 200
    for r in rows:
        assert r["step_s"] < 50, "checkpoint time leaked into the step rate"
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / (2 * r["step_s"]))


def test_profile_step_writes_operator_tables_and_a_trace(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY + "logging:\n  profile_step: 3\n  tensorboard: 'false'\n")
    logs = tmp_path / "logs"
    assert main(["train", "--config", str(config), "--output_dir", str(tmp_path / "out"), "--log_dir", str(logs),
                 "--no_progress"]) == 0
    assert sorted(p.name for p in logs.glob("profile_*")) == ["profile_step3_rank0.trace.json",
                                                               "profile_step3_rank0.txt"]
    table = (logs / "profile_step3_rank0.txt").read_text()
    assert "operators by own CPU time" in table and "aten::mm" in table  # the step's matmuls were seen
    assert json.loads((logs / "profile_step3_rank0.trace.json").read_text())["traceEvents"]


def test_profile_step_must_not_be_negative(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("logging:\n  profile_step: -1\n")
    assert main(["train", "--config", str(config), "--output_dir", str(tmp_path / "o"), "--no_progress"]) == 2
    assert "logging.profile_step" in capsys.readouterr().err


def test_a_host_bound_run_says_so_once_after_warm_up(tmp_path, monkeypatch, capsys):
    """The host lead needs CUDA events; a stand-in meter that reports 0.2 ms (the GPU always
    waiting) drives the loop's report on the CPU: in the rows, and one warning, not for the
    first (warm-up) window."""
    import hasten.training.loop as loop
    from hasten.training.metrics import HostLeadMeter

    class WaitingGpu(HostLeadMeter):
        def __init__(self, device):
            super().__init__(device)
            self.enabled = True

        def start_window(self):
            pass

        def mark(self, step_start=False):
            pass

        def margin_ms(self):
            return 0.2

    monkeypatch.setattr(loop, "HostLeadMeter", WaitingGpu)
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY.replace("max_steps: 4", "max_steps: 6"))
    logs = tmp_path / "logs"
    assert main(["train", "--config", str(config), "--output_dir", str(tmp_path / "out"), "--log_dir", str(logs),
                 "--no_progress"]) == 0
    rows = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    assert [r["host_lead_ms"] for r in rows] == [0.2, 0.2, 0.2]
    err = capsys.readouterr().err
    assert err.count("the step is host-bound") == 1
    assert "training.fsdp2_layers_per_unit" in err
    config.write_text(TINY.replace("max_steps: 4", "max_steps: 2"))  # one window: warm-up only
    assert main(["train", "--config", str(config), "--output_dir", str(tmp_path / "out2"), "--log_dir",
                 str(tmp_path / "logs2"), "--no_progress"]) == 0
    assert "host-bound" not in capsys.readouterr().err

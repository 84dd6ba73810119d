import json

import pytest

from hasten.cli.main import main
from hasten.training.telemetry import REDACTED, TensorBoardSink, flatten, redact, version_record


def test_redact_masks_secret_keys_and_secret_env_values(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnop")
    monkeypatch.setenv("SHORT_TOKEN", "abc")  # too short to be a credential: left alone
    raw = {"data": {"path": "/data/hf_abcdefghijklmnop/train.jsonl"}, "wandb_api_key": "xyz123456",
           "nested": [{"password": "p"}, "abc"], "tokens": 5, "max_tokens": 9, "hf_token": "x"}
    out = redact(raw)
    assert out["data"]["path"] == f"/data/{REDACTED}/train.jsonl"
    assert out["wandb_api_key"] == REDACTED and out["nested"][0]["password"] == REDACTED
    assert out["nested"][1] == "abc" and out["hf_token"] == REDACTED
    assert out["tokens"] == 5 and out["max_tokens"] == 9  # counts of tokens are not credentials
    assert raw["wandb_api_key"] == "xyz123456"  # the input is not modified


def test_version_record_names_the_stack():
    record = version_record()
    assert record["packages"]["torch"] and record["packages"]["transformers"] and record["python"]


def test_flatten_for_tensorboard():
    assert flatten({"step": 1, "gpu": {"util_pct": 5.0}, "fallbacks": {"a": 2}}) == {
        "step": 1, "gpu/util_pct": 5.0, "fallbacks/a": 2}


def test_tensorboard_off_or_missing_is_a_no_op(tmp_path):
    sink = TensorBoardSink(tmp_path, "false")
    sink.write({"step": 1, "loss": 1.0})
    sink.close()
    assert not (tmp_path / "tensorboard").exists()


def test_tensorboard_rows_read_back_as_scalars(tmp_path):
    """Each row is one event of all its numeric scalars (nested keys flattened, booleans, strings and
    the step itself left out), read back by TensorBoard's own reader as add_scalar's would be."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path, "auto")
    rows = [{"step": s, "loss": 5.0 - s, "tokens_per_s": 1000.0 * s, "gpu": {"util_pct": 50 + s},
             "correct": True, "note": "x"} for s in (1, 2, 3)]
    for row in rows:
        sink.write(row)
    sink.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["gpu/util_pct", "loss", "tokens_per_s"]
    for tag, expect in (("loss", lambda s: 5.0 - s), ("gpu/util_pct", lambda s: 50.0 + s)):
        assert [(e.step, e.value) for e in events.Scalars(tag)] == [(s, expect(s)) for s in (1, 2, 3)]


def test_run_writes_versions_and_no_secrets(tmp_path, monkeypatch):
    secret = "sk_live_0123456789abcdef"
    monkeypatch.setenv("MY_SERVICE_API_KEY", secret)
    data = tmp_path / f"data-{secret}.jsonl"
    data.write_text("\n".join(json.dumps({"text": "hello world " * (i + 1)}) for i in range(40)))
    config = tmp_path / "c.yaml"
    config.write_text(f"model:\n  default_size: tiny\ndata:\n  path: {data}\ntraining:\n  max_tokens: 256\n"
                      "  max_steps: 2\nlogging:\n  tensorboard: 'false'\n")
    logs = tmp_path / "logs"
    assert main(["train", "--config", str(config), "--output_dir", str(tmp_path / "o"), "--log_dir", str(logs),
                 "--no_progress"]) == 0
    versions = json.loads((logs / "versions.json").read_text())
    assert versions["packages"]["torch"]
    for name in ("config.json", "summary.json", "versions.json", "metrics.jsonl"):
        assert secret not in (logs / name).read_text(), name
    assert REDACTED in (logs / "config.json").read_text()

"""The examples run as written (CPU, a couple of steps each), and the "your model and your data"
example (configs/my_model_my_data.yaml, examples/data/) loads, reads and trains as written. TRL is
not installed in CI: its example is only checked for a clear message when TRL is missing, and this
file imports nothing from trl."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _run(script, *args, timeout=120):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("script", ["hf_trainer_packed.py", "peft_lora_packed.py"])
def test_example_runs(script):
    if script == "peft_lora_packed.py":
        pytest.importorskip("peft")
    result = _run(script, "--max_steps", "2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = [line for line in result.stdout.splitlines() if line.startswith("loss ")]
    assert summary and "over 2 steps" in summary[-1], result.stdout[-3000:]
    assert "packing efficiency 1.000" in summary[-1]
    assert "hasten active: varlen attention" in result.stdout


def test_accelerate_example_runs():
    pytest.importorskip("accelerate")
    result = _run("accelerate_packed.py", "--max_steps", "2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all("packing efficiency 1.000" in line for line in steps), result.stdout
    assert "hasten active: varlen attention" in result.stdout


def test_examples_open_with_their_command():
    for path in sorted(EXAMPLES.glob("*.py")):
        lines = path.read_text().splitlines()
        opening = lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))]
        assert lines[0].startswith("# Run:"), path.name
        assert any(f"python examples/{path.name}" in line for line in opening), path.name


@pytest.mark.skipif(importlib.util.find_spec("trl") is not None, reason="TRL is installed")
def test_trl_example_says_what_to_install():
    result = _run("trl_sft_padding_free.py", "--model", "unused", timeout=60)
    assert result.returncode != 0
    assert "pip install trl" in result.stdout + result.stderr
    assert "Traceback" not in result.stderr


# --- configs/my_model_my_data.yaml and examples/data/: "Your model and your data" (docs/deployment.md)

MY_CONFIG = ROOT / "configs" / "my_model_my_data.yaml"
DATA = EXAMPLES / "data"
SAMPLE_FILES = {"chat.jsonl": "messages", "prompt_completion.jsonl": "prompt", "text.jsonl": "text"}


def test_my_model_my_data_config_loads_and_opens_with_its_command():
    from hasten.config import Config

    text = MY_CONFIG.read_text(encoding="utf-8")
    assert text.startswith("# hasten train --config configs/my_model_my_data.yaml --output_dir ")
    config = Config.from_yaml(MY_CONFIG)
    assert config.model.path is None  # as written: the embedded model, so the command runs anywhere
    data = (ROOT / config.data.path).resolve()
    assert data.parent == DATA.resolve() and data.name in SAMPLE_FILES
    for name in SAMPLE_FILES:  # the other two samples are named in the file, to switch to
        assert f"examples/data/{name}" in text
    # the role rule is shown where a user edits it
    assert re.search(r"^  assistant_roles: \[assistant\]$", text, re.M)
    assert config.data.assistant_roles == ["assistant"]


def _trained(sample):
    return [tok for tok, label in zip(sample["input_ids"], sample["labels"]) if label != -100]


@pytest.mark.parametrize("name", sorted(SAMPLE_FILES))
def test_sample_data_loads_with_hastens_loader(name):
    from hasten.data import ByteTokenizer, load_dataset, read_records

    tok = ByteTokenizer()
    path = DATA / name
    records = read_records(path)
    assert 3 <= len(records) <= 10
    assert all(SAMPLE_FILES[name] in record for record in records), "each file holds one record format"
    samples = load_dataset(path, tok)
    assert len(samples) == len(records)
    for record, sample in zip(records, samples):
        assert len(sample["input_ids"]) == len(sample["labels"]) > 0
        trained = _trained(sample)
        if name == "text.jsonl":  # every token
            assert sample["labels"] == sample["input_ids"]
        elif name == "prompt_completion.jsonl":  # the completion (and the eos after it) only
            assert trained[-1] == tok.eos_token_id
            assert tok.decode(trained) == record["completion"]
        else:  # the assistant turns only
            roles = [m["role"] for m in record["messages"]]
            assert set(roles) <= {"system", "user", "assistant"} and roles[-1] == "assistant"
            assert trained[-1] == tok.eos_token_id
            assert tok.decode(trained) == "".join(m["content"] + "\n" for m in record["messages"]
                                                  if m["role"] == "assistant")
    if name == "chat.jsonl":
        rows = [[m["role"] for m in r["messages"]] for r in records]
        assert any("system" in roles for roles in rows) and any(roles.count("assistant") > 1 for roles in rows)


def test_sample_data_packs_with_the_first_label_of_every_sample_ignored():
    from hasten.data import ByteTokenizer, load_dataset
    from hasten.packing import PackingCollator

    samples = [s for name in sorted(SAMPLE_FILES) for s in load_dataset(DATA / name, ByteTokenizer())]
    batch = PackingCollator(max_tokens=sum(len(s["input_ids"]) for s in samples))(samples)
    starts = batch["cu_seq_lens_q"][:-1].long()
    assert len(starts) == len(samples)
    assert (batch["labels"].reshape(-1)[starts] == -100).all()


def test_my_model_my_data_trains_as_written(tmp_path, monkeypatch, capsys):
    from hasten.cli.main import main

    monkeypatch.chdir(ROOT)  # data.path is relative to the repository root, as in the command
    rc = main(["train", "--config", str(MY_CONFIG), "--output_dir", str(tmp_path / "run"), "--device", "cpu",
               "--max_steps", "1", "--no_progress"])
    assert rc == 0, capsys.readouterr().err[-3000:]
    assert (tmp_path / "run" / "final").is_dir() and (tmp_path / "run" / "logs" / "summary.json").is_file()


# --- configs/long_context_lora.yaml: the long-context LoRA settings, loadable and runnable as written
LONG_CONFIG = ROOT / "configs" / "long_context_lora.yaml"


def test_long_context_config_sets_the_lowest_memory_per_token_and_trains(tmp_path, monkeypatch, capsys):
    from hasten.cli.main import main
    from hasten.config import Config

    text = LONG_CONFIG.read_text(encoding="utf-8")
    assert text.startswith("# hasten train --config configs/long_context_lora.yaml --output_dir ")
    config = Config.from_yaml(LONG_CONFIG)
    checkpoint = config.training.checkpoint
    assert (checkpoint.activations, checkpoint.offload, checkpoint.mlp_tile_tokens) == ("full", "all", 16384)
    assert config.training.memory_preflight and config.lora.enabled
    monkeypatch.chdir(ROOT)
    rc = main(["train", "--config", str(LONG_CONFIG), "--output_dir", str(tmp_path / "run"), "--device", "cpu",
               "--max_steps", "1", "--no_progress"])
    err = capsys.readouterr().err
    assert rc == 0, err[-3000:]
    assert "runs on a GPU" in err  # offload is the GPU's, said once
    import json

    summary = json.loads((tmp_path / "run" / "logs" / "summary.json").read_text())
    assert any(item.startswith("activation checkpointing (full") for item in summary["hasten_active"])
    assert any(item.startswith("MLP sequence tiling (16384 tokens per tile") for item in summary["hasten_active"])
    assert (tmp_path / "run" / "final").is_dir()

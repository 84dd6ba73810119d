"""The examples run as written (CPU, a couple of steps each). TRL is not installed in CI: its
example is only checked for a clear message when TRL is missing, and this file imports nothing
from trl."""

import importlib.util
import os
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

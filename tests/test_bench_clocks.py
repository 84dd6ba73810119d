"""benchmarks/common.py's GPU clock sampling (rows of W4 and the other training benchmarks carry the
SM clock and board power of their timed steps): the parser of nvidia-smi's lines, the sampler
against a stand-in nvidia-smi, and that without one it adds nothing to a row. And the commit a row
names."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import common  # noqa: E402


def test_clock_lines_parse_and_odd_lines_are_skipped():
    text = "1650, 691.23\n1530, 694.10\n[N/A], [N/A]\nNo devices were found\n\n1980, 81.5\n"
    assert common.parse_clock_samples(text) == [(1650.0, 691.23), (1530.0, 694.10), (1980.0, 81.5)]


def test_fields_are_the_means_of_the_samples():
    clocks = common.GpuClocks()
    clocks.samples = [(1650.0, 690.0), (1530.0, 694.0)]
    assert clocks.fields() == {"sm_clock_mhz": 1590, "power_w": 692.0, "clock_samples": 2}


def test_the_sampler_reads_nvidia_smi_while_the_block_runs(tmp_path, monkeypatch):
    """A stand-in nvidia-smi on PATH (two numbers per call, as the real one prints for one GPU)."""
    import os
    import time

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '1600, 650.5'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with common.GpuClocks(period=0.01) as clocks:
        time.sleep(0.3)
    assert clocks.fields()["sm_clock_mhz"] == 1600 and clocks.fields()["power_w"] == 650.5
    assert clocks.fields()["clock_samples"] >= 2


def test_without_nvidia_smi_a_row_gets_no_clock_fields(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    with common.GpuClocks() as clocks:
        pass
    assert clocks.fields() == {}


def test_a_row_names_the_commit_and_marks_a_tree_that_differs_from_it(tmp_path, monkeypatch):
    """A device copy's .git can be stale: its HEAD is then not what was built, and the row says so."""
    import subprocess

    def git(*args):
        return subprocess.check_output(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                                       text=True).strip()

    monkeypatch.delenv("HASTEN_COMMIT", raising=False)
    git("init", "-q")
    (tmp_path / "kernel.cu").write_text("v1\n")
    git("add", "kernel.cu")
    git("commit", "-q", "-m", "v1")
    head = git("rev-parse", "--short", "HEAD")
    assert common.commit(tmp_path) == head
    (tmp_path / "notes.txt").write_text("untracked files do not count\n")
    assert common.commit(tmp_path) == head
    (tmp_path / "kernel.cu").write_text("v2\n")
    assert common.commit(tmp_path) == f"{head}-dirty"
    assert common.commit(tmp_path / "not-there") == "unknown"
    monkeypatch.setenv("HASTEN_COMMIT", "abc1234")
    assert common.commit(tmp_path) == "abc1234"

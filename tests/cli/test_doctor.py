"""`hasten doctor` through its parser, as hasten.cli.main wires it."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import hasten.ops
from hasten.cli import doctor

requires_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only report")


def run_doctor(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="hasten")
    subparsers = parser.add_subparsers(dest="command", required=True)
    doctor.add_parser(subparsers)
    args = parser.parse_args(["doctor", *argv])
    exit_code = args.func(args)
    return exit_code, capsys.readouterr().out


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    exit_code, out = run_doctor(capsys, "--json", *argv)
    return exit_code, json.loads(out)


def rows(report: dict, name: str) -> list[dict]:
    return [finding for finding in report["findings"] if finding["name"] == name]


def test_json_has_findings_and_summary(capsys: pytest.CaptureFixture[str]) -> None:
    exit_code, report = run_json(capsys)
    assert set(report) == {"findings", "summary"}
    names = {finding["name"] for finding in report["findings"]}
    assert {"platform", "cpus", "host memory", "python", "torch", "transformers", "hasten._C"} <= names
    # one "gpu" row without a GPU; "gpu count" and one "gpu N" row per device with one
    assert "gpu" in names or {"gpu count", "gpu 0"} <= names
    for finding in report["findings"]:
        assert set(finding) == {"name", "status", "detail", "fix"}
        assert finding["status"] in {"ok", "warn", "blocker", "info"}
    blockers = sum(finding["status"] == "blocker" for finding in report["findings"])
    assert report["summary"]["blockers"] == blockers
    assert exit_code == (1 if blockers else 0)


@requires_no_gpu
def test_cpu_machine_report(capsys: pytest.CaptureFixture[str]) -> None:
    exit_code, report = run_json(capsys)
    assert exit_code == 0
    (gpu_row,) = rows(report, "gpu")
    assert (gpu_row["status"], gpu_row["detail"]) == ("warn", doctor.NO_GPU)
    assert rows(report, "hasten._C")[0]["status"] == "ok"
    op_rows = [finding for finding in report["findings"] if finding["name"].startswith("op ")]
    assert [row["name"] for row in op_rows] == [f"op {op}" for op in hasten.ops.op_names()]
    assert {row["status"] for row in op_rows} == {"info"}
    assert (report["summary"]["blockers"], report["summary"]["warnings"]) == (0, 1)


def test_missing_data_path_is_blocker(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "absent.jsonl"
    exit_code, report = run_json(capsys, "--data", str(missing))
    assert exit_code == 1
    (row,) = rows(report, "data")
    assert row["status"] == "blocker"
    assert row["detail"] == f"{missing}: cannot read: No such file or directory [ENOENT]"


def test_readable_data_file_and_folder_are_ok(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    data_file = tmp_path / "train.jsonl"
    data_file.write_text('{"text": "hi"}\n')
    _, report = run_json(capsys, "--data", str(data_file), "--data", str(tmp_path))
    assert [(row["status"], row["detail"]) for row in rows(report, "data")] == [
        ("ok", f"{data_file}: readable file, 15 B"),
        ("ok", f"{tmp_path}: readable folder, 1 entry"),
    ]


def test_output_dir_under_a_regular_file_is_blocker(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    regular_file = tmp_path / "not_a_folder"
    regular_file.write_text("")
    output_dir = regular_file / "run1"
    exit_code, report = run_json(capsys, "--output_dir", str(output_dir))
    assert exit_code == 1
    (row,) = rows(report, "output_dir")
    assert row["status"] == "blocker"
    assert row["detail"] == f"{output_dir}: not writable: Not a directory [ENOTDIR]"
    assert row["fix"]


def test_log_dir_that_is_a_file_is_blocker(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    regular_file = tmp_path / "logs"
    regular_file.write_text("")
    exit_code, report = run_json(capsys, "--log_dir", str(regular_file))
    assert exit_code == 1
    assert rows(report, "log_dir")[0]["status"] == "blocker"


def test_writable_dirs_are_ok_and_left_clean(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    new_dir = tmp_path / "out" / "run1"
    exit_code, report = run_json(capsys, "--output_dir", str(new_dir), "--log_dir", str(tmp_path))
    assert [row["detail"] for row in rows(report, "output_dir")] == [f"{new_dir}: writable (created)"]
    assert [row["detail"] for row in rows(report, "log_dir")] == [f"{tmp_path}: writable"]
    assert {row["status"] for row in rows(report, "output_dir") + rows(report, "log_dir")} == {"ok"}
    assert new_dir.is_dir()
    assert list(new_dir.iterdir()) == []  # the probe file is gone
    assert exit_code == (1 if report["summary"]["blockers"] else 0)


def test_human_output(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "absent"
    exit_code, out = run_doctor(capsys, "--data", str(missing))
    lines = out.splitlines()
    assert exit_code == 1
    assert re.fullmatch(r"doctor: \d+ blockers, \d+ warnings", lines[-1])
    assert lines[0].split() == ["status", "check", "detail"]
    # Every row's detail starts in the same column as the header's.
    detail_column = lines[0].index("detail")
    data_index = next(i for i, line in enumerate(lines) if line.startswith("blocker  data"))
    assert lines[data_index][detail_column:].startswith(str(missing))
    assert lines[data_index + 1].strip() == "fix: pass an existing file or folder this user can read"
    assert lines[data_index + 1].index("fix:") == detail_column


def test_op_without_cuda_kernel_is_blocker_on_a_gpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hasten.ops, "is_loaded", lambda: True)
    monkeypatch.setattr(hasten.ops, "has_cuda_kernel", lambda op: False)
    findings = doctor.op_library_findings(gpu_present=True)
    op_rows = [finding for finding in findings if finding.name.startswith("op ")
               and not finding.name.startswith("op varlen_attention")]
    assert op_rows and {finding.status for finding in op_rows} == {"blocker"}
    assert all(finding.fix.startswith("rebuild with a CUDA torch and nvcc") for finding in op_rows)
    # without the cuDNN attention op FlashAttention-2 stands in, slower: a warning with its own fix
    attention_rows = [finding for finding in findings if finding.name.startswith("op varlen_attention")]
    assert len(attention_rows) == 2 and {finding.status for finding in attention_rows} == {"warn"}
    assert all("nvidia-cudnn-frontend" in finding.fix for finding in attention_rows)


def test_unloaded_extension_is_blocker_with_its_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hasten.ops, "is_loaded", lambda: False)
    monkeypatch.setattr(hasten.ops, "extension_error", lambda: "hasten._C could not be loaded (boom). Rebuild it")
    assert doctor.op_library_findings(gpu_present=False) == [
        doctor.Finding("hasten._C", "blocker", "not loaded", "hasten._C could not be loaded (boom). Rebuild it")
    ]


def test_driver_version_never_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor.shutil, "which", lambda name: None)
    assert doctor.nvidia_driver_version() is None

    def broken_nvidia_smi(*args: object, **kwargs: object) -> None:
        raise subprocess.CalledProcessError(9, "nvidia-smi")

    monkeypatch.setattr(doctor.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(doctor.subprocess, "run", broken_nvidia_smi)
    assert doctor.nvidia_driver_version() is None


def test_driver_version_from_nvidia_smi(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(
        doctor.subprocess,
        "run",
        lambda *args, **kwargs: subprocess.CompletedProcess(args, 0, stdout="570.86.15\n570.86.15\n", stderr=""),
    )
    assert doctor.nvidia_driver_version() == "570.86.15"


def test_gpu_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    properties = SimpleNamespace(name="NVIDIA H200", major=9, minor=0, total_memory=150 * 10**9)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)
    monkeypatch.setattr(doctor, "nvidia_driver_version", lambda: "580.159.04")
    rows, count = doctor.gpu_findings()
    assert count == 1
    assert rows == [
        doctor.Finding("gpu count", "ok", "1"),
        doctor.Finding("gpu 0", "ok", "NVIDIA H200, compute capability 9.0, 139.7 GiB"),
        doctor.Finding("driver", "ok", "580.159.04"),
    ]


def test_driver_without_cuda_torch_says_to_install_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(doctor, "nvidia_driver_version", lambda: "580.159.04")
    (row,), count = doctor.gpu_findings()
    assert (row.status, row.detail, count) == ("warn", doctor.NO_GPU, 0)
    assert row.fix.startswith("NVIDIA driver 580.159.04 is installed but torch is a CPU-only build")


def _model_rows(report: dict) -> dict[str, dict]:
    return {f["name"]: f for f in report["findings"] if f["name"].startswith("model")}


def test_model_of_the_table_reports_each_piece_on_hasten(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A saved config folder (no weights needed): every piece of a table type on hasten's kernels."""
    from transformers import AutoConfig

    AutoConfig.for_model("gemma3_text", vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         final_logit_softcapping=30.0).save_pretrained(tmp_path)
    _, report = run_json(capsys, "--model", str(tmp_path))
    found = _model_rows(report)
    assert {"model attention", "model table", "model norm", "model mlp", "model rotary", "model loss"} <= set(found)
    for name in ("model attention", "model norm", "model mlp", "model rotary", "model loss"):
        assert found[name]["status"] == "ok", found[name]
    assert "weight + 1" in found["model norm"]["detail"] and "GeGLU" in found["model mlp"]["detail"]
    assert "softcap 30" in found["model loss"]["detail"]


def test_model_outside_the_table_or_refusing_packing_is_said(capsys: pytest.CaptureFixture[str],
                                                             tmp_path: Path) -> None:
    _, report = run_json(capsys, "--model", "granitemoehybrid")  # Mamba layers: no varlen form in hasten yet
    found = _model_rows(report)
    assert found["model attention"]["status"] == "warn" and "refused" in found["model attention"]["detail"]
    assert found["model table"]["status"] == "warn" and "not in hasten's table" in found["model table"]["detail"]
    _, report = run_json(capsys, "--model", "deepseek_v3")  # MLA: value heads padded for hasten's kernels
    found = _model_rows(report)
    assert found["model attention"]["status"] == "ok" and "latent attention" in found["model attention"]["detail"]
    assert found["model rotary"]["status"] == "info" and "model's own rotary" in found["model rotary"]["detail"]
    from transformers import AutoConfig  # value heads wider than query/key heads: its own attention, with a mask

    AutoConfig.for_model("deepseek_v3", v_head_dim=256).save_pretrained(tmp_path / "wide_values")
    _, report = run_json(capsys, "--model", str(tmp_path / "wide_values"))
    attention = _model_rows(report)["model attention"]
    assert attention["status"] == "info" and "wider than the query/key heads" in attention["detail"]
    _, report = run_json(capsys, "--model", "gpt_oss")  # its sinks are computed on hasten's path
    attention = _model_rows(report)["model attention"]
    assert attention["status"] == "ok" and "sinks" in attention["detail"]
    _, report = run_json(capsys, "--model", "gemma2")  # its softcap is computed on hasten's path
    attention = _model_rows(report)["model attention"]
    assert attention["status"] == "ok" and "softcapping" in attention["detail"]


def test_unknown_model_is_a_blocker_with_the_fix(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    exit_code, report = run_json(capsys, "--model", "no_such_model_type")
    assert exit_code == 1
    (row,) = rows(report, "model")
    assert row["status"] == "blocker" and row["fix"] == doctor.MODEL_FIX
    exit_code, report = run_json(capsys, "--model", str(tmp_path))  # a folder without config.json
    assert exit_code == 1 and rows(report, "model")[0]["status"] == "blocker"


def test_linear_attention_row_names_the_install_where_fla_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 19: on a GPU machine without a usable flash-linear-attention, packed hybrid models are
    refused; doctor says so with the fix (the problem hasten.stateful itself reports)."""
    import hasten.stateful

    problem = "flash-linear-attention is not importable (ModuleNotFoundError: fla); pip install flash-linear-attention"
    monkeypatch.setattr(hasten.stateful, "fla_problem", lambda index=None: problem)
    finding = doctor.linear_attention_finding(gpu_count=1)
    assert finding.status == "warn" and "refused" in finding.detail and finding.fix == problem
    assert doctor.linear_attention_finding(gpu_count=0).status == "info"

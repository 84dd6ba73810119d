"""The compatibility table checks, with versions injected so every branch runs on any machine."""

from __future__ import annotations

import pytest
import torch

from hasten import compat

# A supported GPU install; each test changes one entry.
SUPPORTED: dict[str, str | None] = {
    "python": "3.11.7",
    "torch": "2.11.0+cu130",
    "transformers": "5.17.0",
    "flash-attn": None,
    "peft": None,
    "accelerate": None,
    "trl": None,
    "cuda": "13.0",
}


def statuses(versions: dict[str, str | None], **kwargs: bool) -> dict[str, str]:
    kwargs.setdefault("cuda_available", True)
    kwargs.setdefault("varlen_attn_available", True)
    return {finding.name: finding.status for finding in compat.check_versions(versions, **kwargs)}


def finding(name: str, versions: dict[str, str | None], **kwargs: bool) -> compat.Finding:
    kwargs.setdefault("cuda_available", True)
    kwargs.setdefault("varlen_attn_available", True)
    (match,) = [f for f in compat.check_versions(versions, **kwargs) if f.name == name]
    return match


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2.11.0+cu130", (2, 11, 0)),
        ("5.17.0.dev0", (5, 17, 0)),
        ("2.10.0a0+git1234abc", (2, 10, 0)),
        ("2.6.0rc1", (2, 6, 0)),
        ("1.0.post1", (1, 0)),
        ("12.1", (12, 1)),
        (" 3.10.12 ", (3, 10, 12)),
        ("v1.2", (1, 2)),
        ("2", (2,)),
    ],
)
def test_version_tuple(text: str, expected: tuple[int, ...]) -> None:
    assert compat.version_tuple(text) == expected


@pytest.mark.parametrize("text", ["", "dev", "cu130", "+cu130"])
def test_version_tuple_rejects_non_versions(text: str) -> None:
    with pytest.raises(ValueError):
        compat.version_tuple(text)


@pytest.mark.parametrize(
    ("version", "expected"),
    [("5.0", True), ("5.0.0", True), ("4.57.1", False), ("5.99.0", True), ("6.0.0.dev0", False), ("6", False)],
)
def test_transformers_range_pads_missing_components(version: str, expected: bool) -> None:
    assert compat.in_range(version, compat.TRANSFORMERS) is expected


def test_supported_install_is_all_ok() -> None:
    assert statuses(SUPPORTED) == {
        "hasten": "info",
        "python": "ok",
        "torch": "ok",
        "transformers": "ok",
        "flash-attn": "info",
        "CUDA runtime": "ok",
        "torch varlen_attn": "ok",
    }


def test_too_old_torch_is_blocker() -> None:
    torch_row = finding("torch", {**SUPPORTED, "torch": "2.9.1+cu128"})
    assert torch_row.status == "blocker"
    assert "torch>=2.10" in torch_row.fix


def test_minimum_torch_is_ok() -> None:
    assert finding("torch", {**SUPPORTED, "torch": "2.10.0"}).status == "ok"


def test_missing_torch_is_blocker_without_cuda_rows() -> None:
    result = statuses({**SUPPORTED, "torch": None, "cuda": None})
    assert result["torch"] == "blocker"
    assert "CUDA runtime" not in result
    assert "torch varlen_attn" not in result


@pytest.mark.parametrize(("version", "status"), [(None, "blocker"), ("4.57.1", "blocker"), ("6.0.0", "blocker")])
def test_unsupported_transformers_is_blocker(version: str | None, status: str) -> None:
    row = finding("transformers", {**SUPPORTED, "transformers": version})
    assert row.status == status
    assert row.fix == "pip install 'transformers>=5.0,<6'"


def test_old_python_is_blocker() -> None:
    assert statuses({**SUPPORTED, "python": "3.9.18"})["python"] == "blocker"


def test_missing_flash_attn_is_info() -> None:
    row = finding("flash-attn", SUPPORTED)
    assert row.status == "info"
    assert "optional; torch's varlen attention is used" in row.detail


@pytest.mark.parametrize(("version", "status"), [("2.5.9", "warn"), ("2.6.0", "ok"), ("2.8.3", "ok")])
def test_installed_flash_attn_needs_2_6(version: str, status: str) -> None:
    assert finding("flash-attn", {**SUPPORTED, "flash-attn": version}).status == status


def test_trainer_stack_packages_reported_only_when_installed() -> None:
    result = statuses({**SUPPORTED, "peft": "0.17.1"})
    assert result["peft"] == "ok"
    assert "accelerate" not in result
    assert "trl" not in result


@pytest.mark.parametrize(("cuda", "status"), [("12.1", "ok"), ("12.0", "blocker"), ("11.8", "blocker"), (None, "info")])
def test_cuda_runtime(cuda: str | None, status: str) -> None:
    assert finding("CUDA runtime", {**SUPPORTED, "cuda": cuda}).status == status


@pytest.mark.parametrize(("cuda_available", "status"), [(True, "warn"), (False, "info")])
def test_missing_varlen_attn_warns_only_with_a_gpu(cuda_available: bool, status: str) -> None:
    row = finding("torch varlen_attn", SUPPORTED, cuda_available=cuda_available, varlen_attn_available=False)
    assert row.status == status


def test_detected_versions_go_through_the_version_getter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "installed_versions", lambda: {**SUPPORTED, "torch": "2.8.0+cpu", "cuda": None})
    result = {f.name: f.status for f in compat.check_versions()}
    assert result["torch"] == "blocker"
    assert result["CUDA runtime"] == "info"


def test_installed_versions_match_this_environment() -> None:
    versions = compat.installed_versions()
    assert versions["torch"] == torch.__version__
    assert versions["cuda"] == torch.version.cuda


def test_torch_has_varlen_attn_matches_module() -> None:
    from torch.nn.attention import varlen

    assert compat.torch_has_varlen_attn() is hasattr(varlen, "varlen_attn")


@pytest.mark.parametrize(
    ("capability", "status", "tuned_note"),
    [
        ((9, 0), "ok", False),
        ((10, 0), "ok", False),
        ((8, 6), "ok", True),
        ((8, 0), "ok", True),
        ((7, 5), "warn", False),
    ],
)
def test_compute_capability(capability: tuple[int, int], status: str, tuned_note: bool) -> None:
    row = compat.check_compute_capability(0, "GPU", capability, 80 * 2**30)
    assert row.name == "gpu 0"
    assert row.status == status
    assert ("tuned for 9.0" in row.detail) is tuned_note
    assert "80.0 GiB" in row.detail

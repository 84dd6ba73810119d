"""The compatibility table (what hasten supports and was tested with) and the checks against it.

This is the one place the supported ranges live; `hasten doctor` and the deployment guide
read from it. torch is imported lazily so a missing or broken torch is reported, not raised.
"""

from __future__ import annotations

import importlib.metadata
import platform
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from hasten._version import __version__

Status = Literal["ok", "warn", "blocker", "info"]


@dataclass(frozen=True)
class Finding:
    """One row of an environment report; `fix` says what to do when status is not ok."""

    name: str
    status: Status
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class Requirement:
    """A supported version range: `minimum` inclusive, `below` exclusive, None for unbounded."""

    name: str
    minimum: str | None = None
    below: str | None = None
    tested: str | None = None
    required: bool = True
    # Shown as an info row when an optional package is absent; without it the row is omitted.
    missing_note: str | None = None

    def describe(self) -> str:
        bounds = [f">={self.minimum}"] if self.minimum else []
        bounds += [f"<{self.below}"] if self.below else []
        parts = [f"supported {','.join(bounds)}"] if bounds else []
        parts += [f"tested {self.tested}"] if self.tested else []
        return "; ".join(parts)


PYTHON = Requirement("python", minimum="3.10")
TORCH = Requirement("torch", minimum="2.10", tested="2.11 on GPU, 2.13 CPU")
TRANSFORMERS = Requirement("transformers", minimum="5.0", below="6", tested="5.17")
FLASH_ATTN = Requirement(
    "flash-attn", minimum="2.6", required=False, missing_note="optional; torch's varlen attention is used"
)
# Trainer-stack packages hasten works alongside; reported when installed, not constrained.
PEFT = Requirement("peft", required=False)
ACCELERATE = Requirement("accelerate", required=False)
TRL = Requirement("trl", required=False)
PACKAGES = (TORCH, TRANSFORMERS, FLASH_ATTN, PEFT, ACCELERATE, TRL)

# CUDA runtime torch was built against; only CUDA builds are checked.
CUDA_RUNTIME = Requirement("CUDA runtime", minimum="12.1")
# The varlen flash attention path needs Ampere or newer; kernels are tuned for Hopper.
MIN_COMPUTE_CAPABILITY = (8, 0)
TUNED_COMPUTE_CAPABILITY = (9, 0)


def version_tuple(version: str) -> tuple[int, ...]:
    """Leading numeric release components: '2.11.0+cu130' -> (2, 11, 0), '5.17.0.dev0' -> (5, 17, 0)."""
    release = version.strip().lstrip("vV").split("+", 1)[0]
    numbers: list[int] = []
    for component in release.split("."):
        # '0rc1' contributes 0 and ends the release part; 'dev0' ends it outright.
        match = re.match(r"\d+", component)
        if match is None:
            break
        numbers.append(int(match.group()))
        if match.end() != len(component):
            break
    if not numbers:
        raise ValueError(f"not a version string: {version!r}")
    return tuple(numbers)


def _compare(version: str, other: str) -> int:
    """-1, 0 or 1; missing components count as 0 so '5.0' == '5.0.0'."""
    left, right = version_tuple(version), version_tuple(other)
    width = max(len(left), len(right))
    left += (0,) * (width - len(left))
    right += (0,) * (width - len(right))
    return (left > right) - (left < right)


def in_range(version: str, requirement: Requirement) -> bool:
    if requirement.minimum is not None and _compare(version, requirement.minimum) < 0:
        return False
    return requirement.below is None or _compare(version, requirement.below) < 0


def _distribution_version(name: str) -> str | None:
    # Metadata, not import: reading a version should not import heavy or broken packages.
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_versions() -> dict[str, str | None]:
    """Versions of everything in the table as installed here; None where absent (cuda: CPU build)."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for requirement in PACKAGES:
        versions[requirement.name] = _distribution_version(requirement.name)
    try:
        import torch

        versions["torch"] = torch.__version__
        versions["cuda"] = torch.version.cuda
    except ImportError:
        versions["cuda"] = None
    return versions


def torch_has_varlen_attn() -> bool:
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return False
    return hasattr(varlen, "varlen_attn")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _install_hint(requirement: Requirement) -> str:
    bounds = f"{requirement.minimum or '0'}"
    if requirement.below:
        bounds += f",<{requirement.below}"
    return f"pip install '{requirement.name}>={bounds}'"


def _check_package(requirement: Requirement, version: str | None) -> Finding | None:
    name = requirement.name
    if version is None:
        if requirement.required:
            return Finding(name, "blocker", "not installed", _install_hint(requirement))
        if requirement.missing_note:
            return Finding(name, "info", f"not installed ({requirement.missing_note})")
        return None
    detail = f"{version} ({requirement.describe()})" if requirement.describe() else version
    if in_range(version, requirement):
        return Finding(name, "ok", detail)
    if requirement.required:
        return Finding(name, "blocker", detail, _install_hint(requirement))
    # An optional package in an unsupported version may still be picked up, so flag it.
    return Finding(name, "warn", detail, f"{_install_hint(requirement)}, or uninstall it")


def check_versions(
    versions: Mapping[str, str | None] | None = None,
    *,
    cuda_available: bool | None = None,
    varlen_attn_available: bool | None = None,
) -> list[Finding]:
    """Check versions against the table; arguments left None are detected (tests inject them).

    `versions` has installed_versions()'s keys ("python", each PACKAGES name, "cuda"); a value
    that is None or absent means not installed (for "cuda": a CPU-only torch build).
    """
    if versions is None:
        versions = installed_versions()
    if cuda_available is None:
        cuda_available = _cuda_available()
    if varlen_attn_available is None:
        varlen_attn_available = torch_has_varlen_attn()

    findings: list[Finding] = [Finding("hasten", "info", __version__)]
    python = versions.get("python")
    if python is not None and in_range(python, PYTHON):
        findings.append(Finding("python", "ok", f"{python} ({PYTHON.describe()})"))
    else:
        findings.append(
            Finding("python", "blocker", f"{python} ({PYTHON.describe()})", f"use Python >={PYTHON.minimum}")
        )

    for requirement in PACKAGES:
        finding = _check_package(requirement, versions.get(requirement.name))
        if finding is not None:
            findings.append(finding)

    if versions.get("torch") is not None:  # without torch, the torch blocker above says it all
        findings.append(_check_cuda_runtime(versions.get("cuda")))
        findings.append(_check_varlen_attn(varlen_attn_available, cuda_available))
    return findings


def _check_cuda_runtime(cuda: str | None) -> Finding:
    if cuda is None:
        return Finding(CUDA_RUNTIME.name, "info", "none: CPU-only torch build")
    detail = f"{cuda} ({CUDA_RUNTIME.describe()})"
    if in_range(cuda, CUDA_RUNTIME):
        return Finding(CUDA_RUNTIME.name, "ok", detail)
    return Finding(
        CUDA_RUNTIME.name,
        "blocker",
        detail,
        f"install a torch build for CUDA >={CUDA_RUNTIME.minimum} (https://pytorch.org/get-started/locally/)",
    )


def _check_varlen_attn(available: bool, cuda_available: bool) -> Finding:
    name = "torch varlen_attn"
    if available:
        return Finding(name, "ok", "torch.nn.attention.varlen.varlen_attn available")
    if not cuda_available:
        return Finding(name, "info", "torch.nn.attention.varlen.varlen_attn missing (only used on GPU)")
    return Finding(
        name,
        "warn",
        "torch.nn.attention.varlen.varlen_attn missing: attention runs per sequence (slower)",
        f"upgrade torch to a tested version ({TORCH.tested})",
    )


def check_compute_capability(index: int, gpu_name: str, capability: tuple[int, int], memory_bytes: int) -> Finding:
    """One GPU's row: below MIN_COMPUTE_CAPABILITY the varlen flash path is unavailable."""
    major, minor = capability
    detail = f"{gpu_name}, compute capability {major}.{minor}, {memory_bytes / 2**30:.1f} GiB"
    if capability < MIN_COMPUTE_CAPABILITY:
        minimum = ".".join(map(str, MIN_COMPUTE_CAPABILITY))
        return Finding(
            f"gpu {index}",
            "warn",
            f"{detail}: below {minimum}, no varlen flash attention (per-sequence fallback, slower)",
            f"use a GPU with compute capability >= {minimum} (Ampere or newer)",
        )
    if capability < TUNED_COMPUTE_CAPABILITY:
        tuned = ".".join(map(str, TUNED_COMPUTE_CAPABILITY))
        detail += f" (supported; kernels are tuned for {tuned})"
    return Finding(f"gpu {index}", "ok", detail)

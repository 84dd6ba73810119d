"""Loads hasten._C, the C++/CUDA op library, and answers questions about it."""

from __future__ import annotations

import torch

_LOAD_ERROR: str | None = None
try:
    from hasten import _C  # noqa: F401  (registers torch.ops.hasten.*)
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    _LOAD_ERROR = (
        f"hasten._C could not be loaded ({exc}). Rebuild it against the installed torch: "
        "pip install --no-build-isolation -e ."
    )

def is_loaded() -> bool:
    return _LOAD_ERROR is None


def extension_error() -> str | None:
    return _LOAD_ERROR


def require_extension() -> None:
    if _LOAD_ERROR is not None:
        raise RuntimeError(_LOAD_ERROR)


def op_names() -> tuple[str, ...]:
    """Every op the library declares (the schemas in csrc/registration.cpp)."""
    if not is_loaded():
        return ()
    return tuple(sorted(name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names()
                        if name.startswith("hasten::")))


def _has_kernel(op: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"hasten::{op}", key)


def has_cuda_kernel(op: str) -> bool:
    """Whether hasten::<op> runs on CUDA tensors in this build: its own CUDA kernel, or, for a
    composite op (CompositeExplicitAutograd, written in other ops), a build whose other ops have
    CUDA kernels (a CPU-only build has none, so its composites cannot run on the GPU either)."""
    if not is_loaded():
        return False
    if _has_kernel(op, "CUDA"):
        return True
    return _has_kernel(op, "CompositeExplicitAutograd") and any(_has_kernel(o, "CUDA") for o in op_names())

"""Loads hasten._C, the C++/CUDA op library, on first use, and answers questions about it.

`import hasten` does not load it: `load()` does, the first time an op wrapper, accelerate() or
doctor asks. After the schemas are defined (csrc/registration.cpp), load() runs each op family's
Python registrations (fakes, autograd) once, so `torch.ops.hasten.*` is complete before any use.
"""

from __future__ import annotations

import importlib

import torch

# the op families with Python registrations (each module's `_register()`), in hasten.ops
_FAMILIES = ("dense", "attention", "loss", "lora", "moe", "packing")
REBUILD = "rebuild it against the installed torch: pip install --no-build-isolation -e . (or make install)"


class ExtensionError(RuntimeError):
    """hasten._C is missing or could not be loaded."""


_loaded = False
_error: str | None = None


def load() -> None:
    """Load hasten._C and register the ops' fakes and autograd, once. Raises ExtensionError (with
    the rebuild command) when the library is missing or broken. Cheap after the first call: the
    op wrappers call it, and under torch.compile it reads one global."""
    global _loaded, _error
    if _loaded:
        return
    if _error is not None:
        raise ExtensionError(_error)
    try:
        importlib.import_module("hasten._C")  # defines torch.ops.hasten.*
    except ImportError as exc:
        _error = f"hasten._C could not be loaded ({exc}); {REBUILD}"
        raise ExtensionError(_error) from exc
    for family in _FAMILIES:
        importlib.import_module(f"hasten.ops.{family}")._register()
    _loaded = True


# op name -> the autograd.Function eager calls take (see register_autograd)
_EAGER_FUNCTIONS: dict[str, type[torch.autograd.Function]] = {}


def register_autograd(name: str, backward, setup_context) -> None:
    """Register the formula (backward, setup_context) on hasten::<name> for torch.compile and
    AOTAutograd, and build from the same two functions the autograd.Function that eager calls
    take: the op's Python autograd kernel costs about twice the host time of an
    autograd.Function per call (measured, docs/design.md), and hasten's small-model steps are
    host-bound. One formula, two entry points; tests/ops/test_op_pattern.py compares them."""
    torch.library.register_autograd(f"hasten::{name}", backward, setup_context=setup_context)
    op = getattr(torch.ops.hasten, name).default

    def forward(ctx, *args):
        with torch._C._AutoDispatchBelowAutograd():  # straight to the CPU/CUDA kernel
            output = op(*args)
        setup_context(ctx, args, output)
        return output

    _EAGER_FUNCTIONS[name] = type(f"Eager_{name}", (torch.autograd.Function,),
                                  {"forward": staticmethod(forward), "backward": staticmethod(backward)})


def call(name: str, *args):
    """hasten::<name>(*args) with autograd: traced as the op under torch.compile, through the op's
    eager autograd.Function otherwise."""
    if torch.compiler.is_compiling():
        return getattr(torch.ops.hasten, name)(*args)
    return _EAGER_FUNCTIONS[name].apply(*args)


def call_in_backward(name: str, *args):
    """An op inside a backward formula. Without create_graph (grad mode off) it goes straight to
    the kernel; with it, through the op's autograd (a formula, or the refusal of a backward op)."""
    op = getattr(torch.ops.hasten, name)
    if torch.is_grad_enabled():
        return op(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def no_double_backward(op: str) -> None:
    """Register an autograd formula on a backward op (hasten::<op>) that refuses: hasten's
    kernels have no second derivative, and without a formula autograd would only warn and let
    a double backward (create_graph=True) through with a wrong, zero second derivative."""

    def refuse(ctx, *grads):
        raise NotImplementedError(f"hasten::{op} has no derivative: a second backward (create_graph=True, "
                                  "double backward) through hasten's kernels is not supported; run this model "
                                  "without hasten's kernels for it")

    torch.library.register_autograd(f"hasten::{op}", refuse)


def is_loaded() -> bool:
    """Whether hasten._C loads (tries to load it)."""
    try:
        load()
    except ExtensionError:
        return False
    return True


def extension_error() -> str | None:
    """Why hasten._C does not load (None when it does)."""
    return None if is_loaded() else _error


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

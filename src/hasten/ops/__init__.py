"""Typed wrappers over torch.ops.hasten.* (one module per op family). hasten._C loads on first use
(`load()`), not when this package is imported."""

from hasten.ops._lib import ExtensionError, extension_error, has_cuda_kernel, is_loaded, load, op_names

__all__ = ["ExtensionError", "extension_error", "has_cuda_kernel", "is_loaded", "load", "op_names"]

"""Typed wrappers over torch.ops.hasten.* (one module per op family)."""

from hasten.ops._lib import extension_error, has_cuda_kernel, is_loaded, op_names

__all__ = ["extension_error", "has_cuda_kernel", "is_loaded", "op_names"]

"""Python face of the C++ host memory pool (csrc/offload/host_pool.h)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hasten.ops._lib import load


@dataclass(frozen=True)
class HostPoolStats:
    in_use_bytes: int
    cached_bytes: int
    allocated_bytes: int
    hits: int
    misses: int
    pinned: bool

    @classmethod
    def from_values(cls, values) -> HostPoolStats:
        """From the C++ pool's stats(): [in_use_bytes, cached_bytes, allocated_bytes, hits, misses, pinned]."""
        in_use, cached, allocated, hits, misses, pinned = values
        return cls(in_use, cached, allocated, hits, misses, bool(pinned))


class HostPool:
    """Host buffers for offloaded activations, reused by size class instead of allocated per tensor.

    On CUDA builds the blocks are page-locked (cudaHostAlloc), so device<->host copies into them
    can run asynchronously on a copy stream. `max_cached_bytes` bounds what is kept for reuse.
    """

    def __init__(self, max_cached_bytes: int = 64 << 30) -> None:
        load()
        self._pool = torch.classes.hasten.HostPool(int(max_cached_bytes))

    def empty_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """An uninitialised CPU tensor with `tensor`'s shape and dtype, in a pooled block."""
        nbytes = tensor.numel() * tensor.element_size()
        return self._pool.acquire(nbytes).view(tensor.dtype).view(tensor.shape)

    def trim(self) -> int:
        """Free every cached block; returns the bytes given back."""
        return self._pool.trim()

    def set_limit(self, limit_bytes: int | None) -> None:
        """At most `limit_bytes` allocated (in use + cached): a miss frees cached blocks, largest
        first, before it allocates (None: no limit)."""
        self._pool.set_limit(-1 if limit_bytes is None else int(limit_bytes))

    def stats(self) -> HostPoolStats:
        return HostPoolStats.from_values(self._pool.stats())

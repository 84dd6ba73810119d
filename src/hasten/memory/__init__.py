"""Activation memory: checkpointing policies, the host memory pool, and activation offload
(hasten.memory.offload: the C++ engine's copy streams, per-layer hooks, double-buffered
prefetch) planned per layer (hasten.memory.planner)."""

from hasten.memory.checkpointing import POLICIES, apply_activation_checkpointing, selective_policy
from hasten.memory.host_pool import HostPool, HostPoolStats

__all__ = ["POLICIES", "HostPool", "HostPoolStats", "apply_activation_checkpointing", "selective_policy"]

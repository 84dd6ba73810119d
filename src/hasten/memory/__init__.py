"""Activation memory: checkpointing policies and the host memory pool for offload (the offload
engine itself, with copy streams and double buffering, is not built yet)."""

from hasten.memory.checkpointing import POLICIES, apply_activation_checkpointing, selective_policy
from hasten.memory.host_pool import HostPool, HostPoolStats

__all__ = ["POLICIES", "HostPool", "HostPoolStats", "apply_activation_checkpointing", "selective_policy"]

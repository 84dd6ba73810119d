"""Packed sequences: the collator, its batch sampler and the per-batch metadata."""

from hasten.packing.collator import IGNORE_INDEX, PackingCollator, PackingError, PackingStats
from hasten.packing.meta import PackedMeta, StaleMetadataError, move_batch
from hasten.packing.sampler import TokenBudgetBatchSampler

__all__ = ["IGNORE_INDEX", "PackedMeta", "PackingCollator", "PackingError", "PackingStats", "StaleMetadataError",
           "TokenBudgetBatchSampler", "move_batch"]

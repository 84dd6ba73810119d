"""hasten: training acceleration for fine-tuning LLMs with PyTorch and Hugging Face.

    import hasten
    handle = hasten.accelerate(model)            # patch in place; handle.undo() reverts
    collate = hasten.PackingCollator(max_tokens=16384)
"""

from hasten._version import __version__
from hasten.config import Config, ConfigError
from hasten.integrations.transformers import AccelerationHandle, accelerate
from hasten.packing.collator import PackingCollator, PackingStats
from hasten.packing.meta import PackedMeta

__all__ = [
    "AccelerationHandle",
    "Config",
    "ConfigError",
    "PackedMeta",
    "PackingCollator",
    "PackingStats",
    "__version__",
    "accelerate",
]

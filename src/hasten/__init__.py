"""hasten: training acceleration for fine-tuning LLMs with PyTorch and Hugging Face.

    import hasten
    handle = hasten.accelerate(model)            # patch in place; handle.undo() reverts
    collate = hasten.PackingCollator(max_tokens=16384)

`import hasten` changes nothing and loads neither transformers nor the op library (hasten._C):
each public name below is imported on first use, and `accelerate()` is what registers with
transformers and loads the ops (docs/design.md, "What import does").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from hasten._version import __version__

# public name -> the module that defines it, imported when the name is first read
_PUBLIC = {
    "AccelerationHandle": "hasten.integrations.transformers",
    "accelerate": "hasten.integrations.transformers",
    "Config": "hasten.config",
    "ConfigError": "hasten.config",
    "PackedMeta": "hasten.packing.meta",
    "PackingCollator": "hasten.packing.collator",
    "PackingStats": "hasten.packing.collator",
}

__all__ = sorted([*_PUBLIC, "__version__"])

if TYPE_CHECKING:
    from hasten.config import Config, ConfigError
    from hasten.integrations.transformers import AccelerationHandle, accelerate
    from hasten.packing.collator import PackingCollator, PackingStats
    from hasten.packing.meta import PackedMeta


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'hasten' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})

"""What a run records beside its loss: the version combination, GPU readings through NVML,
TensorBoard scalars, and the redaction that keeps secrets out of everything written."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any

import torch

from hasten.compat import installed_versions
from hasten.observability import logger

# Environment variable names that hold credentials (HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, ...).
_SECRET_ENV = re.compile(r"(token|secret|password|passwd|api[_-]?key|access[_-]?key|credential)", re.IGNORECASE)
# Keys whose value is a credential: the word ends the key (hf_token, api_key), unlike "tokens", "max_tokens".
_SECRET_KEY = re.compile(r"(^|[_-])(token|secret|password|passwd|api[_-]?key|access[_-]?key|credentials?)$",
                         re.IGNORECASE)
REDACTED = "***"


def _secret_env_values() -> list[str]:
    return [v for k, v in os.environ.items() if _SECRET_ENV.search(k) and len(v) >= 8]


def redact(value: Any, _secrets: list[str] | None = None) -> Any:
    """Copy of `value` with secret-named keys masked and any secret environment value masked
    inside strings (a token pasted into a path or a URL, say)."""
    secrets = _secret_env_values() if _secrets is None else _secrets
    if isinstance(value, dict):
        return {k: REDACTED if isinstance(k, str) and _SECRET_KEY.search(k) and v not in (None, "")
                else redact(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v, secrets) for v in value]
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, REDACTED)
        return value
    return value


def version_record() -> dict[str, Any]:
    """The deployment's version combination, written beside the metrics of every run."""
    record: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                              "torch_cuda": torch.version.cuda, "packages": installed_versions()}
    if torch.cuda.is_available():
        record["gpus"] = [{"name": torch.cuda.get_device_name(i),
                           "compute_capability": ".".join(map(str, torch.cuda.get_device_capability(i)))}
                          for i in range(torch.cuda.device_count())]
        nvml = _nvml()
        if nvml is not None:
            record["driver"] = nvml.nvmlSystemGetDriverVersion()
    return record


def _nvml():
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    return pynvml


class GpuMonitor:
    """Utilisation, memory, temperature and power of the training GPU, read per logging step."""

    def __init__(self, device: torch.device) -> None:
        self.handle = None
        if device.type != "cuda":
            return
        self.nvml = _nvml()
        if self.nvml is None:
            logger.info("hasten: GPU readings off (install nvidia-ml-py for utilisation, temperature and power)")
            return
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.handle = self.nvml.nvmlDeviceGetHandleByIndex(index)

    def read(self) -> dict[str, float] | None:
        if self.handle is None:
            return None
        nvml = self.nvml
        util = nvml.nvmlDeviceGetUtilizationRates(self.handle)
        memory = nvml.nvmlDeviceGetMemoryInfo(self.handle)
        return {"util_pct": float(util.gpu), "memory_used_gib": memory.used / 2**30,
                "temperature_c": float(nvml.nvmlDeviceGetTemperature(self.handle, nvml.NVML_TEMPERATURE_GPU)),
                "power_w": nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000.0}


class TensorBoardSink:
    """Scalars of each metrics row under log_dir/tensorboard, when tensorboard is installed.

    A row is one event holding all its scalars (one Summary with a value per key, what 17 calls of
    `add_scalar` wrote as 17 events), and the file is flushed by the writer's thread every
    FLUSH_SECONDS and at close, not after every row: with a row per step the per-scalar events and
    the flush (which waits for the writer's thread) were about 2.5 ms of each step's host time in
    cProfile on an H100 (the embedded default job, host-bound). metrics.jsonl is written per row;
    a killed run's TensorBoard file lacks at most its last FLUSH_SECONDS."""

    FLUSH_SECONDS = 10

    def __init__(self, log_dir: Path, enabled: str) -> None:
        self.writer = None
        if enabled == "false":
            return
        try:
            from tensorboard.compat.proto.summary_pb2 import Summary
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            if enabled == "true":
                logger.warning("hasten: logging.tensorboard is true but tensorboard is not installed (%s); "
                               "pip install tensorboard", exc)
            return
        self.summary = Summary
        self.writer = SummaryWriter(str(log_dir / "tensorboard"), flush_secs=self.FLUSH_SECONDS)

    def write(self, row: dict[str, Any]) -> None:
        if self.writer is None:
            return
        values = [self.summary.Value(tag=key, simple_value=float(value)) for key, value in flatten(row).items()
                  if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)]
        if values:  # what add_scalar writes per scalar (simple_value), in one event
            self.writer._get_file_writer().add_summary(self.summary(value=values), row["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def flatten(tree: dict[str, Any], separator: str = "/", prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level: {"a": {"b": 1}} -> {"a/b": 1} (TensorBoard tags; "." for config keys)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, separator, f"{prefix}{key}{separator}"))
        else:
            out[f"{prefix}{key}"] = value
    return out

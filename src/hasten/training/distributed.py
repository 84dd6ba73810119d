"""Distributed training on PyTorch's own engine: torchrun sets the ranks, hasten wraps the model
in DDP or FSDP2, shards the packed batches by rank and reduces the metrics onto rank 0.

    torchrun --nproc_per_node 8 -m hasten train --config c.yaml --output_dir out --resume auto
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\
             --max-restarts 3 -m hasten train ...      # elastic restarts resume from checkpoints
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from hasten.config import ConfigError
from hasten.observability import logger


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    strategy: str = "none"     # none | ddp | fsdp2
    tied_names: set[str] = field(default_factory=set)  # parameters saved once under another name

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        """A process group and a wrapped model, also for one process under torchrun with ddp/fsdp2."""
        return self.strategy != "none"


def from_environment(strategy: str, device: str = "auto") -> DistContext:
    """Join the process group torchrun describes (WORLD_SIZE, RANK, LOCAL_RANK); one process otherwise.

    `device` is the run's device type ("cuda", "cpu"; "auto": CUDA when visible): CUDA runs use
    NCCL and one GPU per local rank (a ConfigError when there are fewer GPUs than local ranks),
    CPU runs use gloo and touch no GPU.

    `torchrun --nproc_per_node 1` with ddp or fsdp2 named in the config runs that strategy over a
    group of one: the same code path and checkpoints as N processes, for trying a multi-GPU config
    on one GPU (and for measuring the wrapper's own cost). `auto` there, or no torchrun, is plain."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    under_launcher = "RANK" in os.environ and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ
    if world_size <= 1 and not (under_launcher and strategy in ("ddp", "fsdp2")):
        if strategy in ("ddp", "fsdp2"):
            logger.info("hasten: one process, not under torchrun: training.distributed %s is not used "
                        "(launch with torchrun to use it)", strategy)
        return DistContext()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device != "cpu" and torch.cuda.is_available()
    if use_cuda:
        gpus = torch.cuda.device_count()
        if local_rank >= gpus:
            local_world = os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1))
            raise ConfigError(f"torchrun started {local_world} processes on this machine (this one is local rank "
                              f"{local_rank}) but {gpus} CUDA GPU(s) are visible, and each process needs a GPU of its "
                              f"own; launch torchrun with --nproc_per_node {gpus}, or train on the CPU over gloo with "
                              "--device cpu (training.device: cpu)")
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        device_id = torch.device("cuda", local_rank) if backend == "nccl" else None
        store = restart_scoped_store(os.environ, world_size)
        if store is None:
            dist.init_process_group(backend, device_id=device_id)
        else:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, device_id=device_id)
    chosen = "ddp" if strategy == "auto" else strategy
    if chosen == "none":
        raise ConfigError(f"training.distributed is 'none' but torchrun started {world_size} processes; use ddp, "
                          "fsdp2 or auto")
    return DistContext(rank, world_size, local_rank, chosen)


def restart_scoped_store(environ, world_size: int, timeout: timedelta = timedelta(minutes=10)):
    """The agent's TCPStore with this restart's keys under their own prefix, or None outside torchelastic.

    torchrun's static rendezvous (its default without --rdzv-backend) hands every restart of the
    workers the same agent store, and the workers add no per-attempt prefix (torch's
    rendezvous.py assumes a new store per retry, true only of the c10d backend). After a restart
    rank 1 could then read the dead attempt's NCCL unique id and dial the old rank 0's port:
    "socketPollConnect ... Connection refused" in the first collective (seen on 2xH200, a296f65).
    TORCHELASTIC_RESTART_COUNT is the same on every worker of one attempt, so it names the attempt.
    """
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    attempt = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    agent_store = dist.TCPStore(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), world_size,
                                is_master=False, timeout=timeout)
    return dist.PrefixStore(f"hasten/attempt_{attempt}", agent_store)


def tied_parameter_names(model: torch.nn.Module) -> set[str]:
    """Names of parameters that share storage with an earlier one (saved once by save_pretrained)."""
    seen: dict[int, str] = {}
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.data_ptr() in seen:
            tied.add(name)
        else:
            seen[param.data_ptr()] = name
    return tied


# FSDP2 spends host time on each unit every step (hooks, parameter swaps, DTensor gradients): each
# unit added about 3.4 ms to the step on the H200 machine (Qwen3-0.6B shape, 4406d10), whose host
# already spends most of a plain step launching each 15.7M-parameter layer's ~4.6 ms of kernels. One
# unit per layer left the GPU waiting for the host (0.65x the plain loop, one process); 4 layers per
# unit (63M parameters): 0.91-0.93x.
AUTO_UNIT_PARAMETERS = 50_000_000


def layers_per_fsdp2_unit(layers: list[torch.nn.Module], requested: int) -> int:
    """`requested`, or for 0 (auto) the fewest consecutive layers that hold AUTO_UNIT_PARAMETERS."""
    if requested > 0:
        return requested
    per_layer = max(1, max(sum(p.numel() for p in layer.parameters()) for layer in layers))
    return max(1, min(len(layers), -(-AUTO_UNIT_PARAMETERS // per_layer)))


def wrap_model(model: torch.nn.Module, ctx: DistContext, device: torch.device,
               reshard_after_forward: bool = True, layers_per_unit: int = 0) -> torch.nn.Module:
    if not ctx.enabled:
        return model
    ctx.tied_names = tied_parameter_names(model)
    if ctx.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if ctx.strategy == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (ctx.world_size,))
        # a PEFT model (LoRA) wraps the transformers model: its layers are the base model's
        base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
        layers = getattr(getattr(base, "model", None), "layers", None)
        if layers is None:
            raise ConfigError("training.distributed fsdp2 shards per decoder layer and this model has no "
                              "model.layers; use ddp")
        layers = list(layers)
        layers_per_unit = layers_per_fsdp2_unit(layers, layers_per_unit)
        if ctx.is_main:
            logger.info("hasten: fsdp2 shards %d decoder layers in units of %d (training.fsdp2_layers_per_unit)",
                        len(layers), layers_per_unit)
        # a unit is `layers_per_unit` consecutive layers; a unit is named by its first layer
        units = [layers[i:i + layers_per_unit] for i in range(0, len(layers), layers_per_unit)]
        for unit in units:
            fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh)
        if ctx.is_main:
            held, whole = _parameter_bytes(model)
            logger.info("hasten: fsdp2 keeps %.3g MiB of the model's %.3g MiB of parameters on each rank (4-bit "
                        "weights as their packed bytes)", held / 2**20, whole / 2**20)
        # Each unit asks for its neighbour's all-gather when it starts (the next unit's in forward,
        # the previous unit's in backward), so the copy overlaps this unit's compute even when the
        # host is not running ahead of the GPU.
        for i, unit in enumerate(units):
            if i + 1 < len(units):
                unit[0].set_modules_to_forward_prefetch([units[i + 1][0]])
            if i > 0:
                unit[0].set_modules_to_backward_prefetch([units[i - 1][0]])
        return model
    raise ConfigError(f"unknown training.distributed strategy {ctx.strategy!r}")


def _parameter_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of parameters this rank holds, bytes of the whole parameters) of an FSDP2 model."""
    from torch.distributed.tensor import DTensor

    held = whole = 0
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        held += local.numel() * local.element_size()
        whole += param.numel() * param.element_size()
    return held, whole


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, ctx: DistContext, last_micro_batch: bool) -> Iterator[None]:
    """Gradient accumulation talks across ranks once per optimizer step: the micro-batches before
    the last keep their gradients local (DDP's no_sync; FSDP2 skips the reduce-scatter and keeps
    each layer's gathered weights from one backward to the next forward), and the last one's
    backward reduces the accumulated sum. Same result as reducing every micro-batch, up to float
    summation order."""
    if not ctx.enabled or last_micro_batch:
        yield
    elif ctx.strategy == "ddp":
        with model.no_sync():
            yield
    else:  # fsdp2, the only other strategy wrap_model accepts
        model.set_requires_gradient_sync(False)
        model.set_reshard_after_backward(False)
        try:
            yield
        finally:  # the last micro-batch reduces and reshards as usual
            model.set_requires_gradient_sync(True)
            model.set_reshard_after_backward(True)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)


def all_reduce_sum(values: list[float], ctx: DistContext, device: torch.device) -> list[float]:
    """Sum of each value over ranks (one small collective; called per logging step only)."""
    if not ctx.enabled:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(tensor)
    return tensor.tolist()


def barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        dist.barrier()


def shutdown(ctx: DistContext, wait_for_ranks: bool = True) -> None:
    """Leave the process group. `wait_for_ranks` False (after an error) skips the final barrier,
    which a rank that failed alone would wait at for ever."""
    if ctx.enabled and dist.is_initialized():
        # every rank leaves together: a rank that tore its group down while another was still
        # saving aborted at exit ("terminate called without an active exception", gloo, 1 in ~10 runs)
        if wait_for_ranks:
            dist.barrier()
        dist.destroy_process_group()

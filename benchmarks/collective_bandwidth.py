"""Bandwidth of the collectives FSDP2 runs, between the GPUs of one host: all-gather and
reduce-scatter of a model-sized bf16 buffer, and the link the GPUs report (NVLink peer access or
not). Tells whether FSDP2's per-layer traffic can hide behind compute on this machine.

    torchrun --nproc_per_node 2 benchmarks/collective_bandwidth.py [--mib 1200]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist


def timed(fn, iters: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=1200, help="size of the gathered (whole) buffer")
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    world = dist.get_world_size()
    numel = args.mib * 2**20 // 2 // world * world
    whole = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
    shard = torch.ones(numel // world, dtype=torch.bfloat16, device="cuda")
    gather_s = timed(lambda: dist.all_gather_into_tensor(whole, shard))
    scatter_s = timed(lambda: dist.reduce_scatter_tensor(shard, whole))
    if dist.get_rank() == 0:
        peers = [torch.cuda.can_device_access_peer(0, d) for d in range(1, torch.cuda.device_count())]
        moved = numel * 2 * (world - 1) / world  # bytes each rank receives
        print(f"{world} GPUs, peer access from GPU 0: {peers}; buffer {numel * 2 / 2**20:.0f} MiB bf16")
        print(f"all_gather     {gather_s * 1e3:8.2f} ms  {moved / gather_s / 1e9:7.1f} GB/s per rank")
        print(f"reduce_scatter {scatter_s * 1e3:8.2f} ms  {moved / scatter_s / 1e9:7.1f} GB/s per rank")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

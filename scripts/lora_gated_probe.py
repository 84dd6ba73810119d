"""The gated MLP's one-pass backward (csrc/kernels/lora_grads.cuh, LoraGatedGradsParams) at W4's MLP
shape (16,384 tokens, hidden 4096, intermediate 14,336, gate/up LoRA rank 16, PEFT's float32
adapters), against the separate path it replaces (the SwiGLU backward kernel, then the group's
two thin passes, HASTEN_LORA_GATED_KERNEL=0): the GPU time of each kernel hasten::
lora_gated_group_backward launches, per path. Everything else it launches (the base GEMMs' d x, d A)
is the same on both paths, so the difference of the totals is what the one pass saves; the rate
is the one pass's bytes (gate, up and d act read, d gate and d up written) over its time.

    python scripts/lora_gated_probe.py [--tokens 16384] [--inner 14336] [--hidden 4096]
"""

from __future__ import annotations

import argparse
import os

import torch

import hasten.ops
from lora_grads_probe import kernel_us


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--inner", type=int, default=14336)
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args()
    hasten.ops.load()
    torch.manual_seed(0)
    t, n, h, rank = args.tokens, args.inner, args.hidden, 16
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x, grad_act = torch.randn(t, h, **bf16), torch.randn(t, n, **bf16)
    gate, up = torch.randn(t, n, **bf16), torch.randn(t, n, **bf16)
    weights = [torch.randn(n, h, **bf16) / h ** 0.5 for _ in range(2)]
    lora_a = [torch.randn(rank, h, device="cuda") / h ** 0.5 for _ in range(2)]
    lora_b = [torch.randn(n, rank, device="cuda") / rank ** 0.5 for _ in range(2)]
    xa = x @ torch.cat([a.bfloat16() for a in lora_a]).t()

    def run():
        return torch.ops.hasten.lora_gated_group_backward(grad_act, gate, up, x, weights, lora_a, lora_b, xa,
                                                          [2.0, 2.0], "silu")

    totals = {}
    for label, switch in (("one pass", None), ("separate", "0")):
        if switch is None:
            os.environ.pop("HASTEN_LORA_GATED_KERNEL", None)
        else:
            os.environ["HASTEN_LORA_GATED_KERNEL"] = switch
        per_kernel = kernel_us(run)
        totals[label] = sum(per_kernel.values())
        print(f"{label}: all kernels {totals[label]:8.1f} us")
        for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:8]:
            print(f"    {us:8.1f} us  {name[:110]}")
        gated = sum(us for name, us in per_kernel.items() if "lora_gated_grads_kernel" in name)
        if gated:
            print(f"    one pass at {5 * t * n * 2 / gated / 1e6:.2f} TB/s (5 x T x N bf16 over its time)")
    os.environ.pop("HASTEN_LORA_GATED_KERNEL", None)
    print(f"one pass saves {totals['separate'] - totals['one pass']:.1f} us a layer "
          f"({(totals['separate'] - totals['one pass']) * 32 / 1e3:.2f} ms over 32 layers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

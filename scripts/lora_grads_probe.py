"""The LoRA backward's one-pass kernel (csrc/kernels/lora_grads_kernel.cu) at W4's projection
shapes, against the two GEMMs it replaces: per shape and configuration, the GPU time of all of
hasten::lora_linear_backward's kernels (the base GEMM d x = g W and the rest are the same on both
paths, so the difference is what the one pass saves), the one-pass kernel's own time and the read
rate of g it reaches, and the error of d lora_a and d lora_b against float64.
HASTEN_LORA_GRADS_CONFIG=0 picks the plain kernel (4, the lean one, is the default), =0 in
HASTEN_LORA_GRADS_KERNEL the GEMMs.

    python scripts/lora_grads_probe.py [--configs 0,4] [--tokens 16384] [--shape 4096,14336]

Configs: 0 the plain kernel (32 rows x 2 stages; 16 x 4, 32 x 3, 16 x 6 and 64 x 2 measured no
faster and were taken out), 4 the lean one, the default since b368b90 (fixed copy positions, B in
registers, padded partial sums: 2.2-2.5 TB/s of g against the plain one's 2.0-2.15 at 8c3886c).
"""

from __future__ import annotations

import argparse
import os

import torch

import hasten.ops

SHAPES = [(4096, 1024, 16), (4096, 4096, 16), (4096, 14336, 16), (14336, 4096, 16)]  # (in, out, rank)


def kernel_us(run, iters: int = 10) -> dict[str, float]:
    """GPU microseconds a call of each kernel the call launches."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            run()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] = per_kernel.get(event.name, 0.0) + event.device_time / iters
    return per_kernel


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="0,4")
    parser.add_argument("--shape", default="", help="in,out: that projection shape only (rank 16), e.g. for ncu")
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args()
    hasten.ops.load()
    torch.manual_seed(0)
    shapes = [(*map(int, args.shape.split(",")), 16)] if args.shape else SHAPES
    for n_in, n_out, rank in shapes:
        t = args.tokens
        x = torch.randn(t, n_in, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(t, n_out, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16) / n_in ** 0.5
        a = torch.randn(rank, n_in, device="cuda") / n_in ** 0.5
        b = torch.randn(n_out, rank, device="cuda") / rank ** 0.5
        xa = x @ a.to(x.dtype).t()
        scale = 2.0
        gb64 = scale * g.double() @ b.to(x.dtype).double()
        want_a = gb64.t() @ x.double()
        want_b = scale * g.double().t() @ xa.double()

        def run():
            return torch.ops.hasten.lora_linear_backward(g, x, w, a, b, xa, scale, True)

        os.environ["HASTEN_LORA_GRADS_KERNEL"] = "0"
        gemms_total = sum(kernel_us(run).values())
        out = run()
        errors = (float((out[2].double() - want_a).norm() / want_a.norm()),
                  float((out[3].double() - want_b).norm() / want_b.norm()))
        read = t * n_out * 2
        label = f"T {t} in {n_in} out {n_out} r {rank}"
        print(f"{label:36s} two GEMMs   all kernels {gemms_total:8.1f} us  "
              f"errors dA {errors[0]:.2e} dB {errors[1]:.2e}", flush=True)
        del os.environ["HASTEN_LORA_GRADS_KERNEL"]
        for config in args.configs.split(","):
            os.environ["HASTEN_LORA_GRADS_CONFIG"] = config
            kernels = kernel_us(run)
            total = sum(kernels.values())
            one_pass = sum(us for name, us in kernels.items() if "lora_grads" in name)
            out = run()
            errors = (float((out[2].double() - want_a).norm() / want_a.norm()),
                      float((out[3].double() - want_b).norm() / want_b.norm()))
            split = ", ".join(f"{'sum' if 'sum' in n else 'pass'} {us:.1f}" for n, us in kernels.items()
                              if "lora_grads" in n)
            print(f"{label:36s} config {config:2s}  all kernels {total:8.1f} us, saves {gemms_total - total:7.1f}; "
                  f"one pass {one_pass:6.1f} us ({split}), {read / max(one_pass, 1e-3) / 1e6:4.2f} TB/s of g  "
                  f"errors dA {errors[0]:.2e} dB {errors[1]:.2e}", flush=True)
        os.environ.pop("HASTEN_LORA_GRADS_CONFIG", None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""GEMM shapes around W4's LoRA backward that cuBLAS runs below the bandwidth or tensor-core rate
(one H200, W4's profile): what another orientation or a merged call would take. Pure torch, no
hasten build needed; prints microseconds per call.

  d A over a group (R, in) from gb (T, R) and x (T, in), K = T: as gb^T x (what lora_backward.h
      runs; cuBLAS picks 16x128 tiles, ~76 us, 1.7 TB/s of x) against (x^T gb)^T
  k and v's d x: two (T, 1024) @ (1024, 4096) accumulating GEMMs (72% of the clock's peak)
      against one over the concatenated K = 2048

    python scripts/lora_gemm_orientation_probe.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from common import time_us  # noqa: E402  (torch only: no hasten build needed)


def main() -> None:
    tokens, hidden, kv = 16384, 4096, 1024
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, hidden, **bf16)
    for ranks in (48, 32, 16):
        gb = torch.randn(tokens, ranks, **bf16)
        now = time_us(lambda: torch.mm(gb.t(), x, out_dtype=torch.float32))
        flipped = time_us(lambda: torch.mm(x.t(), gb, out_dtype=torch.float32).t().contiguous())
        want = torch.mm(gb.t().float(), x.float())
        err = (torch.mm(x.t(), gb, out_dtype=torch.float32).t() - want).abs().max().item()
        print(f"d A (R={ranks}): gb^T x {now:7.1f} us ({x.numel() * 2 / now / 1e6:.2f} TB/s of x), "
              f"(x^T gb)^T {flipped:7.1f} us; max diff of the flipped one to float32 {err:.2e}")
    gk, gv = torch.randn(tokens, kv, **bf16), torch.randn(tokens, kv, **bf16)
    wk, wv = torch.randn(kv, hidden, **bf16), torch.randn(kv, hidden, **bf16)
    gkv, wkv = torch.cat([gk, gv], 1), torch.cat([wk, wv], 0)
    out = torch.randn(tokens, hidden, **bf16)
    two = time_us(lambda: (out.addmm_(gk, wk), out.addmm_(gv, wv)))
    one = time_us(lambda: out.addmm_(gkv, wkv))
    flops = 2 * tokens * 2 * kv * hidden
    print(f"k and v d x: two K=1024 GEMMs {two:7.1f} us ({flops / two / 1e6:.0f} TFLOP/s), one K=2048 "
          f"{one:7.1f} us ({flops / one / 1e6:.0f} TFLOP/s)")


if __name__ == "__main__":
    main()

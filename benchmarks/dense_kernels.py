"""hasten's dense kernels alone at W1's shapes (Qwen3-0.6B, 16,384 packed tokens, bf16): time per
call of each forward and backward kernel, the bandwidth that implies from the bytes each must move
at least, and plain PyTorch's forward + backward of the same op for comparison. Shows which kernel
is off the memory roofline (an H200 moves about 4.8 TB/s at best, ~4 TB/s in practice).

    python benchmarks/dense_kernels.py [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import hasten.ops  # noqa: E402

hasten.ops.load()  # hasten._C and the ops' fakes and autograd (the package loads it on first use)

TOKENS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 16384, 1024, 16, 8, 128, 3072
BF16 = 2


def time_us(fn, iters: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def eager_rms_norm(x, w, eps=1e-6):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_rows(name: str, rows: int, hidden: int) -> list[dict]:
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(x)
    y, rstd = torch.ops.hasten.rms_norm(x, w, 1e-6, 0.0)
    size = x.numel() * BF16
    fwd = time_us(lambda: torch.ops.hasten.rms_norm(x, w, 1e-6, 0.0))
    bwd = time_us(lambda: torch.ops.hasten.rms_norm_backward(g, x, w, rstd, 0.0))
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    eager = time_us(lambda: torch.autograd.grad(eager_rms_norm(xr, wr), (xr, wr), g))
    return [{"kernel": f"{name} forward", "us": fwd, "min_bytes": 2 * size},
            {"kernel": f"{name} backward", "us": bwd, "min_bytes": 3 * size},
            {"kernel": f"{name} eager fwd+bwd", "us": eager, "min_bytes": 5 * size}]


def swiglu_rows() -> list[dict]:
    gate, up = (torch.randn(TOKENS, INTERMEDIATE, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    grad = torch.randn_like(gate)
    size = gate.numel() * BF16
    fwd = time_us(lambda: torch.ops.hasten.silu_mul(gate, up))
    bwd = time_us(lambda: torch.ops.hasten.silu_mul_backward(grad, gate, up))
    gr, ur = gate.detach().requires_grad_(), up.detach().requires_grad_()
    eager = time_us(lambda: torch.autograd.grad(torch.nn.functional.silu(gr) * ur, (gr, ur), grad))
    return [{"kernel": "swiglu forward", "us": fwd, "min_bytes": 3 * size},
            {"kernel": "swiglu backward", "us": bwd, "min_bytes": 5 * size},
            {"kernel": "swiglu eager fwd+bwd", "us": eager, "min_bytes": 8 * size}]


def rope_rows() -> list[dict]:
    q = torch.randn(1, HEADS, TOKENS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    cos, sin = (torch.randn(1, TOKENS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    size = q.numel() * BF16
    fwd = time_us(lambda: torch.ops.hasten.rope(q, cos, sin, False, False))
    return [{"kernel": "rope q forward", "us": fwd, "min_bytes": 2 * size}]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(common.RESULTS))
    args = parser.parse_args()
    rows = (rms_rows("rms_norm hidden (16384 x 1024)", TOKENS, HIDDEN)
            + rms_rows("rms_norm q heads (262144 x 128)", TOKENS * HEADS, HEAD_DIM)
            + swiglu_rows() + rope_rows())
    run_id = common.new_run_id()
    for row in rows:
        row.update({"workload": "W1_kernels", "variant": "hasten" if "eager" not in row["kernel"] else "eager",
                    **common.environment(), "run_id": run_id, "tb_per_s": row["min_bytes"] / row["us"] / 1e6})
        print(f"{row['kernel']:42s} {row['us']:8.1f} us  {row['tb_per_s']:5.2f} TB/s of the least traffic")
    common.write_rows(rows, "W1_kernels", Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

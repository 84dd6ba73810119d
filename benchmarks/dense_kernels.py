"""hasten's dense kernels alone at a workload's shapes (16,384 packed tokens, bf16): time per call
of each forward and backward kernel, the bandwidth that implies from the bytes each must move at
least, and plain PyTorch's forward + backward of the same op for comparison. Shows which kernel
is off the memory roofline: the same run times a device-to-device copy and an elementwise add (the
ceilings; an H200 copies about 4.3 TB/s, reads plus writes).

  --shape w1  Qwen3-0.6B (W1): hidden 1024, 16/8 heads of 128 with q/k norms, intermediate 3072; the
              q/k norms with the rotary after them also as one kernel (hasten::rms_norm_rope) against
              the two it replaces, and the loss's row kernel on one chunk of its logits, one block a
              row against a cluster holding the row (HASTEN_CE_CLUSTER=1)
  --shape w4  Llama-8B (W4, LoRA): hidden 4096, 32/8 heads, intermediate 14336; the norms' weights
              are frozen there, so their backward computes no weight gradient

    python benchmarks/dense_kernels.py [--shape w1|w4] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import hasten.ops  # noqa: E402

hasten.ops.load()  # hasten._C and the ops' fakes and autograd (the package loads it on first use)

TOKENS = 16384
# workload: (hidden, heads, kv heads, head_dim, intermediate, norms' weights trainable, q/k norms)
SHAPES = {"w1": (1024, 16, 8, 128, 3072, True, True), "w4": (4096, 32, 8, 128, 14336, False, False)}
BF16 = 2


def eager_rms_norm(x, w, eps=1e-6):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def ceiling_rows(hidden: int) -> list[dict]:
    """What plain memory traffic reaches on (TOKENS, hidden) bf16: a copy and an add."""
    x, y = (torch.randn(TOKENS, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(x)
    size = x.numel() * BF16
    return [{"kernel": f"copy ({TOKENS} x {hidden})", "us": common.time_us(lambda: out.copy_(x)),
             "min_bytes": 2 * size},
            {"kernel": f"add ({TOKENS} x {hidden})", "us": common.time_us(lambda: torch.add(x, y, out=out)),
             "min_bytes": 3 * size}]


def rms_rows(name: str, rows: int, hidden: int, weight_grad: bool = True) -> list[dict]:
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(x)
    y, rstd = torch.ops.hasten.rms_norm(x, w, 1e-6, 0.0)
    size = x.numel() * BF16
    fwd = common.time_us(lambda: torch.ops.hasten.rms_norm(x, w, 1e-6, 0.0))
    bwd = common.time_us(lambda: torch.ops.hasten.rms_norm_backward(g, x, w, rstd, 0.0, weight_grad))
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_(weight_grad)
    inputs = (xr, wr) if weight_grad else (xr,)
    eager = common.time_us(lambda: torch.autograd.grad(eager_rms_norm(xr, wr), inputs, g))
    frozen = "" if weight_grad else ", frozen weight"
    # the residual add fused in (hasten::add_rms_norm, a decoder layer's post-attention norm): x and
    # the residual read, the sum and the output written; its backward also reads the gradient the
    # sum gets from the residual stream (grad_add)
    r = torch.randn_like(x)
    add_fwd = common.time_us(lambda: torch.ops.hasten.add_rms_norm(x, r, w, 1e-6, 0.0))
    add_bwd = common.time_us(lambda: torch.ops.hasten.rms_norm_backward(g, x, w, rstd, 0.0, weight_grad, r))
    return [{"kernel": f"{name} forward", "us": fwd, "min_bytes": 2 * size},
            {"kernel": f"{name} backward{frozen}", "us": bwd, "min_bytes": 3 * size},
            {"kernel": f"{name} eager fwd+bwd", "us": eager, "min_bytes": 5 * size},
            {"kernel": f"{name} + residual add forward", "us": add_fwd, "min_bytes": 4 * size},
            {"kernel": f"{name} + residual add backward{frozen}", "us": add_bwd, "min_bytes": 4 * size}]


def swiglu_rows(intermediate: int) -> list[dict]:
    gate, up = (torch.randn(TOKENS, intermediate, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    grad = torch.randn_like(gate)
    size = gate.numel() * BF16
    fwd = common.time_us(lambda: torch.ops.hasten.silu_mul(gate, up))
    bwd = common.time_us(lambda: torch.ops.hasten.silu_mul_backward(grad, gate, up))
    gr, ur = gate.detach().requires_grad_(), up.detach().requires_grad_()
    eager = common.time_us(lambda: torch.autograd.grad(torch.nn.functional.silu(gr) * ur, (gr, ur), grad))
    return [{"kernel": "swiglu forward", "us": fwd, "min_bytes": 3 * size},
            {"kernel": "swiglu backward", "us": bwd, "min_bytes": 5 * size},
            {"kernel": "swiglu eager fwd+bwd", "us": eager, "min_bytes": 8 * size}]


def rope_rows(heads: int, kv_heads: int, head_dim: int) -> list[dict]:
    """q and k as the attention hands them over: (1, heads, T, D) views of (1, T, heads, D)
    projections, cos and sin (1, T, D) in bf16."""
    cos, sin = (torch.randn(1, TOKENS, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    rows = []
    for name, n in (("q", heads), ("k", kv_heads)):
        x = torch.randn(1, TOKENS, n, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        size = x.numel() * BF16
        for direction, backward in (("forward", False), ("backward", True)):
            us = common.time_us(lambda: torch.ops.hasten.rope(x, cos, sin, backward, False))
            rows.append({"kernel": f"rope {name} ({n} heads) {direction}", "us": us, "min_bytes": 2 * size})
    return rows


def norm_rope_rows(heads: int, kv_heads: int, head_dim: int) -> list[dict]:
    """The head norm and the rotary after it (hasten::rms_norm_rope, kernels.fused_qk_norm_rope) on
    q and k as Qwen3's attention hands them over, against the two kernels it replaces (rms_norm on
    the (T, heads, D) projection, then rope on its transposed view), each way."""
    cos, sin = (torch.randn(1, TOKENS, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(head_dim, device="cuda", dtype=torch.bfloat16)
    rows = []
    for name, n in (("q", heads), ("k", kv_heads)):
        projection = torch.randn(1, TOKENS, n, head_dim, device="cuda", dtype=torch.bfloat16)
        x, g = projection.transpose(1, 2), torch.randn_like(projection).transpose(1, 2)
        size = x.numel() * BF16
        _, rstd = torch.ops.hasten.rms_norm_rope(x, w, cos, sin, 1e-6, 0.0, False)
        _, rstd_rows = torch.ops.hasten.rms_norm(projection, w, 1e-6, 0.0)  # (1, T, heads): the norm's own rows
        fused_fwd = common.time_us(lambda: torch.ops.hasten.rms_norm_rope(x, w, cos, sin, 1e-6, 0.0, False))
        fused_bwd = common.time_us(
            lambda: torch.ops.hasten.rms_norm_rope_backward(g, x, w, rstd, cos, sin, 0.0, False, True))

        def separate_forward():
            y, _ = torch.ops.hasten.rms_norm(projection, w, 1e-6, 0.0)
            return torch.ops.hasten.rope(y.transpose(1, 2), cos, sin, False, False)

        def separate_backward():
            grad_y = torch.ops.hasten.rope(g, cos, sin, True, False).transpose(1, 2)
            return torch.ops.hasten.rms_norm_backward(grad_y, projection, w, rstd_rows, 0.0, True)

        rows += [{"kernel": f"norm+rope {name} ({n} heads) forward", "us": fused_fwd, "min_bytes": 2 * size},
                 {"kernel": f"norm+rope {name} ({n} heads) backward", "us": fused_bwd, "min_bytes": 3 * size},
                 {"kernel": f"norm, rope {name} ({n} heads) forward, separate", "us": common.time_us(separate_forward),
                  "min_bytes": 2 * size},
                 {"kernel": f"norm, rope {name} ({n} heads) backward, separate",
                  "us": common.time_us(separate_backward), "min_bytes": 3 * size}]
    return rows


def cross_entropy_rows(vocab: int, rows: int = 3533) -> list[dict]:
    """The fused loss's row kernel on one chunk of W1's LM-head logits (rows x vocab, bf16, the
    gradient written in place), with the one-block kernel (two reads of the row from memory and a
    write) and with HASTEN_CE_CLUSTER=1 (the row in a cluster's shared memory: one read and a
    write; sm_90). Bandwidth against the least traffic, one read and one write."""
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    scale = torch.tensor([1.0 / rows], device="cuda")
    size = logits.numel() * BF16
    out = []
    for name, cluster in (("one block a row", "0"), ("cluster (HASTEN_CE_CLUSTER=1)", "1")):
        os.environ["HASTEN_CE_CLUSTER"] = cluster
        try:
            us = common.time_us(lambda: torch.ops.hasten.cross_entropy_rows_(logits, targets, scale, -100, 0.0, 0.0))
        finally:
            os.environ.pop("HASTEN_CE_CLUSTER", None)
        out.append({"kernel": f"cross_entropy rows ({rows} x {vocab}), {name}", "us": us, "min_bytes": 2 * size})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="w1")
    parser.add_argument("--out", default=str(common.RESULTS))
    args = parser.parse_args()
    hidden, heads, kv_heads, head_dim, intermediate, norm_weight_grad, qk_norms = SHAPES[args.shape]
    rows = ceiling_rows(hidden) + rms_rows(f"rms_norm hidden ({TOKENS} x {hidden})", TOKENS, hidden, norm_weight_grad)
    if qk_norms:
        rows += rms_rows(f"rms_norm q heads ({TOKENS * heads} x {head_dim})", TOKENS * heads, head_dim)
    rows += swiglu_rows(intermediate) + rope_rows(heads, kv_heads, head_dim)
    if qk_norms:
        rows += norm_rope_rows(heads, kv_heads, head_dim)
    if args.shape == "w1":
        rows += cross_entropy_rows(151936)
    workload = f"{args.shape.upper()}_kernels"
    run_id = common.new_run_id()
    for row in rows:
        variant = "eager" if "eager" in row["kernel"] else "torch" if row["kernel"].startswith(("copy", "add")) else "hasten"
        row.update({"workload": workload, "variant": variant,
                    **common.environment(), "run_id": run_id, "tb_per_s": row["min_bytes"] / row["us"] / 1e6})
        print(f"{row['kernel']:42s} {row['us']:8.1f} us  {row['tb_per_s']:5.2f} TB/s of the least traffic")
    common.write_rows(rows, workload, Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

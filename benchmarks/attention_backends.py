"""Packed causal attention on W1's shapes: torch's varlen (FlashAttention-2, hasten's backend) against
cuDNN's ragged SDPA through torch's private aten ops, forward + backward, and how far cuDNN's results
are from FlashAttention's. On torch 2.11 + H200 (2026-11-30) cuDNN's forward agreed and its kernels
took half FlashAttention-2's time, but its gradients were wrong (dq off by 100%) and every call
rebuilt a cuDNN graph (about 50 ms of host time): hasten does not use it. Re-run on a new torch.

W1's batch: 16,384 tokens in 61 packed samples (benchmarks/packed_sft.py's lengths), 16 query heads,
8 K/V heads, head_dim 128, bf16. Each backend runs with the 8 K/V heads read natively (gqa) and
repeated to 16 (rep). Each row: milliseconds per forward + backward of one
layer (median of 20) and the largest difference from FlashAttention in out, dq, dk, dv relative
to each tensor's largest magnitude.

    python benchmarks/attention_backends.py [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from packed_sft import TOKENS, make_samples  # noqa: E402

from hasten.attention.varlen import varlen_attention  # noqa: E402
from hasten.observability import fallback_counts, fallback_reasons, reset_fallbacks  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128


def torch_varlen(gqa: str):
    def attention(q, k, v, cu, max_len):
        return varlen_attention(q, k, v, cu, max_len, backend="torch_varlen", gqa=gqa)
    return attention


class CudnnRagged(torch.autograd.Function):
    """cuDNN's fused attention over ragged sequences through torch's private aten ops (torch keeps
    this path switched off in its own varlen_attn)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len):
        out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False)
        ctx.save_for_backward(q, k, v, out, lse, cu, seed, offset)
        ctx.max_len = max_len
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(  # attn_bias None: an undefined tensor
            grad.contiguous(), q, k, v, out, lse, seed, offset, None, cu, cu, ctx.max_len, ctx.max_len, 0.0, True)
        return dq, dk, dv, None, None


def cudnn(gqa: str):
    def attention(q, k, v, cu, max_len):
        if gqa == "repeat":
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return CudnnRagged.apply(q, k, v, cu, max_len)
    return attention


def run(fn, q, k, v, cu, max_len, grad):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, cu, max_len)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(common.RESULTS))
    args = parser.parse_args()
    lengths = [len(s) for s in make_samples()]
    assert sum(lengths) == TOKENS
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    max_len = max(lengths)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(TOKENS, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(TOKENS, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(TOKENS, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    grad = torch.randn(TOKENS, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    reference = run(torch_varlen("native"), q, k, v, cu, max_len, grad)
    run_id = common.new_run_id()
    rows = []
    variants = (("flash_varlen", torch_varlen("native")), ("flash_varlen_rep", torch_varlen("repeat")),
                ("cudnn_gqa", cudnn("native")), ("cudnn_rep", cudnn("repeat")))
    for name, fn in variants:
        reset_fallbacks()
        base = {"workload": "W1_attention", "variant": name, **common.environment(), "run_id": run_id}
        try:
            got = run(fn, q, k, v, cu, max_len, grad)
            diffs = {label: float((g.float() - r.float()).abs().max() / r.float().abs().max())
                     for label, g, r in zip(("out", "dq", "dk", "dv"), got, reference)}
            times = common.time_steps(lambda: run(fn, q, k, v, cu, max_len, grad), warmup=3, iters=20)
            ms = common.median(times) * 1e3
            print(f"{name:14s} {ms:7.3f} ms fwd+bwd   rel diff vs flash: "
                  + ", ".join(f"{key} {val:.2e}" for key, val in diffs.items()))
            if fallback_counts():
                print(f"{name:14s} fell back: {fallback_reasons()}")
            rows.append(base | {"fwd_bwd_ms": ms, "rel_diff": diffs, "correct": max(diffs.values()) < 2e-2,
                                "fallbacks": fallback_counts()})
        except (RuntimeError, ValueError) as exc:
            print(f"{name:14s} failed: {type(exc).__name__}: {str(exc)[:300]}")
            rows.append(base | {"error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    common.write_rows(rows, "W1_attention", Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

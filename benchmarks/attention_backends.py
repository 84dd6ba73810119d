"""Packed causal attention on W1's shapes: torch's varlen (FlashAttention-2) against hasten's own
cuDNN op (hasten::varlen_attention: cuDNN's fused SDPA with ragged offsets, graphs cached per
bucket), forward + backward, and how far each is from FlashAttention's results. (An earlier try
through torch's private aten cuDNN ops, torch 2.11, gave wrong gradients and rebuilt a graph on
every call; hasten's op builds its own graphs.)

W1's batch: 16,384 tokens in 61 packed samples (benchmarks/packed_sft.py's lengths), 16 query heads,
8 K/V heads, head_dim 128, bf16. FlashAttention runs with the 8 K/V heads read natively and
repeated to 16 (rep); cuDNN reads them natively. Each row: milliseconds per forward + backward of one
layer (median of 20) and the largest difference from FlashAttention in out, dq, dk, dv relative
to each tensor's largest magnitude. hasten_cudnn_softcap: the same with Gemma 2's attention softcap
of 50 (cuDNN's score modifier, which builds the causal band inside it), against the per-sequence
path with that softcap; it measures what the cap costs beside hasten_cudnn.

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


def hasten_cudnn(q, k, v, cu, max_len):
    return varlen_attention(q, k, v, cu, max_len, backend="cudnn")


SOFTCAP = 50.0  # Gemma 2's attn_logit_softcapping


def hasten_cudnn_softcap(q, k, v, cu, max_len):
    return varlen_attention(q, k, v, cu, max_len, backend="cudnn", softcap=SOFTCAP)


def per_sequence_softcap(q, k, v, cu, max_len):
    return varlen_attention(q, k, v, cu, max_len, backend="per_sequence", softcap=SOFTCAP)


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
    capped_reference = run(per_sequence_softcap, q, k, v, cu, max_len, grad)
    run_id = common.new_run_id()
    rows = []
    variants = (("flash_varlen", torch_varlen("native")), ("flash_varlen_rep", torch_varlen("repeat")),
                ("hasten_cudnn", hasten_cudnn), ("hasten_cudnn_softcap", hasten_cudnn_softcap))
    for name, fn in variants:
        want = capped_reference if name.endswith("softcap") else reference
        reset_fallbacks()
        base = {"workload": "W1_attention", "variant": name, **common.environment(), "run_id": run_id}
        try:
            got = run(fn, q, k, v, cu, max_len, grad)
            diffs = {label: float((g.float() - r.float()).abs().max() / r.float().abs().max())
                     for label, g, r in zip(("out", "dq", "dk", "dv"), got, want)}
            times = common.time_steps(lambda: run(fn, q, k, v, cu, max_len, grad), warmup=3, iters=20)
            ms = common.median(times) * 1e3
            print(f"{name:16s} {ms:7.3f} ms fwd+bwd   rel diff vs its reference: "
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

"""Packed causal attention on W1's shapes: torch's varlen (FlashAttention-2) against hasten's own
cuDNN op (hasten::varlen_attention: cuDNN's fused SDPA with ragged offsets, graphs cached per
bucket), forward + backward, and how far each is from FlashAttention's results. (An earlier try
through torch's private aten cuDNN ops, torch 2.11, gave wrong gradients and rebuilt a graph on
every call; hasten's op builds its own graphs.)

W1's batch: 16,384 tokens in 61 packed samples (benchmarks/packed_sft.py's lengths), 16 query heads,
8 K/V heads, head_dim 128, bf16. FlashAttention runs with the 8 K/V heads read natively and
repeated to 16 (rep); cuDNN reads them natively, and repeated (hasten_cudnn_rep: its GQA backward
keeps dK and dV at the query heads' width in float32 and reduces them in a pass of its own, 2.8 ms
of W1's step at e09a574). Each row: milliseconds per forward + backward of one
layer (median of 20) and the largest difference from FlashAttention in out, dq, dk, dv relative
to each tensor's largest magnitude. hasten_cudnn_softcap: the same with Gemma 2's attention softcap
of 50 (cuDNN's score modifier, which builds the causal band inside it), against the per-sequence
path with that softcap; it measures what the cap costs beside hasten_cudnn.

hasten_cudnn_classes<k>: the same op over the same samples split into k length classes, one call
per class (k = 2, 3, 4), each class's samples packed contiguously (outside the timed region):
cuDNN's ragged kernels launch over batch x max_seqlen rows, 61 x 2,048 = 7.6x W1's 16,384 tokens
in one call, so the question is what the empty tiles cost (the D = rowsum(dO * O) kernel ran at
about a fifth of the bandwidth in W1's profile). Each class's calls are timed back to back; the
row prints the rows launched over for each k.

--long L (W2_attention): instead, ONE causal sequence of L tokens on W2_long's Llama-8B heads (32
query, 8 K/V, head_dim 128), FlashAttention-2 (torch varlen) against hasten's cuDNN op: forward and
backward timed apart, with TFLOP/s (causal: forward 2 * L^2 * heads * head_dim, backward 2.5x
that), the numbers that bound a long-context step (attention is most of it past 100k tokens).

    python benchmarks/attention_backends.py [--out benchmarks/results] [--long 131072]
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


def hasten_cudnn_rep(q, k, v, cu, max_len):
    """cuDNN with K/V repeated to the query heads: its backward then writes dK and dV per query
    head in bf16 (no float32 query-width workspace and fmha_reduce_head pass), and autograd sums
    each head group (repeat_interleave's backward) instead. Measures which costs less."""
    groups = q.shape[1] // k.shape[1]
    return varlen_attention(q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), cu, max_len,
                            backend="cudnn")


SOFTCAP = 50.0  # Gemma 2's attn_logit_softcapping


def hasten_cudnn_softcap(q, k, v, cu, max_len):
    return varlen_attention(q, k, v, cu, max_len, backend="cudnn", softcap=SOFTCAP)


def per_sequence_softcap(q, k, v, cu, max_len):
    return varlen_attention(q, k, v, cu, max_len, backend="per_sequence", softcap=SOFTCAP)


def length_classes(lengths: list[int], classes: int) -> list[list[int]]:
    """Sample indices in `classes` groups of consecutive lengths (sorted), the boundaries chosen to
    minimise sum(count x longest): the rows cuDNN's ragged kernels launch over, batch x max_seqlen,
    summed over the calls."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    n, classes = len(order), max(1, min(classes, len(order)))
    # cost[j][c]: the least rows for the first j samples (sorted) in c groups; cut[j][c] its last cut
    inf = float("inf")
    cost = [[inf] * (classes + 1) for _ in range(n + 1)]
    cut = [[0] * (classes + 1) for _ in range(n + 1)]
    cost[0][0] = 0
    for j in range(1, n + 1):
        for c in range(1, classes + 1):
            for i in range(c - 1, j):  # the last group: sorted samples i .. j-1, its longest lengths[order[j-1]]
                rows = cost[i][c - 1] + (j - i) * lengths[order[j - 1]]
                if rows < cost[j][c]:
                    cost[j][c], cut[j][c] = rows, i
    groups, j = [], n
    for c in range(classes, 0, -1):
        i = cut[j][c]
        groups.append(order[i:j])
        j = i
    return [g for g in reversed(groups) if g]


def class_batches(groups: list[list[int]], cu: torch.Tensor, tensors: list[torch.Tensor]):
    """Per group: its samples' rows of each tensor packed contiguously, its cu_seqlens and longest."""
    starts = cu.tolist()
    out = []
    for group in groups:
        rows = torch.cat([torch.arange(starts[s], starts[s + 1], device=cu.device) for s in group])
        lengths = [starts[s + 1] - starts[s] for s in group]
        cu_group = torch.tensor([0] + lengths, device=cu.device).cumsum(0).to(torch.int32)
        out.append(([t.index_select(0, rows) for t in tensors], cu_group, max(lengths)))
    return out


def run(fn, q, k, v, cu, max_len, grad):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, cu, max_len)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


LONG_Q_HEADS = 32  # Llama-8B (W2_long); 8 K/V heads as in W1


def long_sequence_rows(tokens: int, run_id: str) -> list[dict]:
    """Forward and backward apart on one causal sequence of `tokens` (see the module's --long)."""
    cu = torch.tensor([0, tokens], device="cuda", dtype=torch.int32)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(tokens, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
               for heads in (LONG_Q_HEADS, KV_HEADS, KV_HEADS))
    grad = torch.randn_like(q)
    forward_flop = 2.0 * tokens * tokens * LONG_Q_HEADS * HEAD_DIM  # causal: half of 4 * L^2 * h * d
    rows = []
    for name, fn in (("flash_varlen", torch_varlen("native")), ("hasten_cudnn", hasten_cudnn)):
        base = {"workload": "W2_attention", "variant": name, "tokens": tokens, **common.environment(),
                "run_id": run_id}
        try:
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            forward = common.median(common.time_steps(lambda: fn(*leaves, cu, tokens), warmup=1, iters=3))
            out = fn(*leaves, cu, tokens)

            def backward():
                torch.autograd.grad(out, leaves, grad, retain_graph=True)
            backward_s = common.median(common.time_steps(backward, warmup=1, iters=3))
            row = base | {"forward_ms": forward * 1e3, "backward_ms": backward_s * 1e3,
                          "forward_tflops": forward_flop / forward / 1e12,
                          "backward_tflops": 2.5 * forward_flop / backward_s / 1e12}
            print(f"{name:14s} {tokens} tokens: forward {row['forward_ms']:.1f} ms ({row['forward_tflops']:.0f} "
                  f"TFLOP/s), backward {row['backward_ms']:.1f} ms ({row['backward_tflops']:.0f} TFLOP/s)")
            rows.append(row)
            del out, leaves
        except (RuntimeError, ValueError) as exc:
            print(f"{name:14s} failed: {type(exc).__name__}: {str(exc)[:300]}")
            rows.append(base | {"error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(common.RESULTS))
    parser.add_argument("--long", type=int, default=None, help="one causal sequence of this many tokens instead")
    args = parser.parse_args()
    if args.long:
        common.write_rows(long_sequence_rows(args.long, common.new_run_id()), "W2_attention", Path(args.out))
        return 0
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
                ("hasten_cudnn", hasten_cudnn), ("hasten_cudnn_rep", hasten_cudnn_rep),
                ("hasten_cudnn_softcap", hasten_cudnn_softcap))
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
    for classes in (2, 3, 4):
        name = f"hasten_cudnn_classes{classes}"
        reset_fallbacks()
        base = {"workload": "W1_attention", "variant": name, **common.environment(), "run_id": run_id}
        try:
            groups = length_classes(lengths, classes)
            batches = class_batches(groups, cu, [q, k, v, grad] + reference)
            launched = sum(len(g) * m for g, (_, _, m) in zip(groups, batches))
            diffs = {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
            scales = [r.float().abs().max() for r in reference]  # the whole reference tensor's largest
            for (q_c, k_c, v_c, grad_c, *want), cu_c, max_c in batches:
                got = run(hasten_cudnn, q_c, k_c, v_c, cu_c, max_c, grad_c)
                for label, g, r, scale in zip(diffs, got, want, scales):
                    diffs[label] = max(diffs[label], float((g.float() - r.float()).abs().max() / scale))

            def every_class():
                for (q_c, k_c, v_c, grad_c, *_), cu_c, max_c in batches:
                    run(hasten_cudnn, q_c, k_c, v_c, cu_c, max_c, grad_c)
            ms = common.median(common.time_steps(every_class, warmup=3, iters=20)) * 1e3
            sizes = ", ".join(f"{len(g)} x {m}" for g, (_, _, m) in zip(groups, batches))
            print(f"{name:16s} {ms:7.3f} ms fwd+bwd   rows launched over {launched} ({launched / TOKENS:.2f}x the "
                  f"tokens; one call: {len(lengths) * max_len}), classes {sizes}; rel diff: "
                  + ", ".join(f"{key} {val:.2e}" for key, val in diffs.items()))
            rows.append(base | {"fwd_bwd_ms": ms, "rel_diff": diffs, "correct": max(diffs.values()) < 2e-2,
                                "fallbacks": fallback_counts(), "notes": f"classes {sizes}; rows {launched}"})
        except (RuntimeError, ValueError) as exc:
            print(f"{name:14s} failed: {type(exc).__name__}: {str(exc)[:300]}")
            rows.append(base | {"error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    common.write_rows(rows, "W1_attention", Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Device probe (issue 19): does flash-linear-attention (fla-core) run here, and do its varlen kernels
compute, for each packed sample, what transformers' torch functions compute on that sample alone?

Gated delta rule (chunked, q/k L2-normalised in the kernel) and the short causal convolution (silu),
packed samples of 1, 2, 63, 500+ tokens, forward and every input gradient, bf16 against the fp32
per-sample torch reference, with the same kernels run per sample in bf16 as the noise yardstick.
Also: whether a varlen call with cu_seqlens_cpu syncs the host, and the time of one call at 16k tokens.
    python3 scripts/fla_probe.py
"""

import sys
import time

import torch
import torch.nn.functional as F

sys.modules["fla"] = None  # transformers' modeling module keeps its torch functions (the reference)
from transformers.models.qwen3_next import modeling_qwen3_next as qn  # noqa: E402

del sys.modules["fla"]
import fla  # noqa: E402
from fla.modules.causal_conv1d import causal_conv1d  # noqa: E402
from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: E402

print("fla", getattr(fla, "__version__", "?"), "torch", torch.__version__)
torch.manual_seed(0)
dev = "cuda"
LENGTHS = [1, 2, 63, 517, 1, 300, 64]
cu = torch.tensor([0] + list(torch.tensor(LENGTHS).cumsum(0)), dtype=torch.long)
T, H, HV, K, V, D, W = int(cu[-1]), 4, 4, 32, 32, 96, 4  # H == HV: 5.17's torch function has no GVA


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def gdn_inputs(dtype):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, T, H, K, generator=g)
    k = torch.randn(1, T, H, K, generator=g)
    v = torch.randn(1, T, HV, V, generator=g)
    gate = -F.softplus(torch.randn(1, T, HV, generator=g)) * 0.3
    beta = torch.rand(1, T, HV, generator=g)
    return [x.to(dev, dtype).requires_grad_() for x in (q, k, v, gate, beta)]


def run_gdn(fn, inputs, varlen, out_grad):
    q, k, v, gate, beta = inputs
    if varlen:
        o, _ = fn(q, k, v, g=gate, beta=beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu.to(dev), cu_seqlens_cpu=cu)
    else:
        outs = []
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            o_s, _ = fn(q[:, s:e], k[:, s:e], v[:, s:e], g=gate[:, s:e], beta=beta[:, s:e], use_qk_l2norm_in_kernel=True)
            outs.append(o_s)
        o = torch.cat(outs, 1)
    grads = torch.autograd.grad(o, inputs, out_grad.to(o.dtype))
    return [o] + list(grads)


out_grad = torch.randn(1, T, HV, V, generator=torch.Generator().manual_seed(2)).to(dev)
want = run_gdn(qn.torch_chunk_gated_delta_rule, gdn_inputs(torch.float32), False, out_grad)
got = run_gdn(chunk_gated_delta_rule, gdn_inputs(torch.bfloat16), True, out_grad)
noise = run_gdn(qn.torch_chunk_gated_delta_rule, gdn_inputs(torch.bfloat16), False, out_grad)
names = ["out", "dq", "dk", "dv", "dg", "dbeta"]
print("gated delta rule, fla varlen bf16 vs fp32 per-sample torch:",
      {n: round(rel(a, b), 5) for n, a, b in zip(names, got, want)})
print("gated delta rule, torch per-sample bf16 (noise):", {n: round(rel(a, b), 5) for n, a, b in zip(names, noise, want)})
# the same without cu_seqlens: state carried across samples -> must differ by far more
q, k, v, gate, beta = gdn_inputs(torch.bfloat16)
o_mixed, _ = chunk_gated_delta_rule(q, k, v, g=gate, beta=beta, use_qk_l2norm_in_kernel=True)
print("without cu_seqlens (samples mixed):", round(rel(o_mixed, want[0]), 4))


def conv_inputs(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, D, T, generator=g)
    w = torch.randn(D, W, generator=g) * 0.5
    return [t.to(dev, dtype).requires_grad_() for t in (x, w)]


def run_conv(varlen, dtype):
    x, w = conv_inputs(dtype)
    if varlen:
        y, _ = causal_conv1d(x.transpose(1, 2), w, None, activation="silu", cu_seqlens=cu.to(dev), cu_seqlens_cpu=cu)
        y = y.transpose(1, 2)
    else:
        y = torch.cat([qn.causal_conv1d_fn(x[:, :, s:e], w, None, activation="silu")
                       for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())], -1)
    go = torch.randn(y.shape, generator=torch.Generator().manual_seed(4)).to(dev, y.dtype)
    return [y] + list(torch.autograd.grad(y, (x, w), go))


want_c, got_c, noise_c = run_conv(False, torch.float32), run_conv(True, torch.bfloat16), run_conv(False, torch.bfloat16)
print("short conv, fla varlen bf16 vs fp32 per-sample:", {n: round(rel(a, b), 5) for n, a, b in zip(["y", "dx", "dw"], got_c, want_c)})
print("short conv, torch per-sample bf16 (noise):", {n: round(rel(a, b), 5) for n, a, b in zip(["y", "dx", "dw"], noise_c, want_c)})

# host syncs of one varlen call given cu_seqlens_cpu
q, k, v, gate, beta = gdn_inputs(torch.bfloat16)
cu_dev = cu.to(dev)
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("warn")
import warnings  # noqa: E402

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    o, _ = chunk_gated_delta_rule(q, k, v, g=gate, beta=beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_dev,
                                  cu_seqlens_cpu=cu)
    o.sum().backward()
    y, _ = causal_conv1d(o.detach().flatten(2), None if False else torch.randn(HV * V, W, device=dev, dtype=o.dtype),
                         None, activation="silu", cu_seqlens=cu_dev, cu_seqlens_cpu=cu)
torch.cuda.set_sync_debug_mode(0)
print("sync warnings in varlen fwd+bwd with cu_seqlens_cpu:", sum("synchroniz" in str(w.message) for w in caught))

# time at 16k tokens, Qwen3.5-2B-like linear-attention heads (16 k-heads of 128, 16 v-heads of 128)
lens = [16384 // 24] * 24
cu16 = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.long)
T16 = int(cu16[-1])
q = torch.randn(1, T16, 16, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(1, T16, 16, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(1, T16, 16, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
gate = (-F.softplus(torch.randn(1, T16, 16, device=dev)) * 0.3).requires_grad_()
beta = torch.rand(1, T16, 16, device=dev, dtype=torch.bfloat16).requires_grad_()
cu16d = cu16.to(dev)
for i in range(6):
    if i == 3:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
    o, _ = chunk_gated_delta_rule(q, k, v, g=gate, beta=beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu16d,
                                  cu_seqlens_cpu=cu16)
    o.sum().backward()
torch.cuda.synchronize()
print(f"gated delta rule fwd+bwd, {T16} tokens, 16 heads of 128: {(time.perf_counter() - t0) / 3 * 1e3:.2f} ms")

"""Smallest hasten::varlen_attention call on the GPU, forward then backward (for gdb backtraces)."""
import torch

import hasten.ops.attention as attention

lengths = [5, 130, 1, 64]
q, k, v = (torch.randn(sum(lengths), h, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for h in (4, 2, 2))
cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
print("forward", flush=True)
out = attention.varlen_attention(q, k, v, cu, max(lengths))
torch.cuda.synchronize()
print("backward", flush=True)
out.sum().backward()
torch.cuda.synchronize()
print("ok", float(out.float().abs().sum()), float(q.grad.float().abs().sum()), flush=True)

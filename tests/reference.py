"""Plain-PyTorch references that hasten's ops and paths are compared against."""

from __future__ import annotations

import torch


def varlen_meta_reference(position_ids: torch.Tensor):
    """(cu_seqlens (N+1,), seq_idx (T,), num_seqs, max_seqlen) by diff/cumsum, no hasten code."""
    flat = position_ids.reshape(-1).long().cpu()
    total = flat.numel()
    row_len = max(position_ids.shape[-1], 1) if position_ids.dim() else 1
    starts = torch.ones(total, dtype=torch.bool)
    if total > 1:
        starts[1:] = flat[1:] != flat[:-1] + 1
    starts[::row_len] = True
    cu = torch.cat([torch.nonzero(starts).flatten(), torch.tensor([total])]).to(torch.int32)
    seq_idx = (torch.cumsum(starts.int(), 0) - 1).to(torch.int32)
    max_seqlen = int(cu.diff().max()) if total else 0
    return cu, seq_idx, cu.numel() - 1, max_seqlen


def random_packed_position_ids(gen: torch.Generator, rows: int, row_len: int, max_sample: int,
                               dtype=torch.int64, random_offsets: bool = False) -> torch.Tensor:
    """Rows of concatenated 0..n-1 ranges (sample lengths random, single tokens included)."""
    out = []
    for _ in range(rows):
        row: list[int] = []
        while len(row) < row_len:
            n = int(torch.randint(1, max_sample + 1, (1,), generator=gen))
            start = int(torch.randint(0, 50, (1,), generator=gen)) if random_offsets else 0
            row += range(start, start + n)
        out.append(row[:row_len])
    return torch.tensor(out, dtype=dtype).reshape(rows, row_len)


def moe_group_reference(expert_ids: torch.Tensor, num_experts: int):
    """Stable sort + bincount: counts, exclusive offsets, permutation, inverse (int64, CPU)."""
    flat = expert_ids.reshape(-1).long().cpu()
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))  # dropped slots sort last
    permutation = torch.sort(key, stable=True).indices
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(flat.numel())
    counts = torch.bincount(flat[valid], minlength=num_experts)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    return counts, offsets, permutation, inverse


def moe_permute_reference(x, permutation, top_k, valid, slot_scale=None):
    out = torch.zeros(permutation.numel(), x.shape[1], dtype=torch.float64)
    src = x.double()[permutation[:valid].long() // top_k]
    if slot_scale is not None:
        src = src * slot_scale.double()[permutation[:valid].long()].unsqueeze(1)
    out[:valid] = src
    return out


def expert_biased_rows(y, offsets, bias):
    """y (S, H) in expert order plus each row's expert bias (E, H), offsets (E + 1,) the groups'
    starts, added in y's dtype (the model's `y + bias`); rows past the groups get the last expert's."""
    rows = torch.arange(y.shape[0], dtype=offsets.dtype)
    experts = torch.searchsorted(offsets[1:], rows, right=True).clamp_max(bias.shape[0] - 1)
    return y + bias[experts.long()]


def moe_combine_reference(y, inverse, top_k, valid, weights=None, offsets=None, bias=None):
    """Float64 out[t] = sum_j weights[t, j] * y'[inverse[t * k + j]]; y' = y, or with bias (E, H)
    and offsets (E + 1,) expert_biased_rows(y, offsets, bias)."""
    tokens = inverse.numel() // top_k
    if bias is not None:
        y = expert_biased_rows(y, offsets, bias)
    rows = y.double()[inverse.long().clamp_max(max(y.shape[0] - 1, 0))] if y.shape[0] else y.double()
    keep = (inverse.long() < valid).double().unsqueeze(1)
    w = weights.double().reshape(-1, 1) if weights is not None else torch.ones(inverse.numel(), 1, dtype=torch.float64)
    return (rows * keep * w).reshape(tokens, top_k, -1).sum(1)


def grouped_mm_reference(x, weight, ends, transposed):
    """Per expert in x's dtype (differentiable): rows [ends[g-1], ends[g]) of x (S, in) times W_g^T,
    weight (E, out, in), or (E, in, out) when transposed; rows past the last end zero."""
    out = x.new_zeros(x.shape[0], weight.shape[2] if transposed else weight.shape[1])
    start = 0
    for g, end in enumerate(ends.tolist()):
        w = weight[g].to(x.dtype)
        out[start:end] = x[start:end] @ (w if transposed else w.t())
        start = end
    return out


def swiglu_reference(gate_up):
    g, u = gate_up.double().chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


def weighted_swiglu_reference(gate_up, weights, permutation, valid):
    """Float64 hasten::moe_weighted_swiglu: row p of [gate | up] times its slot's weight
    weights.flatten()[permutation[p]]; rows at p >= valid (dropped slots) zero. Differentiable in
    gate_up and weights (torch's autograd is then the reference backward)."""
    rows = gate_up.shape[0]
    keep = (torch.arange(rows) < valid).double().unsqueeze(1)
    w = weights.double().reshape(-1)[permutation.long()].unsqueeze(1)
    return swiglu_reference(gate_up) * w * keep

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

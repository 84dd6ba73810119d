"""hasten::varlen_meta: packing metadata derived from position_ids on the tensor's device."""

from __future__ import annotations

import torch

from hasten.ops import _checks
from hasten.ops._lib import load


def _varlen_meta_fake(position_ids: torch.Tensor):
    _checks.check_varlen_meta_args(position_ids)
    total = position_ids.numel()
    new = position_ids.new_empty
    return new((total + 1,), dtype=torch.int32), new((total,), dtype=torch.int32), new((2,), dtype=torch.int32)


def _register() -> None:
    """Run once by hasten.ops._lib.load(), after hasten._C defined the schemas."""
    torch.library.register_fake("hasten::varlen_meta", _varlen_meta_fake)


def varlen_meta_raw(position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op as registered: shapes depend on the token count only, nothing is read back.

    Returns cu_seqlens_padded (int32, T+1), seq_idx (int32, T) and stats (int32, 2) =
    [num_seqs, max_seqlen]; see csrc/registration.cpp.
    """
    load()
    return torch.ops.hasten.varlen_meta(position_ids)

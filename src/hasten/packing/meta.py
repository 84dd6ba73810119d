"""PackedMeta: the packing metadata of one batch, shared by every attention layer.

A batch's metadata is made once, either by `PackingCollator` on the CPU (no GPU
sync at all) or by `PackedMeta.from_position_ids` on the device (one read-back per
batch: the sequence count and max length). It travels with the batch through the
model's keyword arguments (`cu_seq_lens_q`, `max_length_q`, ...), so every layer
of that forward -- and its recompute under activation checkpointing -- reads the
same tensors, and the next batch brings its own: there is no global cache that
could go stale.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# The keyword names transformers' attention functions already use for varlen
# metadata (FlashAttentionKwargs), so flash_attention_2 reads them too.
CU_Q, CU_K, MAX_Q, MAX_K = "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"
# hasten's own: the chunks of chunked attention (Llama 4), for the layers that have it
CHUNK_CU, CHUNK_MAX = "hasten_chunk_cu_seqlens", "hasten_chunk_max_length"
# hasten's own: the sample boundaries of the stateful layers' varlen kernels (hasten.stateful.LinearMeta,
# built once per batch for hybrid models: linear attention, short convolutions)
LINEAR_META = "hasten_linear_meta"


def chunk_boundaries(cu_seqlens: torch.Tensor, max_seqlen: int, tokens: int, chunk: int) -> tuple[torch.Tensor, int]:
    """cu_seqlens (num_seqs + 1,) of the packed samples -> those of their chunks, and their longest:
    a new sequence at every token whose position in its sample is a multiple of `chunk` (the
    sample's first token included), so that causal attention within each is chunked attention (a
    query sees the earlier keys of its own chunk), as each sample alone computes it. `tokens`: the
    batch's token count (padding after the last sample gets no chunk). One host read-back."""
    index = torch.arange(tokens, device=cu_seqlens.device, dtype=torch.int32)
    sample = torch.searchsorted(cu_seqlens[1:], index, right=True)  # the sample each token belongs to
    position = index - cu_seqlens[sample]
    starts = index[(position % chunk == 0) & (index < cu_seqlens[-1])]  # the read-back: the chunk count
    return torch.cat((starts, cu_seqlens[-1:])).to(torch.int32), min(max_seqlen, chunk)


@dataclass(frozen=True)
class PackedMeta:
    cu_seqlens: torch.Tensor  # (num_seqs + 1,) int32, boundaries in the flattened (rows * L) tokens
    max_seqlen: int           # longest sequence, a host int (varlen kernels size their grid with it)
    seq_idx: torch.Tensor     # (tokens,) int32, sequence index of every token

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> "PackedMeta":
        """Derive the metadata on position_ids' device: one kernel, one read-back."""
        from hasten.ops.packing import varlen_meta_raw

        cu_padded, seq_idx, stats = varlen_meta_raw(position_ids)
        num_seqs, max_seqlen = stats.tolist()  # the batch's single host sync
        return cls(cu_padded[: num_seqs + 1], int(max_seqlen), seq_idx)

    def attention_kwargs(self) -> dict:
        """The model keyword arguments that carry this metadata to every layer."""
        return {CU_Q: self.cu_seqlens, CU_K: self.cu_seqlens, MAX_Q: self.max_seqlen, MAX_K: self.max_seqlen}


def verify_enabled() -> bool:
    return os.environ.get("HASTEN_VERIFY", "0") not in ("", "0", "false", "False")


class StaleMetadataError(RuntimeError):
    """The metadata an attention layer received does not describe its batch."""


def verify_against_position_ids(cu_seqlens: torch.Tensor, max_seqlen: int, position_ids: torch.Tensor,
                                where: str) -> None:
    """HASTEN_VERIFY=1: re-derive the metadata from position_ids and raise on any mismatch."""
    fresh = PackedMeta.from_position_ids(position_ids)
    same = (
        fresh.cu_seqlens.numel() == cu_seqlens.numel()
        and torch.equal(fresh.cu_seqlens.to(cu_seqlens.device), cu_seqlens.to(torch.int32))
        and fresh.max_seqlen == int(max_seqlen)
    )
    if not same:
        raise StaleMetadataError(
            f"hasten verify ({where}): the packing metadata passed to attention does not match this batch's "
            f"position_ids (got {cu_seqlens.numel() - 1} sequences, max {int(max_seqlen)}; position_ids give "
            f"{fresh.num_seqs} sequences, max {fresh.max_seqlen}). The batch's cu_seq_lens and position_ids come "
            "from different batches, or the collator and position_ids disagree."
        )


def map_batch_tensors(batch: dict, fn) -> dict:
    """Apply `fn` to each tensor of a batch once, so tensors shared between keys stay
    shared (the collator's cu_seq_lens_q *is* cu_seq_lens_k); other values pass through."""
    done: dict[int, torch.Tensor] = {}
    return {key: done.setdefault(id(v), fn(v)) if isinstance(v, torch.Tensor) else v for key, v in batch.items()}


def move_batch(batch: dict, device: torch.device | str, non_blocking: bool = True) -> dict:
    """Move a batch's tensors to `device`; host ints (max_length_*) stay on the host.
    From pinned memory the copies are asynchronous: no host sync."""
    return map_batch_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))

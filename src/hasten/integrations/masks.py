"""What a transformers mask function says, read back so hasten's varlen attention computes it.

transformers builds each layer's mask from a `mask_function(batch_idx, head_idx, q_idx, kv_idx)
-> bool` (masking_utils). Under hasten no dense mask is materialised, so the mask interface
hasten registers must turn that function into what the attention kernel takes: causal or not,
and a sliding window. It does so by evaluating the function on sample rows of the (q, kv) grid
and requiring that the rows are exactly a causal band of one width, causal within chunks of one
size (Llama 4's chunked attention), or exactly full; any other pattern (bidirectional image
tokens, a padding or packed-sequence overlay) is refused with an error rather than approximated.

Why read the mask instead of the `sliding_window` argument: transformers 5.24's Qwen2-MoE (and
any model run through sdpa or eager) expresses its window only in the mask; the attention call
gets none. Reading the mask makes the window hasten applies the one the model's own path applies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hasten.packing import PackingError


class MaskNotSupported(NotImplementedError):
    """The model's mask is not a causal band (or full): hasten's varlen attention cannot express it."""


class MaskReadAsTensor(PackingError, AttributeError):
    """A model's own code read hasten's band mask as a tensor (Doge's dynamic mask reads `.dtype`):
    an AttributeError, so getattr(mask, name, default) still falls back, and a PackingError, so
    `hasten train` stops with exit 2 and the message (train it with packed_sequence: false) rather
    than a traceback."""


@dataclass(frozen=True)
class BandMask:
    """What hasten's mask interface returns in place of a dense mask when there is no padding.

    causal: a query sees no later key. window: a query sees itself and the window - 1 keys before
    it (transformers' `sliding_window`), None for no window. chunk: a query sees the earlier keys
    of its own chunk of positions [j * chunk, (j + 1) * chunk) (transformers'
    `attention_chunk_size`), None for no chunks; the attention function cuts each packed sample
    into such chunks, counted from the sample's first token. The attention function reads it;
    anything else that looks at it sees an object, not a tensor, and fails loudly -- except an
    index that keeps every query and key (Gemma 4 slices its masks with `[:, :, slice(0, None), :]`
    when `logits_to_keep` is 0), which returns the band itself, and, outside a packed batch, an
    index that keeps part of it (Gemma 4's KV-shared layers keep the last `logits_to_keep` queries
    in generate's prefill): that part of transformers' own dense mask (`dense`), which the attention
    function serves through its dense fallback. In a packed batch a dense mask of the row would join
    its samples, so there it stays an error."""

    causal: bool
    window: int | None
    chunk: int | None = None
    # outside packed batches: builds transformers' own boolean mask of this forward (hasten_mask)
    dense: Callable[[], torch.Tensor] | None = field(default=None, compare=False, repr=False)

    def __getattr__(self, name: str):
        # only for attributes a band does not have: a model whose own code reads its mask as a tensor
        # (Doge's dynamic mask: `.dtype`, `.shape`) gets this message instead of a bare AttributeError
        if name.startswith("__"):
            raise AttributeError(name)
        raise MaskReadAsTensor(f"hasten's band mask (packed attention without a dense mask) has no `{name}`: this "
                             "model's own code reads its attention mask as a tensor, which hasten's varlen path does "
                             "not build. Train it with training.packed_sequence: false and please report the model "
                             "type")

    def __getitem__(self, index):
        whole = slice(None)
        parts = index if isinstance(index, tuple) else (index,)
        if all(isinstance(p, slice) and p.step in (None, 1) and p.start in (None, 0) and p.stop is None
               for p in parts) or all(p == whole for p in parts):
            return self
        if self.dense is not None:
            return self.dense()[index]
        raise NotImplementedError(f"hasten's band mask (packed attention without a dense mask) cannot be indexed with "
                                  f"{index!r}: that keeps part of the queries or keys; leave this model's attention "
                                  "to transformers (training.packed_sequence: false) and please report the model type")


def _sample_rows(length: int) -> list[int]:
    # the first rows, thirds, the middle and the last rows: a band of any width shows its edge in
    # a row past the width, and a chunked pattern breaks the band's constant width between rows
    rows = {0, 1, 2, 3, length // 4, length // 3, length // 2, (2 * length) // 3, length - 3, length - 2, length - 1}
    return sorted(r for r in rows if 0 <= r < length)


def _on_cpu_or_device(evaluate, device):
    """`evaluate(torch.device("cpu"))`, or `evaluate(device)` where that raises as a function that
    indexes a tensor on the model's device does (Llama 4's chunked overlay holds its `left_padding`
    there): every reading of one mask function goes through here, so none is left on the CPU alone."""
    try:
        return evaluate(torch.device("cpu"))
    except (RuntimeError, IndexError, TypeError):
        return evaluate(device)


def _evaluate(mask_function, rows: list[int], length: int, device) -> torch.Tensor:
    q = torch.tensor(rows, device=device)[:, None]
    kv = torch.arange(length, device=device)[None, :]
    zero = torch.zeros((), dtype=torch.long, device=device)
    allowed = mask_function(zero, zero, q, kv)
    return torch.as_tensor(allowed).to(torch.bool).expand(len(rows), length).cpu()


def _fingerprint(function, depth: int = 0):
    """What decides a mask function's output: its code and what its closure holds (ints, floats,
    other such functions), recursively; None when it holds anything else (a tensor, say), so
    that its reading is not reused. transformers builds these closures anew in every forward."""
    code = getattr(function, "__code__", None)
    if code is None or depth > 8:
        return None
    cells = []
    for cell in function.__closure__ or ():
        value = cell.cell_contents
        if isinstance(value, (tuple, list)):
            parts = tuple(_fingerprint(v, depth + 1) if callable(v) else v for v in value)
            if any(p is None or not isinstance(p, (int, float, str, bool, tuple)) for p in parts):
                return None
            cells.append(parts)
        elif callable(value):
            inner = _fingerprint(value, depth + 1)
            if inner is None:
                return None
            cells.append(inner)
        elif isinstance(value, (int, float, str, bool)) or value is None:
            cells.append(value)
        else:
            return None
    return (code, tuple(cells))


# (fingerprint, grid length) -> band, None where the function is not a band on that grid; a few
# entries per mask function
_READINGS: dict[tuple, BandMask | None] = {}


def _grid(length: int) -> int:
    """The grid a reusable reading is taken on: `length` rounded up to a power of two, so a run whose
    packed rows vary in length (every batch its own token count) reads each mask function about
    log2(longest row) times, not once per length. Before, every new length was read afresh and none
    was kept once 256 lengths had been seen: 2,000 forwards of rows of 3,500-4,600 tokens spent
    855 ms reading the causal mask on the CPU, 9 ms now (tests/integrations/test_contract.py holds
    the readings to one per grid)."""
    return 1 << (length - 1).bit_length()


def _fit(band: BandMask, length: int) -> BandMask:
    """A band read on a longer grid, as a reading on `length` gives it: a window or a chunk as long
    as the row or longer limits nothing there, and such a reading says None."""
    window = band.window if band.window is not None and band.window < length else None
    chunk = band.chunk if band.chunk is not None and band.chunk < length else None
    return band if (window, chunk) == (band.window, band.chunk) else BandMask(band.causal, window, chunk)


@torch.compiler.disable  # host work with a cache keyed by code objects: runs eagerly under a whole-model compile
def read_band(mask_function, length: int, device: torch.device | None = None) -> BandMask:
    """The band that `mask_function` draws on a length x length grid; raises MaskNotSupported.

    Evaluated on the CPU (no host sync): transformers' causal, sliding-window and bidirectional
    functions are index arithmetic. A function that reads device tensors is evaluated there.
    A function of index arithmetic over plain values (its fingerprint) is read once per grid of a
    power-of-two length at or above `length` and the reading reused for every length in it: the
    band of a pure function on the shorter grid is its band on the longer one cut to that size
    (`_fit`). Where that reading fails (a function whose pattern changes past `length`, say one that
    bounds the keys by a number it holds), it reads `length` itself, as it would without reuse.
    A function holding anything else (a tensor) is read afresh on `length` every time."""
    if mask_function is None or length == 0:
        return BandMask(True, None)
    fingerprint = _fingerprint(mask_function)
    if fingerprint is None:
        return _read(mask_function, length, device)
    grid = _grid(length)
    band = _reading(fingerprint, grid, mask_function, device) if grid != length else None
    if band is None:
        band = _reading(fingerprint, length, mask_function, device)
    if band is None:  # not a band on `length` either: read it once more for the refusal's reason
        band = _read(mask_function, length, device)
    return _fit(band, length)


def _reading(fingerprint: tuple, grid: int, mask_function, device) -> BandMask | None:
    """The reading of a reusable mask function on `grid`, from the cache or taken and kept there;
    None where it is not a band on that grid."""
    key = (fingerprint, grid)
    if key in _READINGS:
        return _READINGS[key]
    try:
        band = _read(mask_function, grid, device)
    except MaskNotSupported:
        band = None
    if len(_READINGS) < 256:
        _READINGS[key] = band
    return band


def _read(mask_function, length: int, device) -> BandMask:
    rows = _sample_rows(length)
    try:
        allowed = _on_cpu_or_device(lambda where: _evaluate(mask_function, rows, length, where), device)
    except Exception as exc:  # a vmap-only or otherwise unreadable custom mask function
        raise MaskNotSupported(f"hasten cannot read this model's mask function ({type(exc).__name__}: {exc})") \
            from exc
    q = torch.tensor(rows)[:, None]
    kv = torch.arange(length)[None, :]
    if bool(allowed.all()):  # full; a 1-token grid is also causal, which is what a decoder means by it
        return BandMask(length == 1, None)
    if bool(allowed[kv.expand_as(allowed) > q].any()):
        raise MaskNotSupported("the model's mask lets queries see later keys in part, not as a full bidirectional "
                               "mask")
    seen = allowed.sum(dim=1)  # keys each sampled row sees
    truncated = seen < q.squeeze(1) + 1
    window = int(seen[truncated][0]) if bool(truncated.any()) else None
    expected = kv <= q
    if window is not None:
        expected = expected & (kv > q - window)
    if torch.equal(allowed, expected):
        return BandMask(True, window)
    chunk = _chunk_size(mask_function, length, device)
    if chunk is not None and torch.equal(allowed, (kv <= q) & (kv // chunk == q // chunk)):
        return BandMask(True, None, chunk)
    raise MaskNotSupported("the model's mask is not causal within one sliding window or within chunks of one size "
                           "(a blockwise or token-dependent pattern)")


def _chunk_size(mask_function, length: int, device) -> int | None:
    """How many leading queries see key 0: the chunk size of a chunked causal mask (checked by the
    caller against the sampled rows); None when every query sees it."""
    def first_column(where) -> torch.Tensor:
        column = torch.arange(length, device=where)[:, None]
        zero = torch.zeros((), dtype=torch.long, device=where)
        return torch.as_tensor(mask_function(zero, zero, column, zero)).to(torch.bool).expand(length, 1)[:, 0].cpu()

    try:
        sees_first = _on_cpu_or_device(first_column, device)
    except (RuntimeError, IndexError, TypeError):
        return None
    first_blind = int((~sees_first).nonzero()[0]) if bool((~sees_first).any()) else None
    return first_blind if first_blind else None

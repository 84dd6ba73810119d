"""Where the peak of one long-sequence training step goes, by the code that allocated it.

W2_long's hasten_offload model (Llama-8B shape, PEFT LoRA r=16 on every projection, full
checkpointing with the checkpointed inputs on the host, the MLP in tiles), one forward and backward
at each of --lengths with CUDA's allocation history on; the history is replayed to the step's peak
and the blocks live there are summed by the first frame in hasten, transformers or PEFT that
allocated them, printed in GiB and KiB a token. Set side by side, the lengths show which
allocations grow faster than the tokens.

Why (issue 21): the memory preflight draws a line through probe steps; for this model a line
through 16,384 and 32,768 tokens gave 99 KiB a token, while the measured peaks were 138 KiB a token
at 131,072 and 154 at 393,216 (5a4a550), so the maximum it stated (626,499) was too high.

    python benchmarks/memory_attribution.py --lengths 32768,131072 [--top 15] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

OWN_CODE = ("hasten", "transformers", "peft")


# hasten's generic op wrappers (every op's forward and backward pass through them): a block is
# named by the frame that called them, the op's own wrapper or formula (1abb0f8 named 76 KiB a token
# at 131,072 tokens "_lib.py call_in_backward", which op's backward unknown)
GENERIC = ("hasten/ops/_lib.py",)


def _origin(frames: list[dict]) -> str:
    """file:line function of the innermost frame in hasten, transformers or PEFT, past hasten's
    generic op wrappers (else the innermost frame at all): the code that asked for the block."""
    for frame in frames:
        name = frame.get("filename", "")
        if any(name.endswith(generic) for generic in GENERIC):
            continue
        if any(f"/{part}/" in name for part in OWN_CODE):
            return f"{name.split('/site-packages/')[-1].split('/src/')[-1]}:{frame.get('line')} {frame.get('name')}"
    if frames:
        return f"{frames[0].get('filename', '?')}:{frames[0].get('line')} {frames[0].get('name')}"
    return "(no stack)"


def _replay(events: list[dict], baseline: int) -> tuple[int, dict[int, tuple[int, str]]]:
    """The peak of the allocated bytes over the trace, and the blocks live there (addr -> (size,
    origin)). A block counts as freed at free_requested (the allocator's allocated-bytes statistic
    drops there), or at free_completed when no request was seen."""
    live: dict[int, tuple[int, str]] = {}
    total, peak, at_peak = baseline, baseline, {}
    for event in events:
        action, addr, size = event.get("action"), event.get("addr"), int(event.get("size", 0))
        if action == "alloc":
            live[addr] = (size, _origin(event.get("frames", [])))
            total += size
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action in ("free_requested", "free_completed") and addr in live:
            total -= live.pop(addr)[0]
    return peak, at_peak


def _by_origin(at_peak: dict[int, tuple[int, str]]) -> dict[str, int]:
    by_origin: dict[str, int] = defaultdict(int)
    for size, origin in at_peak.values():
        by_origin[origin] += size
    return dict(by_origin)


def _largest(at_peak: dict[int, tuple[int, str]], count: int) -> list[tuple[int, str]]:
    return sorted(at_peak.values(), key=lambda block: -block[0])[:count]


def live_at_peak(events: list[dict], baseline: int = 0) -> tuple[int, dict[str, int]]:
    """Replays an allocator trace (torch.cuda.memory._snapshot()['device_traces'][i]: dicts with
    action, addr, size, frames) from `baseline` bytes already allocated; returns the peak of the
    allocated bytes and, at that peak, the bytes live per origin (blocks allocated before the trace
    began are in the baseline, not in the origins)."""
    peak, at_peak = _replay(events, baseline)
    return peak, _by_origin(at_peak)


def largest_at_peak(events: list[dict], baseline: int = 0, count: int = 10) -> list[tuple[int, str]]:
    """The `count` largest blocks live at the peak, (size, origin), largest first: a workspace that
    grows faster than the tokens shows as one block whose share grows with the length."""
    return _largest(_replay(events, baseline)[1], count)


def attribute(model, tokens: int, variant: str = "hasten_offload") -> dict:
    """One forward and backward of `tokens` with the allocation history recorded."""
    import torch

    from long_context import batch_for

    gc.collect()
    torch.cuda.empty_cache()
    batch = batch_for(tokens, variant)
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        model(**batch).loss.backward()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    model.zero_grad(set_to_none=True)
    device = torch.cuda.current_device()
    trace = snapshot["device_traces"][device]
    peak, at_peak = _replay(trace, baseline)  # once: a long step's trace has tens of thousands of entries
    return {"tokens": tokens, "baseline_gib": baseline / 2**30, "replayed_peak_gib": peak / 2**30,
            "measured_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "entries": len(trace), "by_origin": _by_origin(at_peak),
            "largest_blocks": [[size, origin] for size, origin in _largest(at_peak, 10)]}


def main() -> int:
    import torch

    from long_context import build

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="32768,131072")
    parser.add_argument("--tile_tokens", type=int, default=16384)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model, handle = build("hasten_offload", args.tile_tokens)
    from long_context import batch_for
    model(**batch_for(8192, "hasten_offload")).loss.backward()  # offload calibrated, caches made
    model.zero_grad(set_to_none=True)
    results = []
    for tokens in [int(x) for x in args.lengths.split(",") if x.strip()]:
        result = attribute(model, tokens)
        results.append(result)
        print(f"{tokens:,} tokens: peak {result['measured_peak_gib']:.2f} GiB measured, {result['replayed_peak_gib']:.2f} "
              f"replayed ({result['entries']:,} trace entries), {result['baseline_gib']:.2f} before the step", flush=True)
        ranked = sorted(result["by_origin"].items(), key=lambda item: -item[1])[:args.top]
        for origin, size in ranked:
            print(f"  {size / 2**30:8.2f} GiB {size / tokens / 1024:8.1f} KiB/token  {origin}", flush=True)
        print("  largest blocks live at the peak:", flush=True)
        for size, origin in result["largest_blocks"]:
            print(f"  {size / 2**20:10.1f} MiB {size / tokens:8.1f} B/token  {origin}", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "memory_attribution.json").write_text(json.dumps(results, indent=1))
    if handle is not None:
        handle.undo()
    del model
    torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

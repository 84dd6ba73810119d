"""benchmarks/memory_attribution.py's replay of an allocator trace (CPU, synthetic events): the
peak, and what was live there, by the code that allocated it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from memory_attribution import live_at_peak  # noqa: E402


def _frames(path: str, line: int) -> list[dict]:
    return [{"filename": "/usr/lib/python3/site-packages/torch/_tensor.py", "line": 1, "name": "backward"},
            {"filename": path, "line": line, "name": "f"}]


def test_the_blocks_live_at_the_peak_are_summed_by_their_origin():
    mlp = _frames("/repo/src/hasten/memory/tiling.py", 10)
    attention = _frames("/x/site-packages/transformers/models/llama/modeling_llama.py", 20)
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": mlp},
        {"action": "alloc", "addr": 2, "size": 50, "frames": attention},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 1, "size": 100},  # already counted as freed
        {"action": "alloc", "addr": 1, "size": 30, "frames": attention},  # the address reused
        {"action": "alloc", "addr": 3, "size": 90, "frames": mlp},  # peak: 1000 + 50 + 30 + 90
        {"action": "free_completed", "addr": 3, "size": 90},  # no request seen: freed here
        {"action": "free_requested", "addr": 99, "size": 7},  # allocated before the trace: ignored
    ]
    peak, by_origin = live_at_peak(events, baseline=1000)
    assert peak == 1170
    assert by_origin == {"transformers/models/llama/modeling_llama.py:20 f": 80, "hasten/memory/tiling.py:10 f": 90}


def test_an_empty_trace_peaks_at_its_baseline():
    assert live_at_peak([], baseline=5) == (5, {})


def test_a_block_through_hastens_generic_op_wrappers_is_named_by_their_caller():
    """Every hasten op's backward allocates inside ops/_lib.py's call_in_backward: the op's own
    formula one frame out is what tells one op from another."""
    frames = [{"filename": "/repo/src/hasten/ops/_lib.py", "line": 84, "name": "call_in_backward"},
              {"filename": "/repo/src/hasten/ops/attention.py", "line": 51, "name": "_backward"},
              {"filename": "/usr/lib/python3/site-packages/torch/autograd/function.py", "line": 3, "name": "apply"}]
    _, by_origin = live_at_peak([{"action": "alloc", "addr": 1, "size": 8, "frames": frames}])
    assert by_origin == {"hasten/ops/attention.py:51 _backward": 8}


def test_the_largest_blocks_at_the_peak_come_largest_first():
    from memory_attribution import largest_at_peak

    frames = _frames("/repo/src/hasten/ops/attention.py", 7)
    events = [{"action": "alloc", "addr": a, "size": size, "frames": frames} for a, size in ((1, 5), (2, 50), (3, 20))]
    events.append({"action": "free_requested", "addr": 3, "size": 20})
    assert largest_at_peak(events, count=2) == [(50, "hasten/ops/attention.py:7 f"), (20, "hasten/ops/attention.py:7 f")]

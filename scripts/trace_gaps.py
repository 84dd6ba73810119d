"""GPU busy and idle time of a profiled step, from the chrome trace `logging.profile_step` writes.

    python scripts/trace_gaps.py LOG_DIR/profile_step40_rank0.trace.json [...]

Kernels and memcpy/memset on the GPU are merged into busy intervals (any stream); the rest of the
span from the first to the last GPU activity is idle: the GPU waited for the host (or for a
collective's peer, whose wait shows as a busy NCCL kernel, not as idle). Idle gaps are listed by
size with the host operation running when each began.
"""

from __future__ import annotations

import json
import sys


def summarise(path: str, top: int = 8) -> str:
    events = json.load(open(path)).get("traceEvents", [])
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    gpu = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in device)
    # the host's launch call of each device event (same correlation id): when the host asked for it
    launched = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    first_after = {}  # a gap's end -> the device event that ended it
    for e in device:
        first_after.setdefault(e["ts"], e)
    if not gpu:
        return f"{path}: no GPU activity"
    busy, gaps, (start, end) = 0.0, [], gpu[0]
    for s, e in gpu[1:]:
        if s > end:
            busy += end - start
            gaps.append((s - end, end, s))
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    span = max(e for _, e in gpu) - gpu[0][0]
    idle = sum(g for g, _, _ in gaps)
    buckets = {"<20 us": 0.0, "20-100 us": 0.0, "0.1-1 ms": 0.0, ">1 ms": 0.0}
    for g, _, _ in gaps:
        key = "<20 us" if g < 20 else "20-100 us" if g < 100 else "0.1-1 ms" if g < 1000 else ">1 ms"
        buckets[key] += g
    lines = [f"{path}: GPU span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms ({100 * busy / span:.1f}%), "
             f"idle {idle / 1e3:.1f} ms in {len(gaps)} gaps; idle by gap size (ms): "
             + ", ".join(f"{k} {v / 1e3:.1f}" for k, v in buckets.items())]
    host = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                  if e.get("ph") == "X" and e.get("cat") in ("python_function", "user_annotation", "cpu_op"))
    for gap, at, resumed in sorted(gaps, reverse=True)[:top]:
        running = [name for s, e, name in host if s <= at < e]
        after = first_after.get(resumed)
        when = launched.get(after["args"].get("correlation")) if after else None
        # launched after the gap began: the host was late; before: the GPU waited on something else
        late = f"; next ({after['name'][:40]}) launched {(when - at) / 1e3:+.2f} ms from the gap's start" \
            if when is not None else ""
        lines.append(f"  gap {gap / 1e3:6.2f} ms at +{(at - gpu[0][0]) / 1e3:7.1f} ms; host in: "
                     + " > ".join(running[-3:])[:160] + late)
    return "\n".join(lines)


if __name__ == "__main__":
    for trace in sys.argv[1:]:
        print(summarise(trace))

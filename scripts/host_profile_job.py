"""Where the embedded default job's host time goes on a GPU: cProfile over a whole eager run
(`hasten train`'s defaults, N steps), printed by own time and by cumulative time, with the run's
median step time. A diagnostic for host-bound steps (host lead 0 ms); not a benchmark row.

    python scripts/host_profile_job.py [steps] [size] [out_dir]
"""
import cProfile
import io
import pstats
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import default_job as dj  # noqa: E402

from hasten.training.bench import run_variant  # noqa: E402

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 40
size = sys.argv[2] if len(sys.argv) > 2 else "small"
out = Path(sys.argv[3]) if len(sys.argv) > 3 else Path(".")
config = dj.variant_config("eager", steps, size)
profiler = cProfile.Profile()
profiler.enable()
result = run_variant("eager", config, Path(tempfile.mkdtemp()), progress=False)
profiler.disable()
print(f"median step {result.step_s * 1e3:.2f} ms, {result.tokens_per_s:,.0f} tok/s over {steps} steps")
for key in ("tottime", "cumulative"):
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(80)
    (out / f"host_profile_{key}.txt").write_text(text.getvalue())
    print(text.getvalue()[:6000])
callers = io.StringIO()
stats = pstats.Stats(profiler, stream=callers)
for pattern in ("_io.open", "_cuda_getDeviceCount", "getmodule", "builtins.compile", "gc.collect", "read_band"):
    stats.print_callers(pattern)
for pattern in ("hasten_attention_forward", "_grouped_forward", "_lib.py:69", "_train_loop"):
    stats.print_callees(pattern)
(out / "host_profile_callers.txt").write_text(callers.getvalue())

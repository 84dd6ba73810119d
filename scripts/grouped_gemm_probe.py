"""Which CUTLASS sm90 grouped-GEMM configuration runs the MoE blocks' six expert GEMMs fastest,
against torch._grouped_mm (one fixed configuration: 128x256x64 cooperative, cluster 2x1, or
64x128x128 ping-pong where the mean rows per group or N is at most 128) on the same inputs.

W3's blocks at 16,384 tokens with a random routing (the counts are what matter): per block, the
forward's gate_up and down, the input gradients of both, and both weight gradients. Each
configuration is one TU built from csrc/kernels/grouped_gemm_sm90.cuh (JIT, in parallel); each
result is checked against torch._grouped_mm's (relative Frobenius difference) before it is timed.

Two more columns tell the probe's kernels from what hasten ships (the op ran its tiles 15-40%
slower inside W3's blocks on an H100, 5e6de35, than this probe had timed them on an H200):
  HASTEN_GG_PROBE_FLAGS=build|both  the same TUs also (both) or only (build) compiled with the flags
      hasten's own build gives them (torch's extension defaults, which define __CUDA_NO_HALF_OPERATORS__
      and its kin; the probe's default undefines them): configurations named "...+buildflags"
  hasten's op, where this hasten build has its CUTLASS kernels: `hasten::moe_grouped_mm` and its
      weight gradient with HASTEN_GROUPED_GEMM at each built tile, per call as the experts call it
      (workspace and CUTLASS's initialize included): "hasten_op:<tile>"

  HASTEN_CUTLASS_DIR=/path/to/cutlass python3 scripts/grouped_gemm_probe.py --out DIR
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = {"forward": 0, "input_grad": 1, "weight_grad": 2}
# (tile M, N, K, cluster M, N, ping-pong)
CONFIGS = [
    (128, 256, 64, 2, 1, False),  # torch's
    (128, 128, 64, 2, 1, False),
    (256, 128, 64, 2, 1, False),
    (128, 128, 64, 2, 1, True),
    (64, 256, 64, 2, 1, True),
    (64, 128, 128, 2, 1, True),  # torch's "small"
    (128, 256, 64, 1, 2, False),
    (128, 128, 64, 1, 1, True),
]
if os.environ.get("HASTEN_GG_PROBE_CONFIGS"):  # a subset by index, e.g. "0,3"
    CONFIGS = [CONFIGS[int(i)] for i in os.environ["HASTEN_GG_PROBE_CONFIGS"].split(",")]
BLOCKS = {  # hidden, expert intermediate, experts, top-k
    "qwen3_30b_a3b": (2048, 768, 128, 8),
    "gpt_oss_20b": (2880, 2880, 32, 4),
    "deepseek_v2_lite": (2048, 1408, 64, 6),
}


def config_name(c):
    return f"{c[0]}x{c[1]}x{c[2]}_c{c[3]}x{c[4]}_{'pingpong' if c[5] else 'coop'}"


def build(cutlass: str, build_dir: str, build_flags: bool = False):
    """The probe's TUs as one JIT extension; build_flags: compiled as hasten's setup.py compiles its
    kernels (torch's default defines kept, -lineinfo) instead of with the __CUDA_NO_* defines undone."""
    from torch.utils import cpp_extension
    os.makedirs(build_dir, exist_ok=True)
    sources, decls, table = [], [], []
    for kind_name, kind in KINDS.items():
        for i, c in enumerate(CONFIGS):
            tag = f"{kind_name}_{i}"
            path = os.path.join(build_dir, f"gg_{tag}.cu")
            kind_enum = {0: "kForward", 1: "kInputGrad", 2: "kWeightGrad"}[kind]
            code = f"""#include "grouped_gemm_sm90.cuh"
using namespace hasten::kernels;
using R = grouped_gemm_sm90::Runner<GroupedGemmKind::{kind_enum},
    grouped_gemm_sm90::Config<{c[0]}, {c[1]}, {c[2]}, {c[3]}, {c[4]}, {'true' if c[5] else 'false'}>>;
size_t gg_ws_{tag}(const GroupedGemmParams& p) {{ return R::workspace_bytes(p); }}
int gg_run_{tag}(const GroupedGemmParams& p) {{ return static_cast<int>(R::run(p)); }}
"""
            if not os.path.exists(path) or open(path).read() != code:
                with open(path, "w") as f:
                    f.write(code)
            sources.append(path)
            decls.append(f"size_t gg_ws_{tag}(const GroupedGemmParams&); int gg_run_{tag}(const GroupedGemmParams&);")
            table.append(f"{{{kind}, {i}, gg_ws_{tag}, gg_run_{tag}}}")
    binding = os.path.join(build_dir, "binding.cpp")
    code = """#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include "grouped_gemm.h"
using namespace hasten::kernels;
%s
struct Entry { int kind, config; size_t (*ws)(const GroupedGemmParams&); int (*run)(const GroupedGemmParams&); };
static const Entry kTable[] = { %s };
int run(int64_t kind, int64_t config, torch::Tensor a, torch::Tensor b, torch::Tensor out, torch::Tensor ends,
        int64_t m, int64_t n, int64_t k) {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  GroupedGemmParams p{a.data_ptr(), b.data_ptr(), out.data_ptr(), ends.data_ptr<int32_t>(), (int)ends.numel(),
                      (int)m, (int)n, (int)k, sms, nullptr, 0, c10::cuda::getCurrentCUDAStream().stream()};
  for (const auto& e : kTable) {
    if (e.kind != kind || e.config != config) continue;
    size_t bytes = e.ws(p);
    auto ws = torch::empty({(int64_t)bytes}, a.options().dtype(torch::kUInt8));
    p.workspace = ws.data_ptr(); p.workspace_bytes = bytes;
    return e.run(p);
  }
  return -1;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run); }
""" % ("\n".join(decls), ", ".join(table))
    if not os.path.exists(binding) or open(binding).read() != code:
        with open(binding, "w") as f:
            f.write(code)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    include = [os.path.join(ROOT, "csrc", "kernels"), os.path.join(cutlass, "include"),
               os.path.join(cutlass, "tools", "util", "include")]
    if build_flags:
        flags = ["-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr"]
    else:
        flags = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-DNDEBUG", "-U__CUDA_NO_HALF_OPERATORS__",
                 "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                 "-U__CUDA_NO_HALF2_OPERATORS__"]
    t0 = time.time()
    name = "hasten_gg_probe_buildflags" if build_flags else "hasten_gg_probe"
    mod = cpp_extension.load(name, [binding] + sources, extra_include_paths=include,
                             extra_cuda_cflags=flags, extra_cflags=["-O2", "-std=c++17"], build_directory=build_dir,
                             verbose=False)
    print(f"built {len(sources)} kernels in {time.time() - t0:.0f} s", flush=True)
    return mod


def ends_for(tokens, experts, top_k, gen):
    logits = torch.randn(tokens, experts, generator=gen)
    ids = logits.topk(top_k, dim=-1).indices.flatten()
    counts = torch.bincount(ids, minlength=experts)
    return counts.cumsum(0).to(torch.int32)


def time_ms(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def hasten_op_tiles() -> list[str]:
    """The HASTEN_GROUPED_GEMM values that force each CUTLASS tile of this hasten build (none when it
    has no CUTLASS kernels or hasten is not importable)."""
    try:
        import hasten._C as built  # defines torch.ops.hasten's schemas and kernels
    except Exception as exc:  # noqa: BLE001 - the probe's own columns do not need hasten's build
        print(f"hasten's op not timed: {type(exc).__name__}: {exc}", flush=True)
        return []
    if not getattr(built, "WITH_CUTLASS", 0):
        print("hasten's op not timed: this build has no CUTLASS kernels", flush=True)
        return []
    return ["cutlass_64x256", "cutlass_128x128"]


def hasten_op_call(kind: str, a, b, ends):
    """hasten::moe_grouped_mm (or its weight gradient) on the probe's operands, per call as the
    experts call it; the tile is what HASTEN_GROUPED_GEMM forces (forced_tile). forward: b (E, N, K)
    as stored; input_grad: b (E, K, N), the op's transposed layout; weight_grad: (S, M), (S, N) ->
    (E, M, N) (its one tile, 128x128)."""
    ops = torch.ops.hasten
    if kind == "weight_grad":
        return lambda: ops.moe_grouped_mm_weight_grad(a, b, ends)
    return lambda: ops.moe_grouped_mm(a, b, ends, kind == "input_grad")


@contextlib.contextmanager
def forced_tile(tile: str):
    """HASTEN_GROUPED_GEMM=tile for the block (the op reads it on every call), restored after."""
    previous = os.environ.get("HASTEN_GROUPED_GEMM")
    os.environ["HASTEN_GROUPED_GEMM"] = tile
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("HASTEN_GROUPED_GEMM", None)
        else:
            os.environ["HASTEN_GROUPED_GEMM"] = previous


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--blocks", default=",".join(BLOCKS))
    args = ap.parse_args()
    cutlass = os.environ.get("HASTEN_CUTLASS_DIR", "/tmp/cutlass")
    which = os.environ.get("HASTEN_GG_PROBE_FLAGS", "probe")
    if which not in ("probe", "build", "both"):
        ap.error(f"HASTEN_GG_PROBE_FLAGS must be probe, build or both, got {which!r}")
    modules = []  # (suffix of the configuration names, extension)
    if which in ("probe", "both"):
        modules.append(("", build(cutlass, "/tmp/gg_probe_build")))
    if which in ("build", "both"):
        modules.append(("+buildflags", build(cutlass, "/tmp/gg_probe_build_flags", build_flags=True)))
    op_tiles = hasten_op_tiles()
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for block in args.blocks.split(","):
        hidden, inter, experts, top_k = BLOCKS[block]
        ends = ends_for(args.tokens, experts, top_k, gen).to(dev)
        S = int(ends[-1])
        bf = dict(device=dev, dtype=torch.bfloat16)
        x = torch.randn(S, hidden, **bf)
        w1 = torch.randn(experts, 2 * inter, hidden, **bf) / hidden ** 0.5
        w2 = torch.randn(experts, hidden, inter, **bf) / inter ** 0.5
        act = torch.randn(S, inter, **bf)
        g_gu = torch.randn(S, 2 * inter, **bf)
        g_y = torch.randn(S, hidden, **bf)
        # (name, kind, a, b, m, n, k, torch's call, out shape)
        gemms = [
            ("fwd_gate_up", "forward", x, w1, 0, 2 * inter, hidden,
             lambda: torch._grouped_mm(x, w1.transpose(-2, -1), offs=ends), (S, 2 * inter)),
            ("fwd_down", "forward", act, w2, 0, hidden, inter,
             lambda: torch._grouped_mm(act, w2.transpose(-2, -1), offs=ends), (S, hidden)),
            ("dx_down", "input_grad", g_y, w2, 0, inter, hidden,
             lambda: torch._grouped_mm(g_y, w2, offs=ends), (S, inter)),
            ("dx_gate_up", "input_grad", g_gu, w1, 0, hidden, 2 * inter,
             lambda: torch._grouped_mm(g_gu, w1, offs=ends), (S, hidden)),
            ("dw_down", "weight_grad", g_y, act, hidden, inter, 0,
             lambda: torch._grouped_mm(g_y.t(), act, offs=ends), (experts, hidden, inter)),
            ("dw_gate_up", "weight_grad", g_gu, x, 2 * inter, hidden, 0,
             lambda: torch._grouped_mm(g_gu.t(), x, offs=ends), (experts, 2 * inter, hidden)),
        ]
        total_torch, total_best = 0.0, 0.0
        for name, kind, a, b, m, n, k, ref_fn, shape in gemms:
            flops = 2.0 * S * (m * n if kind == "weight_grad" else n * k)
            want = ref_fn().float()
            t_torch = time_ms(ref_fn)
            row = {"block": block, "gemm": name, "rows": S, "torch_ms": round(t_torch, 4),
                   "torch_tflops": round(flops / t_torch / 1e9, 1), "configs": {}}
            best = (t_torch, "torch")
            for suffix, mod in modules:
                for i, c in enumerate(CONFIGS):
                    out = torch.empty(shape, **bf)
                    out.fill_(float("nan"))
                    call = lambda mod=mod, i=i, out=out: mod.run(KINDS[kind], i, a, b, out, ends, m, n, k)
                    rc = call()
                    torch.cuda.synchronize()
                    label = config_name(c) + suffix
                    if rc != 0:
                        row["configs"][label] = {"error": rc}
                        continue
                    err = float((out.float() - want).norm() / want.norm().clamp_min(1e-30))
                    t = time_ms(call)
                    row["configs"][label] = {"ms": round(t, 4), "tflops": round(flops / t / 1e9, 1),
                                             "rel_err": float(f"{err:.2e}")}
                    if err < 1e-2 and t < best[0]:
                        best = (t, label)
            for tile in op_tiles if kind != "weight_grad" else op_tiles[-1:]:  # one weight-gradient tile
                label = f"hasten_op:{tile}"
                call = hasten_op_call(kind, a, b, ends)
                with forced_tile(tile):
                    got = call()
                    err = float((got.float() - want).norm() / want.norm().clamp_min(1e-30))
                    t = time_ms(call)
                row["configs"][label] = {"ms": round(t, 4), "tflops": round(flops / t / 1e9, 1),
                                         "rel_err": float(f"{err:.2e}")}
            row["best"] = best[1]
            row["best_ms"] = round(best[0], 4)
            total_torch += t_torch
            total_best += best[0]
            rows.append(row)
            cfgs = "  ".join(f"{k_}:{v.get('ms', v)}" for k_, v in row["configs"].items())
            print(f"{block:18s} {name:12s} torch {t_torch:.3f} ms ({row['torch_tflops']} TF/s)  best {best[1]} "
                  f"{best[0]:.3f}  | {cfgs}", flush=True)
        print(f"{block}: six GEMMs torch {total_torch:.3f} ms, best per GEMM {total_best:.3f} ms "
              f"({total_torch / total_best:.2f}x)", flush=True)
    with open(os.path.join(args.out, "grouped_gemm_probe.json"), "w") as f:
        json.dump({"commit": os.environ.get("HASTEN_COMMIT", ""), "device": torch.cuda.get_device_name(),
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

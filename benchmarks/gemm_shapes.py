"""The base GEMMs of W4's step, one shape at a time: where the projections' 694 TFLOP/s goes.

W4 (benchmarks/lora_sft.py) runs a Llama-8B shape with frozen bf16 projections: per layer and step
each projection runs its forward GEMM y = x W^T (x: T x in, W: out x in) and its input-gradient
GEMM dx = g W (g: T x out). This times those GEMMs on random bf16 data with ATen (what the fused
LoRA op calls), each as written (beta 0) and accumulating onto an existing output (beta 1: the
fused LoRA op's base GEMM adds onto the rank-r update), through cuBLAS and cuBLASLt, and the
q/k/v and gate/up projections as one GEMM over their concatenated weights. It prints TFLOP/s per
shape and the step's total GEMM time under each choice (32 layers).

    python3 benchmarks/gemm_shapes.py [--tokens 16384] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HIDDEN, INTERMEDIATE, KV, LAYERS = 4096, 14336, 1024, 32
# (name, out features, in features, how many per layer)
PROJECTIONS = [("q_proj/o_proj", HIDDEN, HIDDEN, 2), ("k_proj/v_proj", KV, HIDDEN, 2),
               ("gate_proj/up_proj", INTERMEDIATE, HIDDEN, 2), ("down_proj", HIDDEN, INTERMEDIATE, 1)]
GROUPED = [("qkv (one GEMM)", HIDDEN + 2 * KV, HIDDEN, 1), ("gate_up (one GEMM)", 2 * INTERMEDIATE, HIDDEN, 1)]


def _time_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def measure(tokens: int, out_features: int, in_features: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    g = torch.randn(tokens, out_features, device="cuda", dtype=torch.bfloat16, generator=gen)
    y = torch.empty(tokens, out_features, device="cuda", dtype=torch.bfloat16)
    dx = torch.empty(tokens, in_features, device="cuda", dtype=torch.bfloat16)
    flop = 2.0 * tokens * out_features * in_features
    row = {}
    for library in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(library)
        cases = {"fwd": lambda: torch.mm(x, w.t(), out=y), "fwd_beta1": lambda: y.addmm_(x, w.t()),
                 "dx": lambda: torch.mm(g, w, out=dx), "dx_beta1": lambda: dx.addmm_(g, w)}
        for case, fn in cases.items():
            ms = _time_ms(fn)
            row[f"{library}:{case}"] = {"ms": ms, "tflops": flop / ms / 1e9}
    torch.backends.cuda.preferred_blas_library("cublas")
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--out", default=None, help="folder for gemm_shapes.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gemm_shapes: needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"gemm_shapes: {torch.cuda.get_device_name()}, torch {torch.__version__}, T={args.tokens}")
    results = {}
    for name, out_f, in_f, _ in PROJECTIONS + GROUPED:
        results[name] = row = measure(args.tokens, out_f, in_f)
        print(f"{name:>20} ({out_f}x{in_f}): " + "  ".join(
            f"{case} {v['ms']:.3f} ms {v['tflops']:.0f}" for case, v in row.items()))

    # GEMMs of each shape per layer: one per projection, or q/k/v and gate/up as one GEMM each
    # (o_proj and down_proj stay alone)
    separate = {name: count for name, _, _, count in PROJECTIONS}
    grouped_counts = {"q_proj/o_proj": 1, "qkv (one GEMM)": 1, "gate_up (one GEMM)": 1, "down_proj": 1}

    def step_ms(case_fwd: str, case_dx: str, grouped: bool) -> float:
        counts = grouped_counts if grouped else separate
        return LAYERS * sum(n * (results[name][case_fwd]["ms"] + results[name][case_dx]["ms"])
                            for name, n in counts.items())

    summary = {}
    for library in ("cublas", "cublaslt"):
        for beta in ("", "_beta1"):
            for grouped in (False, True):
                key = f"{library} beta{'1' if beta else '0'}{' grouped' if grouped else ''}"
                summary[key] = step_ms(f"{library}:fwd{beta}", f"{library}:dx{beta}", grouped)
                print(f"step's projection GEMMs, {key}: {summary[key]:.1f} ms")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gemm_shapes.json").write_text(json.dumps({"shapes": results, "step_ms": summary},
                                                                    indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""W3: one MoE block forward + backward, Qwen3-30B-A3B shape, 16,384 tokens, one H200.

Variants in one run (rows to benchmarks/results/W3.jsonl):
  hf_moe_eager        transformers' expert loop
  hf_moe_grouped_mm   transformers' experts_implementation="grouped_mm" (sort + histc + cumsum)
  hasten_fused        hasten: one-kernel grouping, grouped GEMM, fused SwiGLU, deterministic combine
and the grouping alone: hasten::moe_group against sort + histc + cumsum + inverse scatter.

    python benchmarks/moe_block.py [--tokens 16384] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from hasten.integrations.transformers import registered  # noqa: E402
from hasten.observability import count_host_syncs, fallback_counts, reset_fallbacks  # noqa: E402
from hasten.ops import moe as moe_ops  # noqa: E402

IMPL = {"hf_moe_eager": "eager", "hf_moe_grouped_mm": "grouped_mm", "hasten_fused": "hasten_fused"}


def build_block():
    config = Qwen3MoeConfig(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                            norm_topk_prob=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        block = Qwen3MoeSparseMoeBlock(config)
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.02)
    return block.to(torch.bfloat16), config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    block, config = build_block()
    x = torch.randn(1, args.tokens, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    run_id = common.new_run_id()
    rows, outputs = [], {}
    with registered():  # the "hasten_fused" experts name, which accelerate() would register
        for name, impl in IMPL.items():
            reset_fallbacks()
            config._experts_implementation = impl

            def step():
                x.grad = None
                block.zero_grad(set_to_none=True)
                block(x).backward(grad)

            iters = 3 if name == "hf_moe_eager" else args.iters
            times = common.time_steps(step, warmup=2, iters=iters)
            with count_host_syncs() as syncs:
                step()
            with torch.no_grad():
                outputs[name] = block(x).float()
            rows.append({"workload": "W3", "variant": name, "run_id": run_id, **common.environment(),
                         "tokens_per_s": args.tokens / common.median(times), "step_s": common.median(times),
                         "peak_gib": None, "host_syncs_per_step": syncs.count, "correct": None,
                         "notes": f"fwd+bwd ms {[round(t * 1000, 2) for t in times]}; fallbacks {fallback_counts()}"})
    ref = outputs["hf_moe_eager"]
    for row in rows:
        err = ((outputs[row["variant"]] - ref).norm() / ref.norm()).item()
        row["correct"] = err <= 1e-2
        row["notes"] += f"; output rel err vs eager {err:.2e}"

    ids = torch.randint(0, 128, (args.tokens, 8), device="cuda")

    def sort_histc_cumsum():
        flat = ids.view(-1)
        sorted_ids, perm = torch.sort(flat, stable=True)
        counts = torch.histc(sorted_ids.int(), bins=128, min=0, max=127)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device="cuda")
        return offsets, perm, inverse

    for name, fn in (("torch_sort_histc_cumsum", sort_histc_cumsum), ("hasten_moe_group", lambda: moe_ops.group(ids, 128))):
        times = common.time_steps(fn, warmup=5, iters=50)
        rows.append({"workload": "W3_grouping", "variant": name, "run_id": run_id, **common.environment(),
                     "tokens_per_s": None, "step_s": common.median(times), "peak_gib": None,
                     "host_syncs_per_step": 0, "correct": True, "notes": f"{args.tokens} tokens x top-8, 128 experts"})
    path = common.write_rows(rows, "W3", args.out)
    for r in rows:
        print(f"{r['workload']:>12} {r['variant']:>24}: {r['step_s'] * 1000:8.3f} ms  syncs {r['host_syncs_per_step']:>4}"
              f"  correct {r['correct']}  {r['notes'][:90]}")
    by = {r["variant"]: r for r in rows}
    print(f"hasten_fused vs hf_moe_grouped_mm: {by['hf_moe_grouped_mm']['step_s'] / by['hasten_fused']['step_s']:.2f}x; "
          f"vs eager {by['hf_moe_eager']['step_s'] / by['hasten_fused']['step_s']:.1f}x; grouping op "
          f"{by['torch_sort_histc_cumsum']['step_s'] / by['hasten_moe_group']['step_s']:.2f}x")
    print(f"rows appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""W3_router: one MoE router's forward + backward, the model's own against hasten's
(`training.moe.fused_router`: its logits GEMM, then hasten::moe_route), on the GPU.

Routers of W3's blocks and DeepSeek-V3's (transformers' classes, every weight in bf16 as
transformers 5.17 loads them): Qwen3-30B-A3B (128 experts, top-8, hidden 2048), gpt-oss-20b
(32, top-4, 2880, a bias, top-k before the softmax), DeepSeek-V2-Lite (64, top-6, 2048, float32
logits), DeepSeek-V3 (256, top-8, 7168, sigmoid, correction bias, 8 groups keeping 4). Per router and
token count: GPU microseconds per forward + backward (back to back between two events: the
kernels' own time) and host microseconds to issue one (what a host-bound step pays per MoE layer).

    python benchmarks/moe_router.py [--tokens 2048,16384] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from hasten.integrations.architectures import ARCHITECTURES  # noqa: E402
from hasten.moe.router import install_fused_routers  # noqa: E402
from hasten.observability import count_host_syncs  # noqa: E402


def routers() -> dict:
    """name -> (model type, a function building the router module on the GPU in bf16 as loaded)."""
    from transformers import DeepseekV2Config, DeepseekV3Config, GptOssConfig, Qwen3MoeConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    def build(cls, config):
        def make():
            router = cls(config).to("cuda", torch.bfloat16)
            for p in router.parameters():
                torch.nn.init.normal_(p, std=0.02)
            bias = getattr(router, "e_score_correction_bias", None)
            if bias is not None:
                bias.data = (torch.randn_like(bias, dtype=torch.float32) * 0.01).to(bias.dtype)
            return router
        return make

    return {
        "qwen3_30b_a3b": ("qwen3_moe", build(Qwen3MoeTopKRouter, Qwen3MoeConfig(
            hidden_size=2048, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True))),
        "gpt_oss_20b": ("gpt_oss", build(GptOssTopKRouter, GptOssConfig(
            hidden_size=2880, num_local_experts=32, num_experts_per_tok=4))),
        "deepseek_v2_lite": ("deepseek_v2", build(DeepseekV2TopkRouter, DeepseekV2Config(
            hidden_size=2048, n_routed_experts=64, num_experts_per_tok=6, routed_scaling_factor=1.0,
            topk_method="greedy", n_group=1, topk_group=1))),
        "deepseek_v3": ("deepseek_v3", build(DeepseekV3TopkRouter, DeepseekV3Config(
            hidden_size=7168, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
            norm_topk_prob=True, routed_scaling_factor=2.5))),
    }


def step_fn(router, hidden, grad):
    """One forward + backward of the router as its MoE block uses it: the weights' gradient (and
    a small one on the logits, as an aux loss would give)."""
    def step():
        logits, weights, ids = router(hidden)
        loss = (weights.float() * grad).sum() + logits.float().sum() * 1e-6
        loss.backward()
    return step


def host_us(step, iters: int = 20) -> float:
    """Host microseconds to issue one step (the GPU kept busy before, so the host never waits)."""
    common.sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    common.sync()
    return common.median(times) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="2048,16384")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    run_id = common.new_run_id()
    rows = []
    for name, (model_type, make) in routers().items():
        for tokens in [int(t) for t in args.tokens.split(",")]:
            router = make()
            hidden = torch.randn(tokens, router.weight.shape[1], device="cuda", dtype=torch.bfloat16,
                                 requires_grad=True)
            grad = torch.randn(tokens, router.top_k, device="cuda")
            result = {}
            for variant in ("model", "hasten"):
                undo = None
                if variant == "hasten":
                    undo, count, reasons = install_fused_routers([router], ARCHITECTURES[model_type].router)
                    if reasons or not count:
                        raise RuntimeError(f"{name}: the fused router refused: {reasons}")
                step = step_fn(router, hidden, grad)
                with count_host_syncs() as syncs:
                    step()
                    common.sync()
                gpu = common.time_us(step, iters=50)
                host = host_us(step)
                result[variant] = (gpu, host, syncs.count)
                if undo is not None:
                    undo()
            for variant, (gpu, host, syncs) in result.items():
                row = {"workload": "W3_router", "variant": variant, "router": name, "tokens": tokens,
                       "run_id": run_id, **common.environment(), "gpu_us": gpu, "host_us": host,
                       "host_syncs_per_step": syncs}
                rows.append(row)
            (mg, mh, _), (hg, hh, _) = result["model"], result["hasten"]
            print(f"{name:>18} T={tokens:>6}: model {mg:8.1f} us GPU {mh:7.1f} us host | hasten {hg:8.1f} us GPU "
                  f"{hh:7.1f} us host | {mg / hg:.2f}x GPU, {mh / hh:.2f}x host", flush=True)
    path = common.write_rows(rows, "W3_router", args.out)
    print(f"rows appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

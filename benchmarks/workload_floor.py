"""The arithmetic floor of each workload's step, and the largest ratio it leaves each target.

A training step cannot take less time than its matrix products at the board's best rate, whatever
its other kernels cost. This counts those products for one step (forward and backward) and sets
the measured rows in results/ against them:

  W1, W1-<model>  packed_sft.py's shapes on the meta device: every nn.Linear, the LM head included,
                  6 T in out (forward, input gradient, weight gradient: full fine-tuning); attention
                  per layer and head over W1's batch (make_samples: 61 samples, 16,384 tokens), the
                  key positions each query attends to (a window where the config's layer_types
                  marks a layer sliding), 8 d + 6 d_v a query-key pair (QK^T and PV forward; the
                  backward's recomputed QK^T, dP, dV, dQ and dK)
  W4              lora_sft.py's Llama-8B shape, LoRA r=16 on q, k, v, o, gate, up, down: 4 T in out
                  per frozen projection and the LM head (forward and input gradient; none for the
                  first layer's q/k/v, whose input needs no gradient), 6 T r (in + out) per adapter,
                  and the attention as W1's
  W3              moe_block.py's blocks: T x top-k rows through gate/up and down, the shared
                  experts on every token, the router; x 3 (the input and every weight take a
                  gradient)

At --tflops (792: the best bf16 GEMM rate measured on the H200 here, issue 20) this is the floor.
For each target the script prints the matrix rate it needs with every other kernel free: "A at
least k x B" in one run means A's step at most B's step / k, and hasten computes what the model
computes, so it cannot drop products. A rate above the chip's dense bf16 peak (about 990 TFLOP/s)
cannot be had; one above the 769-798 measured on these boards under random data would need a GEMM
faster than any seen here.

    python benchmarks/workload_floor.py [--tflops 792] [--results benchmarks/results]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

# The best bf16 matrix rate measured on the H200s here: 792 TFLOP/s (issue 20's W4 bound), 769-798
# for an 8192^3 product on random data (the device tool's KINDS.md): the 700 W limit holds the SM
# clock near 1,500-1,650 MHz under such products. The datasheet's dense bf16 peak (about 990)
# assumes 1,980 MHz held, which these boards reach only on zeros (894 measured).
PEAK_TFLOPS = 792.0
MEASURED_CEILING_TFLOPS = 798.0
SPEC_TFLOPS = 990.0
LORA_RANK = 16
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass
class Floor:
    workload: str
    gemm_flop: float  # one step's matrix products outside attention
    attention_flop: float  # one step's attention products (forward and backward)
    tokens: int

    def seconds(self, tflops: float = PEAK_TFLOPS) -> float:
        return (self.gemm_flop + self.attention_flop) / (tflops * 1e12)

    def flop_per_token(self) -> float:
        return (self.gemm_flop + self.attention_flop) / self.tokens


def attended_keys(lengths: list[int], window: int | None) -> int:
    """Query-key pairs of causal attention over packed samples: query i of a sample sees its keys
    0..i, the last `window` of them where a window is set (transformers' sliding layers: keys
    i - window + 1 .. i)."""
    pairs = 0
    for n in lengths:
        if window is None or window >= n:
            pairs += n * (n + 1) // 2
        else:  # queries 0..window-1 see i + 1 keys, the rest window each
            pairs += window * (window + 1) // 2 + (n - window) * window
    return pairs


def attention_flop(config, lengths: list[int]) -> float:
    """Forward + backward attention FLOPs of one step over the packed samples, every layer."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    value_dim = getattr(config, "v_head_dim", None) or head_dim
    per_pair = 8 * head_dim + 6 * value_dim  # forward 2d + 2dv; backward 2d (recompute) + 2dv + 2dv + 2d + 2d
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    total = 0
    for kind in layer_types[: config.num_hidden_layers]:
        total += attended_keys(lengths, window if kind == "sliding_attention" else None)
    return float(total * heads * per_pair)


def _linears(model: torch.nn.Module):
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            yield name, module.in_features, module.out_features


def dense_full_floor(workload: str, config, lengths: list[int]) -> Floor:
    """Full fine-tuning: every linear layer's three GEMMs (6 T in out FLOPs)."""
    tokens = sum(lengths)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    gemm = sum(6.0 * tokens * fan_in * fan_out for _, fan_in, fan_out in _linears(model))
    return Floor(workload, gemm, attention_flop(config, lengths), tokens)


def dense_lora_floor(workload: str, config, lengths: list[int], rank: int = LORA_RANK,
                     targets: tuple[str, ...] = LORA_TARGETS) -> Floor:
    """LoRA on `targets` over a frozen base: each frozen projection's forward and input gradient
    (4 T in out; the first layer's q/k/v read the embedding, which needs no gradient: 2 T in out),
    each adapter's 6 T r (in + out), the LM head forward and input gradient."""
    tokens = sum(lengths)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    first_layer = {f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")}
    gemm = 0.0
    for name, fan_in, fan_out in _linears(model):
        gemm += (2.0 if name in first_layer else 4.0) * tokens * fan_in * fan_out
        if name.rsplit(".", 1)[-1] in targets:
            gemm += 6.0 * tokens * rank * (fan_in + fan_out)
    return Floor(workload, gemm, attention_flop(config, lengths), tokens)


def moe_block_floor(block: str, config, tokens: int) -> Floor:
    """One MoE block, forward + backward (x3): routed rows T x top-k through a gated expert
    (gate, up, down: 3 hidden x intermediate), shared experts on every token, the router."""
    hidden = config.hidden_size
    experts = next(getattr(config, k) for k in ("num_experts", "n_routed_experts", "num_local_experts")
                   if getattr(config, k, None))
    top_k = config.num_experts_per_tok
    expert_width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared_width = (getattr(config, "n_shared_experts", 0) or 0) * expert_width
    if block == "llama4_scout":  # one shared expert of the dense MLP's width (Llama4TextMLP)
        shared_width = config.intermediate_size
    forward = 2.0 * tokens * (top_k * 3 * hidden * expert_width + 3 * hidden * shared_width + hidden * experts)
    return Floor(f"W3 {block}", 3 * forward, 0.0, tokens)


def _newest_rows(path: Path, **match) -> dict[str, dict]:
    """The newest run's rows of a results file by variant (rows matching `match`), {} without one."""
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if all(r.get(k) == v for k, v in match.items()) and r.get("step_s")]
    if not rows:
        return {}
    newest = max(r["run_id"] for r in rows)
    return {r["variant"]: r for r in rows if r["run_id"] == newest}


@dataclasses.dataclass
class Target:
    """`variant` at least `ratio` x `baseline`'s tokens/s (or, without a baseline, at most
    `step_s` seconds a step)."""
    variant: str
    ratio: float = 0.0
    baseline: str | None = None
    step_s: float | None = None


def verdict(required_tflops: float) -> str:
    """What a target's required matrix rate (every other kernel free) means on this board."""
    if required_tflops > SPEC_TFLOPS:
        return f"cannot be met: above the chip's dense bf16 peak ({SPEC_TFLOPS:.0f})"
    if required_tflops > MEASURED_CEILING_TFLOPS:
        return (f"above every bf16 GEMM rate measured on these boards ({MEASURED_CEILING_TFLOPS:.0f} at most on "
                f"random data, held there by the 700 W limit)")
    return f"{required_tflops / MEASURED_CEILING_TFLOPS:.0%} of the measured GEMM ceiling"


def report(floor: Floor, rows: dict[str, dict], targets: list[Target], tflops: float) -> list[str]:
    floor_s = floor.seconds(tflops)
    flop = floor.gemm_flop + floor.attention_flop
    lines = [f"{floor.workload}: GEMMs {floor.gemm_flop / 1e12:.2f} TFLOP, attention {floor.attention_flop / 1e12:.2f} "
             f"TFLOP a step; floor {floor_s * 1e3:.2f} ms at {tflops:.0f} TFLOP/s"
             + ("" if floor.workload.startswith("W3") else f" ({floor.tokens / floor_s:,.0f} tokens/s)")]
    if rows:
        run = next(iter(rows.values()))["run_id"]
        lines.append(f"  newest run {run}:")
        for name, row in sorted(rows.items()):
            lines.append(f"    {name:28s} {row['step_s'] * 1e3:9.2f} ms a step, floor {floor_s / row['step_s']:.0%} of it")
    for target in targets:
        have = rows.get(target.variant)
        if target.baseline is not None:
            base = rows.get(target.baseline)
            if base is None:
                lines.append(f"  target {target.variant} >= {target.ratio:g}x {target.baseline}: no {target.baseline} row")
                continue
            step_s = base["step_s"] / target.ratio
            measured = f", measured {base['step_s'] / have['step_s']:.2f}x" if have else ""
            what = f"{target.variant} >= {target.ratio:g}x {target.baseline} ({step_s * 1e3:.2f} ms a step{measured})"
        else:
            step_s = target.step_s
            measured = f", measured {have['step_s'] * 1e3:.2f} ms" if have else ""
            what = f"{target.variant} <= {step_s * 1e3:.2f} ms a step{measured}"
        required = flop / step_s / 1e12
        lines.append(f"  target {what}: needs its products at {required:.0f} TFLOP/s with every other kernel free; {verdict(required)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tflops", type=float, default=PEAK_TFLOPS)
    parser.add_argument("--results", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)

    import lora_sft
    import moe_block
    import packed_sft

    lengths = [len(s) for s in packed_sft.make_samples()]
    out: list[str] = []
    for model, make_config in packed_sft.SHAPES.items():
        if model == "gpt_oss_20b":  # a MoE shape: its experts are not nn.Linear (W3 counts its block)
            continue
        workload = "W1" if model == "qwen3_0.6b" else f"W1-{model}"
        floor = dense_full_floor(workload, make_config(), lengths)
        rows = _newest_rows(args.results / f"{workload}.jsonl")
        targets = [Target("hasten", 2.0, "hasten_unfused")]  # issue 17
        if model == "qwen3_0.6b":
            targets = [Target("hasten", step_s=packed_sft.TOKENS / 130_000)]  # issue 16
        elif model == "gemma3_1b":
            targets.append(Target("hasten", 1.3, "liger"))
        out += report(floor, rows, targets, args.tflops) + [""]
    w4 = dense_lora_floor("W4", lora_sft.llama_8b(), lengths)
    w4_target = Target("hasten", step_s=packed_sft.TOKENS / 18_000)  # issue 20
    out += report(w4, _newest_rows(args.results / "W4.jsonl"), [w4_target], args.tflops) + [""]
    for block in ("qwen3_30b_a3b", "gpt_oss_20b", "deepseek_v2_lite"):
        floor = moe_block_floor(block, moe_block.block_config(block), packed_sft.TOKENS)
        targets = [Target("hasten_fused", 2.0, "hf_moe_grouped_mm")]  # issue 18; the Qwen3 block's steps: 16, 18
        if block == "qwen3_30b_a3b":
            targets += [Target("hasten_graphed", step_s=7e-3), Target("hasten_fused", step_s=6.5e-3)]
        out += report(floor, _newest_rows(args.results / "W3.jsonl", block=block), targets, args.tflops) + [""]
    print("\n".join(out).rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())

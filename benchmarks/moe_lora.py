"""W5: MoE LoRA on a Qwen3-30B-A3B shape, one H200 (see docs/benchmarks.md).

Qwen3-30B-A3B's shape (hidden 2048, 128 experts, top-8, expert intermediate 768, 32 heads, 4 K/V
heads, head 128, vocabulary 151,936) with random bf16 weights and --layers decoder layers (48 in
the real model: 61 GB of bf16 weights; fewer when a variant would not fit, stated in the row),
PEFT LoRA r=16, alpha 32 on q, k, v, o and on the experts' gate_up_proj and down_proj
(target_parameters; float32 adapters, lora_B drawn at random), W1's 16,384-token batch, packed.
One run measures, on the same weights:

  hasten        hasten.accelerate after get_peft_model: packed varlen attention, fused norm, RoPE,
                loss, the experts on the one-kernel grouping path with the expert LoRA split
                (x W^T + s (x rhs^T) lhs^T on grouped GEMMs), the attention LoRA on the fused
                LoRA op; full checkpointing
  hf_grouped_mm transformers' grouped_mm experts + PEFT (whose parametrization folds the merged
                W + s lhs @ rhs per forward), packed with position_ids, sdpa, full checkpointing

Unsloth's MoE path is not in it: its wheel with its dependencies needs 61 GB of disk on the GPU
machine's 64 (issue 20's note). Each row: tokens/s (median step), peak GiB, first loss against
hf_grouped_mm's.

    python benchmarks/moe_lora.py [--variants hasten,hf_grouped_mm] [--layers 24] [--steps 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from packed_sft import TOKENS, make_samples  # noqa: E402

import hasten  # noqa: E402
from hasten.config import Config  # noqa: E402
from hasten.packing import move_batch  # noqa: E402

WORKLOAD = "W5"
RANK, ALPHA = 16, 32
ATTENTION_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
LOSS_TOLERANCE = 2e-2
VOCAB = 151936


def qwen3_30b_a3b(layers: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=layers,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
                          tie_word_embeddings=False, use_cache=False)


def build(name: str, layers: int, samples):
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = qwen3_30b_a3b(layers)
    with torch.device("cuda"):
        base = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    base.train()
    if name == "hf_grouped_mm":
        base.set_experts_implementation("grouped_mm")
    model = peft.get_peft_model(base, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                      target_modules=ATTENTION_TARGETS,
                                                      target_parameters=EXPERT_TARGETS))
    gen = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for pname, param in sorted(model.named_parameters()):
            if "lora_B" in pname:
                param.normal_(std=0.02, generator=gen)
    packed = move_batch(hasten.PackingCollator(max_tokens=TOKENS)([{"input_ids": s} for s in samples]), "cuda")
    handles, notes = [], []
    if name == "hasten":
        handle = hasten.accelerate(model.get_base_model(),
                                   Config.from_dict({"training": {"checkpoint": {"activations": "full"}}}))
        handles.append(handle)
        notes.append(handle.report().replace("\n", " | "))
        return model, [packed], handles, notes
    model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    return model, [{k: packed[k] for k in ("input_ids", "position_ids", "labels")} | {"use_cache": False}], handles, notes


def run_variant(name: str, layers: int, samples, steps: int) -> dict:
    measured = common.measure_training(lambda: build(name, layers, samples), steps, TOKENS)
    return {"workload": WORKLOAD, "variant": name, **common.environment(), **measured, "layers": layers}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="hf_grouped_mm,hasten")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (48 in Qwen3-30B-A3B)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("W5 needs a CUDA GPU", file=sys.stderr)
        return 1
    samples = make_samples(vocab=VOCAB)
    print(f"{WORKLOAD}: {len(samples)} samples, {sum(map(len, samples))} tokens, {args.layers} layers, LoRA r={RANK} "
          f"on {','.join(ATTENTION_TARGETS + EXPERT_TARGETS)}", flush=True)
    run_id, rows, reference_loss = common.new_run_id(), [], None
    for name in args.variants.split(","):
        try:
            row = run_variant(name, args.layers, samples, args.steps) | {"run_id": run_id}
        except Exception as exc:  # noqa: BLE001 - one variant's failure (out of memory) must not cost the other
            traceback.print_exc()
            row = {"workload": WORKLOAD, "variant": name, **common.environment(), "tokens_per_s": None,
                   "step_s": None, "peak_gib": None, "layers": args.layers, "run_id": run_id,
                   "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"}
            gc.collect()
            torch.cuda.empty_cache()
        if name == "hf_grouped_mm" and row["step_s"] is not None:
            reference_loss = row["losses"][0]
        common.check_first_loss(row, "hf_grouped_mm", reference_loss, LOSS_TOLERANCE)
        rows.append(row)
        common.write_rows([row], WORKLOAD, args.out)
        common.print_training_row(row, "hf_grouped_mm", width=14)
    done = {r["variant"]: r for r in rows if r["step_s"] is not None}
    if {"hasten", "hf_grouped_mm"} <= done.keys():
        common.print_ratio(done["hasten"], done["hf_grouped_mm"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
  hasten_weights_in_combine  hasten with the router's weights in the combine
                (training.moe.weights_in_gate: false), as before 2026-12-06
  hf_grouped_mm transformers' grouped_mm experts + PEFT (whose parametrization folds the merged
                W + s lhs @ rhs per forward), packed with position_ids, sdpa, full checkpointing

  unsloth       Unsloth 2026.10.9 (benchmarks/w4_unsloth.py, the offline bundle from
                scripts/unsloth_bundle.sh), alone in its process (--variants unsloth): the same seed-0
                weights saved to a folder and loaded with FastLanguageModel.from_pretrained, LoRA through
                its get_peft_model on the same targets (target_parameters for the experts), its
                "unsloth" gradient checkpointing, fed the packed row as its trainer feeds it
                (position_ids restarting per sample, packed_seq_lengths)

Each row: tokens/s (median step), peak GiB, first loss against hf_grouped_mm's (for unsloth, from
this commit's hf_grouped_mm row in --out, written by the run before it).

    python benchmarks/moe_lora.py [--variants hasten,hf_grouped_mm] [--layers 24] [--steps 3] [--out DIR]
    python benchmarks/moe_lora.py --variants unsloth [--layers 24] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (torch only: no transformers before unsloth)

# Unsloth patches transformers, PEFT and TRL when it is imported and replaces model code at load: its
# variant runs alone in a process of its own, unsloth imported before anything else (as in lora_sft.py).
UNSLOTH_PROCESS = common.variants_asked(sys.argv[1:]) == ["unsloth"]
if UNSLOTH_PROCESS:
    import w4_unsloth

    w4_unsloth.prepare_unsloth_env(w4_unsloth.ensure_bundle(os.environ.get("HASTEN_UNSLOTH_SITE",
                                                                           "/tmp/unsloth_site")))
    import unsloth  # noqa: F401

import torch  # noqa: E402

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


def seeded_adapters(model) -> None:
    """lora_B at random (PEFT starts it at zero, which would hide what the adapters compute), the same
    values in every variant: drawn in a fixed parameter-name order from one generator."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for pname, param in sorted(model.named_parameters()):
            if "lora_B" in pname:
                param.normal_(std=0.02, generator=gen)


def build_unsloth(layers: int, samples):
    import w4_unsloth

    model, note = w4_unsloth.unsloth_moe_lora_model(
        qwen3_30b_a3b(layers), r=RANK, alpha=ALPHA, target_modules=ATTENTION_TARGETS,
        target_parameters=EXPERT_TARGETS, folder=f"/tmp/w5_qwen3_30b_a3b_{layers}l", max_seq_length=TOKENS)
    seeded_adapters(model)
    batch = w4_unsloth.unsloth_packed_batch(samples, "cuda") | {"use_cache": False}
    return model, [batch], [], [note]


def build(name: str, layers: int, samples):
    import peft
    from transformers import AutoModelForCausalLM

    if name == "unsloth":
        return build_unsloth(layers, samples)
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
    seeded_adapters(model)
    packed = move_batch(hasten.PackingCollator(max_tokens=TOKENS)([{"input_ids": s} for s in samples]), "cuda")
    handles, notes = [], []
    if name in ("hasten", "hasten_weights_in_combine"):
        # hasten_weights_in_combine: the router's weights in the combine (training.moe.weights_in_gate:
        # false), the A/B of the weights inside the experts' SwiGLU in one run
        moe = {"weights_in_gate": name == "hasten"}
        handle = hasten.accelerate(model.get_base_model(), Config.from_dict(
            {"training": {"checkpoint": {"activations": "full"}, "moe": moe}}))
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
    variants = args.variants.split(",")
    if "unsloth" in variants and variants != ["unsloth"]:
        print("run the unsloth variant alone (--variants unsloth): it patches transformers for the whole process",
              file=sys.stderr)
        return 2
    samples = make_samples(vocab=VOCAB)
    print(f"{WORKLOAD}: {len(samples)} samples, {sum(map(len, samples))} tokens, {args.layers} layers, LoRA r={RANK} "
          f"on {','.join(ATTENTION_TARGETS + EXPERT_TARGETS)}", flush=True)
    run_id, rows = common.new_run_id(), []
    reference_loss = common.earlier_first_loss(args.out, WORKLOAD, "hf_grouped_mm")
    for name in variants:
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
    if variants == ["unsloth"] and "unsloth" in done:  # hasten's row from the run before, this commit
        hasten_row = common.earlier_row(args.out, WORKLOAD, "hasten")
        if hasten_row is not None:
            common.print_ratio(hasten_row, done["unsloth"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

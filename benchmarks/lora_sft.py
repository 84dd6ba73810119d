"""W4: the LoRA job on a Llama-8B shape, one H200 (see docs/benchmarks.md).

Llama-3.1-8B's shape (hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 K/V heads,
vocabulary 128,256) with random bf16 weights, PEFT LoRA r=16, alpha=32 on q, k, v, o, gate, up and
down (PEFT's default float32 adapters; lora_B drawn at random, seeded, so the adapters change
the result), W1's batch of 16,384 tokens in 61 samples. One run measures, on the same weights:

  hasten          hasten.accelerate after get_peft_model: packed varlen attention, fused norm,
                  SwiGLU, RoPE, loss, and PEFT's LoRA layers on hasten::lora_linear; no checkpointing
  hasten_ungrouped  hasten with kernels.fused_lora_groups off: q/k/v and gate/up as separate ops
  hasten_lora_grads_gemms  hasten with the backward's gb and d lora_b from two GEMMs that each read
                    grad_y (HASTEN_LORA_GRADS_KERNEL=0), not the kernel that reads it once
  hasten_gated_one_pass  hasten with each MLP's gate/up group and SwiGLU as one op whose backward
                    forms the SwiGLU's gradient and gate/up's thin products in one pass
                    (HASTEN_LORA_GATED=1, experimental; the default runs the SwiGLU kernel, then them)
  hasten_residual_unfused  hasten with kernels.fused_residual off: each layer's residual add a separate
                  PyTorch add before the fused RMSNorm (what hasten ran before it)
  hasten_residual_grad_fused  hasten with kernels.fused_residual_grad on: a layer input's two
                  gradients added in the input norm's backward, not by autograd
  hasten_lean     the same with full activation checkpointing
  hasten_offload  full checkpointing with each layer's checkpointed input on the host (offload all)
  hasten_tiled    hasten_offload with the MLP in tiles of 4,096 tokens (hasten's lowest-memory setting)
  hasten_peft_layers  hasten with kernels.fused_lora off (PEFT's own LoRA forward), full checkpointing:
                  what hasten ran before the fused LoRA op (its float32 input copies need it)
  hf_peft_packed  transformers + PEFT, one packed row with position_ids (sdpa, transformers' correct
                  packed path), gradient checkpointing
  hf_peft_padded  transformers + PEFT, micro-batches of 8 samples padded, gradient checkpointing
  liger           transformers + PEFT + Liger-Kernel's Llama patch, packed with position_ids,
                  gradient checkpointing (it does not fit without)
  unsloth         Unsloth (benchmarks/w4_unsloth.py: its own model load, gradient checkpointing
                  "unsloth" and its packed path), where the carried bundle imports
W4_Q, the same with the base in 4 bits (bitsandbytes NF4, double-quantized statistics, bf16
compute; the same seed-0 weights saved once to /tmp/w4_llama8b and loaded quantized):
  hasten_nf4      hasten after get_peft_model: PEFT's 4-bit LoRA layers on hasten's fused path
  hasten_nf4_lean the same with full activation checkpointing
  hasten_nf4_offload, hasten_nf4_tiled  as hasten_offload and hasten_tiled
  hf_peft_bnb     transformers + PEFT + bitsandbytes, packed with position_ids, gradient checkpointing
  unsloth_nf4     Unsloth's QLoRA (load_in_4bit), alone in its process like unsloth

Each row: tokens/s (median step), peak GiB, and the first step's loss against hf_peft_packed's
(the same weights and batch: a variant that computes something else shows there).

    python benchmarks/lora_sft.py [--variants hasten,hf_peft_packed] [--steps 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (torch only: no transformers before unsloth)


# Unsloth patches transformers, PEFT and TRL when it is imported, and its model load replaces
# transformers' Llama code for the whole process: its variant runs alone in a process of its own,
# with unsloth imported before anything else (the bundle from .whl/, benchmarks/w4_unsloth.py).
UNSLOTH_PROCESS = common.variants_asked(sys.argv[1:]) in (["unsloth"], ["unsloth_nf4"])
if UNSLOTH_PROCESS:
    import w4_unsloth

    w4_unsloth.prepare_unsloth_env(w4_unsloth.ensure_bundle(os.environ.get("HASTEN_UNSLOTH_SITE",
                                                                           "/tmp/unsloth_site")))
    import unsloth  # noqa: F401

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from packed_sft import TOKENS, make_samples, padded_microbatches  # noqa: E402

import hasten  # noqa: E402
from hasten.config import Config  # noqa: E402
from hasten.packing import move_batch  # noqa: E402

RANK, ALPHA = 16, 32
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WORKLOAD = "W4"
DEVICE = "cuda"
LOSS_TOLERANCE = 2e-2  # bf16 over 32 layers: run-to-run and kernel-to-kernel noise is about 1e-3


def llama_8b():
    return AutoConfig.for_model("llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False,
                                bos_token_id=128000, eos_token_id=128001)


def seeded_adapters(model) -> None:
    """lora_B at random (PEFT starts it at zero, which would hide what the adapters compute), the
    same values in every variant: drawn in a fixed module order from one generator."""
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_B" in name:
                param.normal_(std=0.02, generator=gen)


CHECKPOINT = "/tmp/w4_llama8b"  # the seed-0 weights, saved once for the loads that need a folder


def workload_of(name: str) -> str:
    return "W4_Q" if "nf4" in name or name == "hf_peft_bnb" else WORKLOAD


def _nf4_base():
    """The seed-0 Llama-8B weights loaded in 4 bits (NF4, double-quantized statistics, bf16 compute)."""
    import w4_unsloth
    from transformers import BitsAndBytesConfig

    w4_unsloth._ensure_checkpoint(llama_8b(), Path(CHECKPOINT), TOKENS)
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.bfloat16)
    return AutoModelForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.bfloat16, quantization_config=quantization,
                                                device_map={"": DEVICE}, local_files_only=True)


def peft_model(config=None, nf4: bool = False):
    import peft

    torch.manual_seed(0)
    if nf4:
        base = _nf4_base()
    else:
        with torch.device(DEVICE):
            base = AutoModelForCausalLM.from_config(config or llama_8b(), dtype=torch.bfloat16)
    base.train()
    model = peft.get_peft_model(base, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                      target_modules=TARGETS))
    seeded_adapters(model)
    return model


def build(name: str, samples):
    """(model to train, list of micro-batches, handles to undo, notes)."""
    handles, notes = [], []
    packed = move_batch(hasten.PackingCollator(max_tokens=TOKENS)([{"input_ids": s} for s in samples]), DEVICE)
    hf_packed = [{k: packed[k] for k in ("input_ids", "position_ids", "labels")} | {"use_cache": False}]
    if name in ("unsloth", "unsloth_nf4"):
        import w4_unsloth

        load = w4_unsloth.unsloth_qlora_model if name == "unsloth_nf4" else w4_unsloth.unsloth_lora_model
        model, note = load(llama_8b(), r=RANK, alpha=ALPHA, target_modules=TARGETS, folder=CHECKPOINT,
                           max_seq_length=TOKENS)
        seeded_adapters(model)
        notes.append(note)
        return model, [w4_unsloth.unsloth_packed_batch(samples, DEVICE)], handles, notes
    model = peft_model(nf4=workload_of(name) == "W4_Q")
    if name.startswith("hasten"):
        full = {"training": {"checkpoint": {"activations": "full"}}}
        offload = {"training": {"checkpoint": {"activations": "full", "offload": "all"}}}
        tiled = {"training": {"checkpoint": {"activations": "full", "offload": "all", "mlp_tile_tokens": 4096}}}
        settings = {"hasten": {}, "hasten_lora_grads_gemms": {}, "hasten_gated_one_pass": {},
                    "hasten_ungrouped": {"kernels": {"fused_lora_groups": False}},
                    "hasten_residual_unfused": {"kernels": {"fused_residual": False}},
                    "hasten_residual_grad_fused": {"kernels": {"fused_residual_grad": True}},
                    "hasten_lean": full, "hasten_offload": offload, "hasten_tiled": tiled,
                    "hasten_nf4": {}, "hasten_nf4_lean": full, "hasten_nf4_offload": offload,
                    "hasten_nf4_tiled": tiled, "hasten_peft_layers": {"kernels": {"fused_lora": False}, **full}}[name]
        handle = hasten.accelerate(model.get_base_model(), Config.from_dict(settings))
        handles.append(handle)
        notes.append(handle.report().replace("\n", " | "))
        return model, [packed], handles, notes
    model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    if name == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model.get_base_model())
        return model, hf_packed, handles, notes
    if name in ("hf_peft_packed", "hf_peft_bnb"):
        return model, hf_packed, handles, notes
    if name == "hf_peft_padded":
        return model, padded_microbatches(samples), handles, notes
    raise ValueError(name)


def run_variant(name: str, samples, steps: int, profile: bool = False) -> dict:
    def after(step, handles) -> dict:
        if profile:
            from packed_sft import print_profile

            print_profile(name, step)
        offload = [h.offload.summary() for h in handles if getattr(h, "offload", None) is not None]
        if not offload:
            return {}
        print(f"{name:>18}: offload {offload[0]}", flush=True)  # what went to the host, and the waits for it
        return {"offload": offload[0]}

    # hasten_lora_grads_gemms: hasten with the LoRA backward's gb and d lora_b from two GEMMs that
    # read grad_y once each, instead of the kernel that reads it once for both (read at each call)
    # hasten_gated_one_pass: the MLP's SwiGLU gradient and gate/up's thin products in one pass
    switch = {"hasten_lora_grads_gemms": {"HASTEN_LORA_GRADS_KERNEL": "0"},
              "hasten_gated_one_pass": {"HASTEN_LORA_GATED": "1"}}.get(name, {})
    saved = {key: os.environ.get(key) for key in switch}
    os.environ.update(switch)
    try:
        measured = common.measure_training(lambda: build(name, samples), steps, TOKENS, after)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return {"workload": workload_of(name), "variant": name, **common.environment(), **measured}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--variants", default="hf_peft_packed,hasten,hasten_lean,hasten_peft_layers,liger,"
                                              "hf_peft_padded", help="unsloth runs alone: --variants unsloth (its "
                                              "first loss is compared with this commit's hf_peft_packed row in --out)")
    parser.add_argument("--profile", default="", help="comma-separated variants to profile for one step")
    args = parser.parse_args()
    variants = args.variants.split(",")
    for alone in ("unsloth", "unsloth_nf4"):
        if alone in variants and variants != [alone]:
            print(f"run the {alone} variant alone (--variants {alone}): it patches transformers for the whole "
                  "process", file=sys.stderr)
            return 2
    if not torch.cuda.is_available():
        print("W4 needs a CUDA GPU", file=sys.stderr)
        return 1
    samples = make_samples(vocab=128256)
    print(f"{WORKLOAD}: {len(samples)} samples, {sum(map(len, samples))} tokens, LoRA r={RANK} on {','.join(TARGETS)}",
          flush=True)
    run_id, rows = common.new_run_id(), []
    references = {"W4": "hf_peft_packed", "W4_Q": "hf_peft_bnb"}  # each workload's first-loss yardstick
    reference_loss = {w: common.earlier_first_loss(args.out, w, v) for w, v in references.items()}
    for name in variants:
        try:
            row = run_variant(name, samples, args.steps, profile=name in args.profile.split(",")) | {"run_id": run_id}
        except Exception as exc:  # noqa: BLE001 - one variant's failure (out of memory, a missing peer) must not
            traceback.print_exc()  # cost the others
            row = {"workload": workload_of(name), "variant": name, **common.environment(), "tokens_per_s": None,
                   "step_s": None, "peak_gib": None, "run_id": run_id,
                   "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"}
            gc.collect()
            torch.cuda.empty_cache()
        rows.append(row)
        done = {r["variant"]: r for r in rows if r["step_s"] is not None}
        workload = workload_of(name)
        reference = references[workload]
        if reference in done:
            reference_loss[workload] = done[reference]["losses"][0]
        common.check_first_loss(row, reference, reference_loss[workload], LOSS_TOLERANCE)
        common.write_rows([row], workload, args.out)
        common.print_training_row(row, reference)
    base = {r["variant"]: r for r in rows if r["step_s"] is not None}
    for mine in ("hasten", "hasten_lean", "hasten_offload", "hasten_tiled", "hasten_nf4",
                 "hasten_nf4_lean", "hasten_nf4_offload", "hasten_nf4_tiled"):
        for ref in ("unsloth", "hf_peft_packed", "liger", "hasten_lora_grads_gemms", "hasten_gated_one_pass",
                    "hasten_residual_unfused", "hasten_residual_grad_fused", "hasten_ungrouped",
                    "hasten_peft_layers", "hf_peft_padded", "hf_peft_bnb", "unsloth_nf4"):
            if mine in base and ref in base:
                common.print_ratio(base[mine], base[ref])
    return 0


if __name__ == "__main__":
    sys.exit(main())

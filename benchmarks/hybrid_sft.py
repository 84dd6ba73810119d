"""W6: packed SFT of a hybrid linear-attention model, Qwen3.5-2B shape, one H200 (issue 19; see docs/benchmarks.md).

transformers' `qwen3_5_text` (Qwen3_5ForCausalLM) built from a config, random bf16 weights
(seed 0, no hub): Qwen3.5-2B's text shape, hidden 2048, intermediate 6144, 24 decoder layers
(`--layers`) in Qwen3.5's 3:1 layout (three Gated DeltaNet linear-attention layers, then one
gated full-attention layer: 18 + 6), full attention 8 heads, 2 K/V heads, head 256, rotary on a
quarter of it (theta 1e7); linear attention 16 key heads and 16 value heads of 128, short
convolution of 4; vocabulary 248,320, tied embeddings: 1.88B parameters (printed and written
to every row). W1's batch: 16,384 tokens in 61 log-normal samples (packed_sft.make_samples).
One run measures, on the same seed-0 weights, with fused AdamW:

  hf_padded       transformers alone, sdpa, the samples in micro-batches of --micro_batch (8)
                  in their order (unsorted: a user's shuffled loader, as W1's hf_padded), right
                  padding, attention_mask, labels -100 on the pads, gradients accumulated over the
                  micro-batches. transformers' correct path for these models: each sample alone in
                  its row, the linear attention's state never crosses samples (fla's kernels when
                  flash-linear-attention is installed, as on the GPU machine; the row says which)
  hf_padded_ckpt  the same with gradient checkpointing (the default baseline: hf_padded ran out of
                  memory on the H200 at d058c9b, 127.5 GiB in use at micro-batch 8)
  hasten          hasten.accelerate(model, training.packed_sequence true) and ONE packed row of
                  16,384 tokens: per-sample position_ids, cu_seq_lens_q/k and max_length_q/k from
                  hasten.PackingCollator. Where hasten cannot keep packed samples apart in the
                  linear-attention layers, its packing hook refuses the batch (PackedBatchRefused,
                  naming why) and the row records that error

The loss on the same basis in both: the mean over the batch's 16,323 label tokens (a sample's
first token is never a target). The packed row computes it in one forward; each padded
micro-batch passes num_items_in_batch = 16,323 / micro-batches, so with common.training_step's
1 / micro-batches scaling every label token weighs the same (what the Trainer does over its
accumulated micro-batches). `correct`: the first step's loss within 2e-2 of the baseline's (hf_padded, or hf_padded_ckpt where that is the one run).
Each row: non-padding tokens/s (median step), peak GiB, host syncs, every step's loss; the padded
rows also count the tokens they run, pads included. 2 warm-up steps, --steps timed (3).

    python benchmarks/hybrid_sft.py [--variants hf_padded_ckpt,hasten] [--steps 3] [--micro_batch 8] [--out DIR]
    python benchmarks/hybrid_sft.py --tiny --variants hf_padded   # CPU smoke run: 2 layers, hidden 64, 1,500 tokens
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import sys
import tempfile
import traceback
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import packed_sft  # noqa: E402
from packed_sft import make_samples, padded_microbatches  # noqa: E402

import hasten  # noqa: E402
from hasten.config import Config  # noqa: E402
from hasten.packing import move_batch  # noqa: E402

WORKLOAD = "W6"
REFERENCE = "hf_padded"
LOSS_TOLERANCE = 2e-2  # losses near 12.4 in bf16: kernel-to-kernel noise is about 1e-3 (W1, W4)
TINY_TOKENS = 1500  # --tiny: W1's first 7 sample lengths (the last cut), 4 micro-batches of 2

# Qwen3.5-2B's text model; --tiny keeps the layout (linear and full attention layers) at toy sizes
SHAPE = dict(vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_attention_heads=8, num_key_value_heads=2,
             head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
             linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144,
             rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25})
TINY_SHAPE = dict(SHAPE, vocab_size=1024, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=4096)


def layer_types(layers: int) -> list[str]:
    """Qwen3.5's layout: every fourth layer full attention, the rest linear; a model of fewer than
    four layers ends on a full-attention layer so that both kinds run."""
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    if "full_attention" not in types:
        types[-1] = "full_attention"
    return types


def hybrid_config(layers: int, tiny: bool) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(**(TINY_SHAPE if tiny else SHAPE), num_hidden_layers=layers,
                             layer_types=layer_types(layers), tie_word_embeddings=True, use_cache=False)


def describe(config: Qwen3_5TextConfig) -> str:
    layers, linear = config.num_hidden_layers, config.layer_types.count("linear_attention")
    return (f"qwen3_5_text: hidden {config.hidden_size}, intermediate {config.intermediate_size}, "
            f"{layers} layers ({linear} linear + {layers - linear} full attention), "
            f"attention {config.num_attention_heads} heads / {config.num_key_value_heads} K/V of {config.head_dim}, "
            f"linear {config.linear_num_key_heads} key / {config.linear_num_value_heads} value heads of "
            f"{config.linear_key_head_dim}/{config.linear_value_head_dim}, vocabulary {config.vocab_size}, tied")


def parameter_count(config: Qwen3_5TextConfig) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # the tied head counted once


def linear_attention_kernels() -> str:
    """Which linear-attention code transformers' Qwen3.5 runs (it picks fla and causal_conv1d when importable)."""
    found = {name: importlib.util.find_spec(name) is not None for name in ("fla", "causal_conv1d")}
    return (f"gated delta rule: {'fla' if found['fla'] else 'torch (fla absent)'}; short convolution: "
            f"{'causal_conv1d' if found['causal_conv1d'] else 'torch conv1d (causal_conv1d absent)'}")


def padded_inputs(samples: list[list[int]], size: int) -> list[dict]:
    """W1's padded micro-batches, each weighing its label tokens against the whole batch's."""
    micro = padded_microbatches(samples, size)
    label_tokens = sum(len(s) - 1 for s in samples)
    return [m | {"num_items_in_batch": label_tokens / len(micro)} for m in micro]


def build(name: str, config: Qwen3_5TextConfig, samples, micro_batch: int, device: str):
    """(model to train, list of micro-batches, handles to undo, notes)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.train()
    handles, notes = [], []
    if name == "hasten":
        handle = hasten.accelerate(model, Config.from_dict({"training": {"packed_sequence": True}}))
        handles.append(handle)
        notes.append(handle.report().replace("\n", " | "))
        packed = hasten.PackingCollator(max_tokens=sum(map(len, samples)))([{"input_ids": s} for s in samples])
        return model, [move_batch(packed, device)], handles, notes
    if name in ("hf_padded", "hf_padded_ckpt"):
        if name == "hf_padded_ckpt":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        inputs = padded_inputs(samples, micro_batch)
        notes.append(f"{len(inputs)} micro-batches of {micro_batch}, "
                     f"{sum(m['input_ids'].numel() for m in inputs)} tokens with padding; {linear_attention_kernels()}")
        return model, inputs, handles, notes
    raise ValueError(name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="hf_padded_ckpt,hasten",
                        help="comma-separated: hf_padded, hf_padded_ckpt, hasten; the first hf_padded* variant is "
                             "the loss yardstick (hf_padded without checkpointing ran out of memory on the H200 at "
                             "d058c9b: 127.5 GiB in use at micro-batch 8)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after 2 warm-up steps)")
    parser.add_argument("--micro_batch", type=int, default=None,
                        help="samples per padded micro-batch (8; 2 with --tiny)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (24 in Qwen3.5-2B; 2 with --tiny)")
    parser.add_argument("--tiny", action="store_true", help=f"hidden 64, vocabulary 1024, {TINY_TOKENS} tokens: a "
                                                            "smoke run of the code paths, on the CPU without CUDA")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        print("W6 needs a CUDA GPU (--tiny runs on the CPU)", file=sys.stderr)
        return 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tiny and args.out is None:  # smoke rows stay out of benchmarks/results
        args.out = Path(tempfile.gettempdir()) / "hasten_w6_tiny"
    layers = args.layers or (2 if args.tiny else 24)
    args.micro_batch = args.micro_batch or (2 if args.tiny else 8)
    tokens = TINY_TOKENS if args.tiny else packed_sft.TOKENS
    # W1's helpers read these module settings: the batch size make_samples tops up to, and the
    # device padded_microbatches moves its batches to
    packed_sft.TOKENS, packed_sft.DEVICE = tokens, device
    config = hybrid_config(layers, args.tiny)
    samples = make_samples(vocab=config.vocab_size)
    params = parameter_count(config)
    shape = describe(config)
    workload = WORKLOAD + ("_tiny" if args.tiny else "")
    print(f"{workload}: {len(samples)} samples, {sum(map(len, samples))} tokens, max {max(map(len, samples))}; "
          f"{shape}; {params:,} parameters", flush=True)
    run_id, rows, reference_loss = common.new_run_id(), [], None
    variants = args.variants.split(",")
    # the loss yardstick: transformers' own path, with or without checkpointing, run first
    reference = next((v for v in variants if v.startswith("hf_padded")), REFERENCE)
    variants.sort(key=lambda v: v != reference)
    for name in variants:
        fields = {"workload": workload, "variant": name, "model": "qwen3_5_text", "shape": shape, "params": params,
                  "layers": layers,
                  "tokens": tokens, "samples": len(samples),
                  **({"micro_batch": args.micro_batch} if name.startswith("hf_padded") else {})}
        try:
            measured = common.measure_training(lambda: build(name, config, samples, args.micro_batch, device),
                                               args.steps, tokens)
            row = fields | common.environment() | measured | {"run_id": run_id}
        except Exception as exc:  # noqa: BLE001 - one variant's failure (a refusal, out of memory) must not cost
            # the other's row
            traceback.print_exc()
            row = fields | common.environment() | {"tokens_per_s": None, "step_s": None, "peak_gib": None,
                                                   "run_id": run_id,
                                                   "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}"}
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if name == reference and row["step_s"] is not None:
            reference_loss = row["losses"][0]
        common.check_first_loss(row, reference, reference_loss, LOSS_TOLERANCE)
        rows.append(row)
        path = common.write_rows([row], workload, args.out)  # each row as it comes: a run cut short keeps them
        common.print_training_row(row, reference, width=14)
    done = {r["variant"]: r for r in rows if r["step_s"] is not None}
    for ref in ("hf_padded", "hf_padded_ckpt"):
        if {"hasten", ref} <= done.keys():
            common.print_ratio(done["hasten"], done[ref])
    print(f"rows appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

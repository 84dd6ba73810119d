"""Counts the ATen operators one LoRA training step runs per decoder layer, on the CPU: a small
Llama (bf16 base, PEFT LoRA r=16 on q, k, v, o, gate, up, down with PEFT's default float32
adapters, as W4) under hasten.accelerate, one packed batch, forward and backward. Views,
reshapes and empties are not counted. Most counted operators are a kernel launch on the GPU too,
but not all (on the CPU the backward casts the float32 gradients and scales gb and d B as
operators of their own, which CUDA's GEMMs and one-pass kernel do inside), so compare the counts
of two commits here, not with a GPU profile: the difference is what a change to the LoRA path
removes, without a GPU.

    python scripts/lora_launch_count.py [--layers 2]
"""

from __future__ import annotations

import argparse
import collections

import torch

NOT_LAUNCHES = {"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::t", "aten::transpose", "aten::narrow",
                "aten::slice", "aten::select", "aten::expand", "aten::as_strided", "aten::empty", "aten::empty_like",
                "aten::empty_strided", "aten::detach", "aten::unsqueeze", "aten::squeeze", "aten::permute",
                "aten::split", "aten::split_with_sizes", "aten::alias", "aten::lift_fresh", "aten::_unsafe_view",
                "aten::resolve_conj", "aten::resolve_neg", "aten::contiguous", "aten::to", "aten::result_type",
                "aten::unbind", "aten::chunk", "aten::flatten", "aten::view_as", "aten::is_nonzero", "aten::item",
                "aten::_local_scalar_dense", "aten::set_", "aten::new_empty", "aten::new_empty_strided"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    import hasten

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    base = LlamaForCausalLM(config).to(torch.bfloat16).train()
    model = peft.get_peft_model(base, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    handle = hasten.accelerate(model.get_base_model())
    gen = torch.Generator().manual_seed(1)
    samples = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (1, 37, 90)]
    batch = hasten.PackingCollator(max_tokens=256)([{"input_ids": s} for s in samples])

    def step():
        model(**{k: batch[k] for k in ("input_ids", "position_ids", "labels")}).loss.backward()

    step()  # warm: metadata caches, probes
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    # an operator counts unless an operator above it counted (its own work is that one's); views and
    # the like neither count nor hide what runs under them
    counted, counts, in_lora, in_lora_ops = set(), collections.Counter(), collections.Counter(), collections.Counter()
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        if not event.name.startswith("aten::") or event.name in NOT_LAUNCHES:
            continue
        parent, lora = event.cpu_parent, None
        while parent is not None and id(parent) not in counted:
            lora = lora or (parent.name if parent.name.startswith("hasten::lora") else None)
            parent = parent.cpu_parent
        if parent is not None:
            continue
        counted.add(id(event))
        counts[event.name] += 1
        if lora is not None:
            in_lora[lora] += 1
            in_lora_ops[(lora, event.name)] += 1
    total, lora_total = sum(counts.values()), sum(in_lora.values())
    print(f"{args.layers} layers: {total} ATen operators a step, {lora_total} of them inside hasten's LoRA ops "
          f"({lora_total / args.layers:.1f} a layer)")
    for name, n in in_lora.most_common():
        print(f"  {n:5d}  inside {name}: " + ", ".join(f"{op[6:]} {k}" for (lora, op), k in in_lora_ops.most_common()
                                                      if lora == name))
    for name, n in counts.most_common(12):
        print(f"  {n:5d}  {name}")
    handle.undo()


if __name__ == "__main__":
    main()

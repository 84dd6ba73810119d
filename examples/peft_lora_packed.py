# Run: python examples/peft_lora_packed.py [--max_steps 20] [--model PATH] [--data FILE.jsonl]
"""LoRA through PEFT + hasten, trained with a plain PyTorch loop on packed batches.

The pattern: wrap the transformers model with `peft.get_peft_model`, patch the transformers model
inside it with `hasten.accelerate(peft_model.get_base_model())` (`accelerate` takes only a
transformers model), then train the PeftModel: its forward reaches the patched model. Batches
come from `hasten.PackingCollator`, fed by `TokenBudgetBatchSampler` so each batch fills one row
(no padding).

By default: the embedded tiny Qwen3-architecture model and corpus (no download); `--model PATH`
for a local transformers model folder. GPU when there is one, else CPU.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader

import hasten
from hasten.data import ByteTokenizer, load_dataset
from hasten.observability import fallback_counts
from hasten.packing import TokenBudgetBatchSampler, move_batch


def build_model_and_tokenizer(args, dtype):
    if args.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype), tokenizer, pad
    from transformers import Qwen3ForCausalLM

    from hasten.training.defaults import embedded_model_config

    torch.manual_seed(args.seed)
    tokenizer = ByteTokenizer()
    return Qwen3ForCausalLM(embedded_model_config(args.size)).to(dtype), tokenizer, tokenizer.pad_token_id


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local transformers model folder (default: the embedded model)")
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"], help="embedded model size")
    parser.add_argument("--data", help=".jsonl/.json/.parquet file with a `text` field (default: embedded corpus)")
    parser.add_argument("--max_steps", type=int, default=20)
    parser.add_argument("--max_tokens", type=int, default=2048, help="tokens per packed batch (one row)")
    parser.add_argument("--max_sample_tokens", type=int, default=256, help="samples are cut to this many tokens")
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--lora_r", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    model, tokenizer, pad_token_id = build_model_and_tokenizer(args, dtype)
    model.to(device)

    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = get_peft_model(model, lora)
    model.print_trainable_parameters()
    handle = hasten.accelerate(model.get_base_model())  # patch the transformers model inside the PeftModel
    print(handle.report())

    samples = [{"input_ids": s["input_ids"][: args.max_sample_tokens], "labels": s["labels"][: args.max_sample_tokens]}
               for s in load_dataset(args.data, tokenizer)]
    collator = hasten.PackingCollator(max_tokens=args.max_tokens, pad_token_id=pad_token_id)
    sampler = TokenBudgetBatchSampler([len(s["input_ids"]) for s in samples], args.max_tokens, seed=args.seed)
    loader = DataLoader(samples, batch_sampler=sampler, collate_fn=collator)

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate)
    model.train()
    step, losses = 0, []
    while step < args.max_steps:
        for batch in loader:
            start = time.perf_counter()
            tokens = int(batch["cu_seq_lens_q"][-1])  # read on the host, before the copy to the device
            batch = move_batch(batch, device)
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            step += 1
            print(f"step {step}: loss {losses[-1]:.4f}, {tokens} tokens in {batch['num_samples']} samples, "
                  f"{tokens / (time.perf_counter() - start):,.0f} tokens/s")
            if step >= args.max_steps:
                break
        sampler.set_epoch(sampler.epoch + 1)

    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {step} steps; packing efficiency "
          f"{collator.stats.efficiency:.3f}; fallbacks {fallback_counts() or 'none'}")
    if not all(math.isfinite(x) for x in losses):
        raise SystemExit("non-finite loss")


if __name__ == "__main__":
    main()

# Run: python examples/accelerate_packed.py [--max_steps 20]
#      accelerate launch --num_processes 2 examples/accelerate_packed.py   (several GPUs)
"""Hugging Face Accelerate + hasten: the user's own loop, Accelerate's device placement and
data parallelism, hasten's packed batches and varlen attention.

`hasten.accelerate(model)` patches the transformers model before `Accelerator.prepare` wraps it.
The loader is not passed to `prepare`: hasten's batch sampler already shards the packed batches
by process, and `move_batch` puts each batch on the process's device.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import Qwen3ForCausalLM

import hasten
from hasten.data import ByteTokenizer, load_dataset
from hasten.packing import TokenBudgetBatchSampler, move_batch
from hasten.training.defaults import embedded_model_config


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_steps", type=int, default=20)
    parser.add_argument("--max_tokens", type=int, default=1024, help="tokens per packed batch (one row)")
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    args = parser.parse_args(argv)

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(embedded_model_config("tiny"))
    handle = hasten.accelerate(model)  # patch the transformers model before Accelerate wraps it
    accelerator.print(handle.report())

    tokenizer = ByteTokenizer()
    samples = [{"input_ids": s["input_ids"][:256]} for s in load_dataset(None, tokenizer)]
    sampler = TokenBudgetBatchSampler([len(s["input_ids"]) for s in samples], args.max_tokens, seed=0,
                                      rank=accelerator.process_index, world_size=accelerator.num_processes)
    collator = hasten.PackingCollator(args.max_tokens, pad_token_id=tokenizer.pad_token_id)
    loader = DataLoader(samples, batch_sampler=sampler, collate_fn=collator)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    model, optimizer = accelerator.prepare(model, optimizer)
    step, losses = 0, []
    while step < args.max_steps:
        for batch in loader:
            loss = model(**move_batch(batch, accelerator.device)).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.gather(loss.detach()).mean().item())
            step += 1
            accelerator.print(f"step {step} loss {losses[-1]:.4f} packing efficiency {collator.stats.efficiency:.3f}")
            if step == args.max_steps:
                break
    if not losses[-1] < losses[0]:
        accelerator.print("warning: loss did not decrease")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

# Run: pip install trl datasets
#      python examples/trl_sft_padding_free.py --model Qwen/Qwen3-0.6B [--max_steps 20] [--lora]
#
# Run in CI on the CPU (tests/integrations/test_trl_example.py: TRL 1.16, a tiny Qwen3 model and a
# character tokenizer built offline), and that test on an H200 (b3dde9b, TRL carried as a wheel).
"""TRL SFTTrainer with padding_free=True, accelerated by hasten.

With `padding_free=True`, TRL's collator concatenates the batch's samples into one row and sends
`input_ids`, `labels` (-100 at every sample start) and `position_ids` (restarting at 0 for every
sample), with no attention mask. hasten's model hook derives the packing metadata (cu_seq_lens,
max length) from `position_ids` once per forward, on the device, and every attention layer runs
varlen attention on it: no padding and no attention across samples.

TRL logs a warning that the attention implementation is not a flash-attention variant: the model's
attention is "hasten_varlen", which handles flattened batches (flash-attn inside when installed,
else torch's varlen attention). TRL does not accept a custom data collator with padding_free, so
hasten.PackingCollator is not used here; the callback logs hasten's fallback counters.
"""

from __future__ import annotations

import argparse
import sys

try:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer
except ImportError as exc:
    sys.exit(f"This example needs TRL and datasets ({exc}). Install them with: pip install trl datasets\n"
             "(For the Trainer without TRL see examples/hf_trainer_packed.py.)")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hasten
from hasten.config import Config
from hasten.data import embedded_corpus_path, read_records
from hasten.integrations.trainer import HastenCallback


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="local model folder or Hub id, e.g. Qwen/Qwen3-0.6B")
    parser.add_argument("--data", help=".jsonl/.json/.parquet file with a `text` field (default: embedded corpus)")
    parser.add_argument("--max_steps", type=int, default=20)
    parser.add_argument("--max_sample_tokens", type=int, default=1024, help="samples are cut to this many tokens")
    parser.add_argument("--batch_size", type=int, default=16, help="samples flattened into one padding-free row")
    parser.add_argument("--learning_rate", type=float, default=2e-5)
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter (needs peft)")
    parser.add_argument("--output_dir", default="runs/trl_sft_padding_free")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if cuda else torch.float32)
    # Patch before TRL sees the model. With --lora, TRL wraps it in a PeftModel afterwards; the
    # PeftModel's forward reaches this patched model, so nothing else is needed. TRL (1.x) computes the
    # loss, entropy and token accuracy with its own fused LM head (trl's add_fused_lm_head), which
    # calls the backbone directly and never reaches hasten's fused cross-entropy: it stays off here
    # so that hasten's report says what runs.
    handle = hasten.accelerate(model, Config.from_dict({"kernels": {"fused_cross_entropy": False}}))
    print(handle.report())

    # Tokenized and truncated here: with padding_free and no packing, TRL requires max_length=None
    # and takes a dataset with `input_ids` as already processed.
    records = read_records(args.data or embedded_corpus_path())
    rows = [{"input_ids": tokenizer(r["text"])["input_ids"][: args.max_sample_tokens]}
            for r in records if r.get("text")]
    train_dataset = Dataset.from_list([r for r in rows if len(r["input_ids"]) > 1])

    config = SFTConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        padding_free=True,  # one flattened row per batch, boundaries in position_ids
        max_length=None,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=cuda,
        use_cpu=not cuda,
    )
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    trainer = SFTTrainer(model=model, args=config, train_dataset=train_dataset, processing_class=tokenizer,
                         peft_config=peft_config)
    HastenCallback(handle).attach(trainer)  # hasten/fallbacks, hasten/fallback/<key> in every log
    trainer.train()

    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} logged steps")
    return trainer.state.log_history


if __name__ == "__main__":
    main()

# Run: python examples/hf_trainer_packed.py [--max_steps 20] [--model PATH] [--data FILE.jsonl]
"""Hugging Face Trainer + hasten: packed, padding-free batches with varlen attention.

By default it trains the embedded tiny Qwen3-architecture model (initialised in place) on the
corpus that ships inside hasten, with its byte tokenizer: nothing is downloaded. `--model PATH`
trains a local transformers model folder (model + tokenizer) instead. Runs on a GPU when there is
one, else on the CPU (where attention falls back to one sequence at a time, logged as
hasten/fallback/attention_per_sequence).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import Trainer, TrainingArguments

from hasten.data import ByteTokenizer, load_dataset
from hasten.integrations.trainer import prepare_trainer_model


def build_model_and_tokenizer(args):
    if args.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        return model, tokenizer, pad
    from transformers import Qwen3ForCausalLM

    from hasten.training.defaults import embedded_model_config

    torch.manual_seed(args.seed)
    tokenizer = ByteTokenizer()
    return Qwen3ForCausalLM(embedded_model_config(args.size)), tokenizer, tokenizer.pad_token_id


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local transformers model folder (default: the embedded model)")
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"], help="embedded model size")
    parser.add_argument("--data", help=".jsonl/.json/.parquet file with a `text` field (default: embedded corpus)")
    parser.add_argument("--max_steps", type=int, default=20)
    parser.add_argument("--max_tokens", type=int, default=2048, help="tokens per packed row")
    parser.add_argument("--max_sample_tokens", type=int, default=256, help="samples are cut to this many tokens")
    parser.add_argument("--batch_size", type=int, default=8,
                        help="samples per packed batch (8 x 256 tokens fit one 2048-token row: no padding)")
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--output_dir", help="default: a temporary folder")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    model, tokenizer, pad_token_id = build_model_and_tokenizer(args)
    # Samples are dicts with `input_ids` (and optionally `labels`, -100 = no loss), not padded.
    dataset = [{"input_ids": s["input_ids"][: args.max_sample_tokens], "labels": s["labels"][: args.max_sample_tokens]}
               for s in load_dataset(args.data, tokenizer)]

    handle, collator, callback = prepare_trainer_model(model, max_tokens=args.max_tokens, pad_token_id=pad_token_id)
    print(handle.report())

    with tempfile.TemporaryDirectory() as tmp:
        training_args = TrainingArguments(
            output_dir=args.output_dir or tmp,
            max_steps=args.max_steps,
            per_device_train_batch_size=args.batch_size,  # samples per packed batch
            learning_rate=args.learning_rate,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=not torch.cuda.is_available(),
            bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
            seed=args.seed,
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=training_args, train_dataset=dataset, data_collator=collator)
        callback.attach(trainer)  # first callback: report_to integrations see the hasten/ fields too
        trainer.train()

    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps; "
          f"packing efficiency {collator.stats.efficiency:.3f}")
    if not all(torch.isfinite(torch.tensor(losses))):
        raise SystemExit("non-finite loss")


if __name__ == "__main__":
    main()

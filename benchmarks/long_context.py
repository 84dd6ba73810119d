"""W2 long-context anchor: the longest single sequence a Llama-8B-shaped model trains on one GPU
with PEFT LoRA (r=16 on every projection), forward + backward.

Variants in one run (rows to benchmarks/results/W2_long.jsonl):
  hf_grad_ckpt   transformers gradient checkpointing (non-reentrant), sdpa, transformers' loss
  hasten         hasten.accelerate: packed varlen attention, fused cross-entropy and dense
                 kernels, activation checkpointing full
  hasten_offload hasten.accelerate after get_peft_model (PEFT's layers on the fused LoRA op), full
                 checkpointing with every layer's checkpointed input on the host (offload all) and
                 the MLP in tiles of --tile_tokens (sequence tiling)

For each variant its lengths (--hf_lengths, --hasten_lengths) are tried in order until one runs
out of memory, or until the next step would take longer than --max_step_s (predicted from the last
step, quadratic in length since attention dominates there; the row says so); the row records the
longest that trained, its step time and peak. Reference (BENCHMARKS.md, H200):
transformers checkpointing trains 49,152 tokens (12.2 s, 110.5 GiB) and runs out at 65,536.
Target: hasten at least 2x the longest transformers length.

    python benchmarks/long_context.py [--hf_lengths 32768,...] [--hasten_lengths 98304,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import hasten  # noqa: E402
from hasten.config import Config  # noqa: E402
from hasten.memory import preflight  # noqa: E402
from hasten.memory.offload import OffloadError  # noqa: E402
from hasten.packing import move_batch  # noqa: E402

# transformers' reference limit is 49,152, so each ladder starts near what it has to show
HF_LENGTHS = "32768,49152,65536,81920"
HASTEN_LENGTHS = "98304,131072,196608,262144"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(variant: str, tile_tokens: int = 16384):
    import peft

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=524288,
                         attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    handle = None
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS)
    if variant == "hf_grad_ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif variant == "hasten":
        handle = hasten.accelerate(model, Config.from_dict({"training": {"checkpoint": {"activations": "full"}}}))
    elif variant == "hasten_offload":
        model = peft.get_peft_model(model, lora)
        checkpoint = {"activations": "full", "offload": "all", "mlp_tile_tokens": tile_tokens}
        handle = hasten.accelerate(model.get_base_model(), Config.from_dict({"training": {"checkpoint": checkpoint}}))
        print(handle.report(), flush=True)
        model.train()
        return model, handle
    else:
        raise ValueError(f"unknown variant {variant!r}")
    model = peft.get_peft_model(model, lora)
    model.train()
    return model, handle


def batch_for(tokens: int, variant: str) -> dict:
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, 128256, (tokens,), generator=gen).tolist()
    if variant == "hf_grad_ckpt":
        tensor = torch.tensor([ids], device="cuda")
        return {"input_ids": tensor, "labels": tensor}
    return move_batch(hasten.PackingCollator(max_tokens=tokens)([{"input_ids": ids}]), "cuda")


def try_length(model, optimizer, tokens: int, variant: str) -> tuple[float, float] | None:
    """(seconds, peak GiB) of one step at `tokens`, or None when it runs out of memory (GPU or host)."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        batch = batch_for(tokens, variant)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return time.perf_counter() - start, torch.cuda.max_memory_allocated() / 2**30
    except (torch.OutOfMemoryError, OffloadError):  # OffloadError: the host guard, before the host runs short
        optimizer.zero_grad(set_to_none=True)
        return None


def preflight_forecast(model, handle, optimizer, sizes=(16384, 32768)):
    """hasten.memory.preflight's forecast for this model and machine, from probe steps at `sizes`
    (the optimizer's state not yet made is counted as AdamW's two tensors per adapter weight): its
    largest_tokens() is the length it states, host_layers_kept(L) the split a length L needs."""
    def step(tokens):
        model(**batch_for(tokens, "hasten_offload")).loss.backward()
        optimizer.zero_grad(set_to_none=True)

    engine = handle.offload.offload.engine if handle.offload is not None else None
    offloaded = (lambda: engine.stats().bytes_offloaded) if engine is not None else None
    probes, _ = preflight.measure(step, list(sizes), preflight.CudaMemory(torch.device("cuda")), offloaded)
    if handle.offload is not None:
        handle.offload.restart_calibration()
    trainable = [p for p in model.parameters() if p.requires_grad]
    return preflight.forecast(probes, preflight.optimizer_state_bytes(trainable), torch.device("cuda"),
                              with_offload=engine is not None,
                              host_layers=handle.offload.host_layers if handle.offload is not None else 0,
                              host_limit=handle.offload.host_limit_bytes if handle.offload is not None else None)


def forecast_check(forecast, weights: int, tokens: int, kept: int, measured_gib: float) -> dict:
    """The preflight's forecast of a step's peak (the weights and adapters allocated before it, plus
    MemoryForecast.device_bytes: AdamW's state, activations per token, the constant, and the kept
    layers' checkpoints) against the peak measured at that length. Above 1.0 the forecast was too
    low there, so a maximum stated from it promises more than the GPU holds."""
    forecast_gib = (weights + forecast.device_bytes(tokens, kept)) / 2**30
    return {"tokens": tokens, "kept": kept, "forecast_gib": round(forecast_gib, 2), "measured_gib": round(measured_gib, 2),
            "measured_over_forecast": round(measured_gib / forecast_gib, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf_lengths", default=HF_LENGTHS)
    parser.add_argument("--hasten_lengths", default=HASTEN_LENGTHS)
    parser.add_argument("--max_step_s", type=float, default=200.0)
    parser.add_argument("--variants", default="hf_grad_ckpt,hasten,hasten_offload")
    parser.add_argument("--offload_lengths", default="131072,196608,262144,393216",
                        help="the lengths hasten_offload tries")
    parser.add_argument("--tile_tokens", type=int, default=16384, help="hasten_offload's MLP tile")
    parser.add_argument("--probe_lengths", default="16384,32768",
                        help="the preflight's probe steps (one sequence each) for hasten_offload's statement")
    parser.add_argument("--save_forecast", type=Path, default=None,
                        help="write hasten_offload's forecast (the probes' line, this machine's limits) as JSON")
    parser.add_argument("--load_forecast", type=Path, default=None,
                        help="take hasten_offload's forecast from --save_forecast's file instead of probing: the "
                             "statement and the long step as two calls of a 600 s limit, on the same warm machine")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    run_id = common.new_run_id()
    rows = []
    for variant in args.variants.split(","):
        model, handle = build(variant, args.tile_tokens)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        trained, tried, capped = None, [], ""
        ladder = {"hf_grad_ckpt": args.hf_lengths, "hasten": args.hasten_lengths, "hasten_offload": args.offload_lengths}
        lengths = [int(x) for x in ladder[variant].split(",") if x.strip()]  # empty: the preflight's statement only
        stated, forecast, kept, checks = None, None, 0, []
        if variant == "hasten_offload":  # the memory preflight's forecast: what this machine would take
            weights = torch.cuda.memory_allocated()  # before any optimizer state: the forecast counts that
            if args.load_forecast is not None:
                saved = json.loads(args.load_forecast.read_text())
                forecast = preflight.MemoryForecast(**saved["forecast"])
                args.probe_lengths = f"{saved['probe_lengths']} (run {saved['run_id']}, loaded)"
                print(f"{variant:>14} preflight: forecast loaded from {args.load_forecast} (probes "
                      f"{saved['probe_lengths']}, run {saved['run_id']})", flush=True)
            else:
                forecast = preflight_forecast(model, handle, optimizer,
                                              [int(x) for x in args.probe_lengths.split(",") if x.strip()])
            if args.save_forecast is not None:
                args.save_forecast.parent.mkdir(parents=True, exist_ok=True)
                args.save_forecast.write_text(json.dumps({"forecast": dataclasses.asdict(forecast),
                                                          "probe_lengths": args.probe_lengths, "run_id": run_id,
                                                          "weights_bytes": weights, **common.environment()}))
            stated = forecast.largest_tokens()
            print(f"{variant:>14} preflight: the largest sequence that fits is about {stated:,} tokens "
                  f"({forecast.per_token / 1024:.0f} KiB a token on the GPU, {forecast.host_per_token / 1024:.0f} "
                  f"on the host over {forecast.host_layers} layers)", flush=True)
        for tokens in lengths:
            needed = forecast.host_layers_kept(tokens) if forecast is not None else None
            if needed and needed > kept:  # what hasten train's preflight does: the last layers stay on the GPU
                handle.offload.keep_on_device(needed - kept)
                kept = needed
                print(f"{variant:>14} {tokens:>7} tokens: the last {kept} layers keep their checkpointed input on "
                      "the GPU (the host cannot hold them all)", flush=True)
            if trained and trained[1] * (tokens / trained[0]) ** 2 > args.max_step_s:
                capped = (f"; stopped before {tokens} tokens: predicted step "
                          f"{trained[1] * (tokens / trained[0]) ** 2:.0f} s > --max_step_s {args.max_step_s:.0f}")
                print(f"{variant:>14} {tokens:>7} tokens: not tried{capped}", flush=True)
                break
            result = try_length(model, optimizer, tokens, variant)
            tried.append((tokens, None if result is None else round(result[0], 2)) + ((f"{kept} kept",) if kept else ()))
            print(f"{variant:>14} {tokens:>7} tokens: " + ("out of memory" if result is None
                                                           else f"{result[0]:.2f} s, peak {result[1]:.1f} GiB"),
                  flush=True)
            if result is not None and forecast is not None:  # the statement is only as good as this
                checks.append(forecast_check(forecast, weights, tokens, kept, result[1]))
                print(f"{variant:>14} {tokens:>7} tokens: the preflight forecast {checks[-1]['forecast_gib']:.1f} GiB, "
                      f"measured {result[1]:.1f} GiB ({checks[-1]['measured_over_forecast']:.2f}x)", flush=True)
            if result is None:
                break
            trained = (tokens, *result)
        offload = handle.offload.summary() if handle is not None and handle.offload is not None else None
        if offload:
            print(f"{variant:>14} offload over its steps: {offload}", flush=True)
        rows.append({"workload": "W2_long", "variant": variant, **common.environment(),
                     "tokens_per_s": trained[0] / trained[1] if trained else None,
                     "step_s": trained[1] if trained else None, "peak_gib": trained[2] if trained else None,
                     "host_syncs_per_step": None, "correct": trained is not None,
                     "notes": f"longest trained {trained[0] if trained else 0} tokens; tried {tried}{capped}",
                     "max_tokens": trained[0] if trained else 0, "run_id": run_id,
                     **({"preflight_max_tokens": stated, "preflight_probes": args.probe_lengths,
                         "preflight_checks": checks,
                         # the stated maximum holds only where no trained length peaked above its forecast
                         # (None: no length trained to judge it by)
                         "preflight_max_trusted": (all(c["measured_over_forecast"] <= 1.0 for c in checks)
                                                   if checks else None)}
                        if stated is not None else {}),
                     **({"offload": offload} if offload else {})})
        if handle is not None:
            handle.undo()
        del model, optimizer
        gc.collect()
        torch.cuda.empty_cache()
    by = {r["variant"]: r for r in rows}
    if {"hf_grad_ckpt", "hasten"} <= by.keys() and by["hf_grad_ckpt"]["max_tokens"]:
        print(f"longest sequence: hasten {by['hasten']['max_tokens']} vs transformers checkpointing "
              f"{by['hf_grad_ckpt']['max_tokens']} tokens ({by['hasten']['max_tokens'] / by['hf_grad_ckpt']['max_tokens']:.2f}x)")
    print(f"rows appended to {common.write_rows(rows, 'W2_long', args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

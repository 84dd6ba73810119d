"""W2: activation memory. Llama shape of about 1.5B (hidden 2048, intermediate 8192, 16 layers,
32 heads, 8 KV heads, vocab 128256), one row of 16,384 tokens, sdpa, bf16, forward + backward +
fused AdamW (lr 0, so every variant sees the same weights and gradients can be compared).

Variants in one run (rows to benchmarks/results/W2.jsonl):
  hf_no_ckpt             keep everything
  hf_grad_ckpt           transformers' gradient checkpointing (non-reentrant)
  torch_save_on_cpu      torch.autograd.graph.save_on_cpu(pin_memory=True)
  hasten_selective       hasten's selective checkpointing policy
  hasten_offload_all     every layer but the last offloaded, double-buffered
  hasten_offload_auto    planner, no budget: what hides for free
  hasten_offload_budget  planner with the peak of hf_grad_ckpt in this run as budget
  hasten_fused_ce        hasten's chunked linear cross-entropy alone (no full logits)
  hasten_fused_ce_auto   fused loss + planner, no budget
  hasten                 fused loss + planner with the peak of hf_grad_ckpt as budget

    python benchmarks/activation_memory.py [--tokens 16384] [--variants a,b] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from hasten.loss import install_fused_cross_entropy  # noqa: E402
from hasten.memory import apply_activation_checkpointing  # noqa: E402
from hasten.memory.offload import LayerOffload, OffloadManager, decoder_layers, measure_link_bandwidth  # noqa: E402
from hasten.observability import fallback_counts, reset_fallbacks  # noqa: E402

VARIANTS = ("hf_no_ckpt", "hf_grad_ckpt", "torch_save_on_cpu", "hasten_selective", "hasten_offload_all",
            "hasten_offload_auto", "hasten_offload_budget", "hasten_fused_ce", "hasten_fused_ce_auto", "hasten")
BUDGETED = ("hasten_offload_budget", "hasten")
COMPARED = ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight",
            "model.layers.15.self_attn.q_proj.weight")


def build_model():
    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=65536,
                         attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16).train()


def setup(name: str, model, budget_gib: float | None):
    """Applies a variant; returns (context factory per step, undo, describe)."""
    none = contextlib.nullcontext
    nothing = lambda reset=False: ""  # noqa: E731
    if name in ("hf_no_ckpt",):
        return none, lambda: None, nothing
    if name == "hf_grad_ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return none, model.gradient_checkpointing_disable, nothing
    if name == "torch_save_on_cpu":
        return (lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)), lambda: None, nothing
    if name == "hasten_selective":
        return none, apply_activation_checkpointing(model, "selective"), nothing
    if name == "hasten_offload_all":
        layers = decoder_layers(model)
        offload = LayerOffload(layers, ["offload"] * (len(layers) - 1) + ["keep"])
        offload.attach()

        def describe(reset=False):
            if reset:
                return offload.engine.reset_counters()
            return _describe(offload.engine.stats(), f"{len(layers) - 1} offload, 1 keep")
        return none, offload.detach, describe
    if name == "hasten_fused_ce":
        return none, install_fused_cross_entropy(model), nothing
    if name in ("hasten_fused_ce_auto", "hasten"):
        undo_loss = install_fused_cross_entropy(model)
        inner_context, undo_offload, describe = setup("hasten_offload_budget" if name == "hasten"
                                                      else "hasten_offload_auto", model, budget_gib)

        def undo():
            undo_offload()
            undo_loss()
        return inner_context, undo, describe
    if name in ("hasten_offload_auto", "hasten_offload_budget"):
        manager = OffloadManager(model, "auto", max_memory_gib=budget_gib if name.endswith("budget") else None)

        def describe(reset=False):
            if reset:
                return manager.offload.engine.reset_counters()
            return _describe(manager.offload.engine.stats(), manager.plan.summary() if manager.plan else "no plan",
                             manager.plan)
        return none, manager.detach, describe
    raise ValueError(name)


def _describe(stats, plan, planned=None) -> str:
    text = (f"plan {plan}; offloaded {stats.bytes_offloaded / 2**30:.2f} GiB over the timed steps; exposed "
            f"fetches {stats.exposed_fetches}/{stats.fetches}, exposed wait {stats.exposed_wait_ms:.1f} ms")
    if planned is not None:
        text += f"; choices {''.join(c[0] for c in planned.choices)}"
        if planned.predicted_peak_bytes is not None:
            text += f"; predicted peak {planned.predicted_peak_bytes / 2**30:.1f} GiB"
        text += "".join(f"; {note}" for note in planned.notes)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, fused=True)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 128256, (1, args.tokens), generator=gen).cuda()
    link = measure_link_bandwidth(torch.device("cuda"))
    print(f"W2: {args.tokens} tokens; pinned link d2h {link['d2h_gbps']:.1f} GB/s, h2d {link['h2d_gbps']:.1f} GB/s")
    run_id = common.new_run_id()
    rows, reference, ckpt_peak = [], None, None
    for name in args.variants.split(","):
        reset_fallbacks()
        budget = ckpt_peak if name in BUDGETED else None
        if name in BUDGETED and budget is None:
            print(f"{name} needs hf_grad_ckpt earlier in --variants; skipped")
            continue
        step_context, undo, describe = setup(name, model, budget)
        first: dict = {}

        def step():
            optimizer.zero_grad(set_to_none=True)
            with step_context():
                loss = model(input_ids=input_ids, labels=input_ids).loss
                loss.backward()
            if not first:
                first["loss"] = loss.detach().float()
                # on the host: copies kept on the device would raise every later variant's peak
                first["grads"] = {n: p.grad.float().cpu() for n, p in model.named_parameters() if n in COMPARED}
            optimizer.step()

        try:
            iters = 2 if name == "torch_save_on_cpu" else args.iters
            torch.cuda.reset_peak_memory_stats()  # the planner's calibration reads this step's peak
            times = common.time_steps(step, warmup=0, iters=3)  # warm-up; auto calibrates and plans here
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            describe(reset=True)  # count the timed steps only
            times = common.time_steps(step, warmup=0, iters=iters)
            peak = torch.cuda.max_memory_allocated() / 2**30
            notes = describe()
            error = None
        except torch.OutOfMemoryError as exc:
            times, peak, notes, error = [float("nan")], float("nan"), "", str(exc).splitlines()[0]
        finally:
            undo()
        if name == "hf_no_ckpt" and first:
            reference = first
        if name == "hf_grad_ckpt":
            ckpt_peak = peak
        rel = None
        if reference is not None and first:
            rel = max(((first["grads"][n] - reference["grads"][n]).norm() / reference["grads"][n].norm()).item()
                      for n in COMPARED)
        step_s = common.median(times)
        correct = error is None and (rel is None or rel <= 2e-2)
        row = {"workload": "W2", "variant": name, **common.environment(), "tokens_per_s": args.tokens / step_s,
               "step_s": step_s, "peak_gib": peak, "host_syncs_per_step": None, "correct": correct,
               "notes": (f"grad rel err vs hf_no_ckpt {rel:.2e}; " if rel is not None else "")
               + (f"OOM: {error}; " if error else "") + notes
               + f"; steps {[round(t, 4) for t in times]}; fallbacks {fallback_counts()}", "run_id": run_id}
        rows.append(row)
        print(f"{'W2':>4} {name:>22}: {step_s:7.4f} s  {peak:6.1f} GiB  correct {correct}  {row['notes']}",
              flush=True)
        del first
        gc.collect()
        torch.cuda.empty_cache()
    by_name = {r["variant"]: r for r in rows}
    if "hf_no_ckpt" in by_name:
        base = by_name["hf_no_ckpt"]
        for r in rows:
            print(f"{r['variant']:>22}: step {r['step_s'] / base['step_s']:.2f}x no-ckpt, peak {r['peak_gib']:.1f} GiB"
                  + (f" (hf_grad_ckpt {ckpt_peak:.1f})" if ckpt_peak else ""))
    path = common.write_rows(rows, "W2", args.out)
    print(f"rows appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

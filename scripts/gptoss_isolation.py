"""Where packed_sft.py's isolation error on gpt-oss-20b's shape comes from (a diagnostic for the
device). W1's 61-sample batch, the samples packed_sft checks (0, 30, 60): their logits inside the
pack, against the same sample alone through the model's own float32 eager attention (the truth).
Beside hasten's variants, transformers' own bf16 eager run of each sample alone: its distance to
the truth is what bf16 alone costs. Run with the router as initialised and with its weights scaled
(top-k margins): if hasten's distance shrinks to bf16's once routing has margins, the gap was
routing flips under bf16 noise (the issue's warning), not a packing error.

    python scripts/gptoss_isolation.py [--layers 4] [--router_scale 8]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import packed_sft  # noqa: E402

import hasten  # noqa: E402
from hasten.config import Config  # noqa: E402
from hasten.packing import move_batch  # noqa: E402

VARIANTS = {
    "hasten": {},
    "hasten_attention_only": {"kernels": {"fused_cross_entropy": False, "rms_norm": False, "swiglu": False,
                                          "rope": False}, "training": {"moe": {"fused_grouping": False}}},
    "hasten_per_sequence_attention": {"attention": {"backend": "per_sequence"}},
}


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


@torch.no_grad()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--router_scale", type=float, default=8.0)
    args = parser.parse_args()
    packed_sft.MODEL, packed_sft.LAYERS = "gpt_oss_20b", args.layers
    samples = packed_sft.make_samples()
    starts = [0]
    for s in samples:
        starts.append(starts[-1] + len(s))
    packed = move_batch(hasten.PackingCollator(max_tokens=packed_sft.TOKENS)([{"input_ids": s} for s in samples]),
                        "cuda")
    packed.pop("labels", None)
    for scale in (1.0, args.router_scale):
        model = packed_sft.build_model().eval()
        for name, param in model.named_parameters():
            if name.endswith("router.weight"):
                param.mul_(scale)
        truth_model = copy.deepcopy(model).float()
        truth = {i: truth_model(input_ids=torch.tensor([samples[i]], device="cuda"), use_cache=False).logits[0].float()
                 for i in packed_sft.CHECKED}
        del truth_model
        torch.cuda.empty_cache()
        errors = {"hf_bf16_alone": max(rel(model(input_ids=torch.tensor([samples[i]], device="cuda"),
                                                 use_cache=False).logits[0], truth[i]) for i in truth)}
        for variant, settings in VARIANTS.items():
            handle = hasten.accelerate(model, Config.from_dict(settings))
            logits = model(**packed).logits[0]
            errors[variant] = max(rel(logits[starts[i]: starts[i + 1]], truth[i]) for i in truth)
            handle.undo()
        print(f"router weights x{scale:g}: largest relative error of the checked samples' logits against float32 "
              "alone: " + ", ".join(f"{k} {v:.3e}" for k, v in errors.items()), flush=True)
        del model
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How much one type's GPU parity row moves with what ran before it in the process (on the GPU
machine). exaone_moe's LoRA parity failed at 1.29 of its allowance in a run of the whole parity file
under transformers 5.25 and passed at 0.45 run with two other types: the same code, the same
seeded model, different errors for hasten's run and for the unpatched bf16 model alike. Here each
repeat first holds a CUDA allocation of another size (the caching allocator, and so the addresses
and the GEMM algorithms cuBLAS picks for them, differ), then runs the check; one JSON row each.
A type whose top-k routing flips with the last bits of its inputs spreads; one that does not, does
not.

    python3 scripts/parity_spread_probe.py exaone_moe glm4_moe > rows.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.gpu.test_model_parity_cuda import check_lora_parity, check_packed_parity  # noqa: E402

REPEATS = 5
KEEP = ("loss_error", "loss_noise", "grad_error", "grad_noise", "worst_param", "worst_of_allowed")


def main(names: list[str]) -> int:
    held = []
    for name in names:
        for job, check in (("full", lambda n: check_packed_parity(n, (7, 1, 19, 12, 1, 33, 157, 301), report=False)),
                           ("lora", lambda n: check_lora_parity(n, report=False))):
            for repeat in range(REPEATS):
                held.append(torch.empty(4096 * (1 + 37 * repeat) + 1000 * repeat, device="cuda"))
                try:
                    row, outcome = check(name), "pass"
                except AssertionError as failure:
                    row, outcome = {"failure": str(failure)[:600]}, "fail"
                print(json.dumps({"model_type": name, "job": job, "repeat": repeat, "outcome": outcome,
                                  **{k: row[k] for k in KEEP + ("failure",) if k in row}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["exaone_moe"]))

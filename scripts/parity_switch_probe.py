"""One boolean config switch's GPU packed parity (tests/gpu/test_model_parity_cuda.py's
check_packed_parity) on and then off for each zoo type, in one process, one JSON row each (on the
GPU machine). At 5b235b3 kernels.fused_residual_grad moved mellum's layer-1 router gradient from
below 0.30 of its allowance to 0.93 and kolibri1's to 0.52, both passing; for top-k types such a
move can be the allocator-dependent spread scripts/parity_spread_probe.py measures, not the switch
(mellum's forward loss moved by one ulp though that switch changes only the backward).

    python3 scripts/parity_switch_probe.py kernels.fused_residual_grad mellum kolibri1 > rows.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.gpu.test_model_parity_cuda import LENGTHS, check_packed_parity  # noqa: E402

KEEP = ("loss_error", "loss_noise", "grad_error", "grad_noise", "worst_param", "worst_of_allowed", "failure")


def main(key: str, names: list[str]) -> int:
    section, switch = key.split(".")
    for name in names:
        for value in (True, False):
            try:
                row = check_packed_parity(name, LENGTHS, report=False, settings={section: {switch: value}})
                outcome = "pass"
            except AssertionError as failure:  # _judge's per-parameter or global check
                row, outcome = {"failure": str(failure)[:900]}, "fail"
            except BaseException as exc:  # noqa: BLE001 - a skip or an error: reported, the next goes on
                row, outcome = {"failure": f"{type(exc).__name__}: {str(exc)[:300]}"}, "error"
            print(json.dumps({"model_type": name, key: value, "outcome": outcome,
                              **{k: row[k] for k in KEEP if k in row}}), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 3 or "." not in sys.argv[1]:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2:]))

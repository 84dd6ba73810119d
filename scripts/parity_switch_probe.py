"""The GPU packed parity (tests/gpu/test_model_parity_cuda.py's check) of zoo types with one
boolean config switch on and then off, in one process, each outcome on a line and each failure's
traceback: what a switch changes in the error of every type's worst parameter (at 5b235b3:
kernels.fused_residual_grad moved mellum's layer-1 router gradient from below 0.30 of its
allowance to 0.93, kolibri1's from below 0.30 to 0.52, both passing; for top-k types such a move
can be the allocator-dependent spread that scripts/parity_spread_probe.py measures, not the switch:
mellum's forward loss moved by one ulp though that switch changes only the backward).
    python3 scripts/parity_switch_probe.py kernels.fused_residual_grad mellum kolibri1 gemma4"""
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.gpu import test_model_parity_cuda as parity  # noqa: E402

from hasten.config import Config  # noqa: E402


def settings(key: str, value: bool) -> dict:
    """{'kernels': {'fused_residual_grad': True}} from 'kernels.fused_residual_grad', True."""
    section, name = key.split(".")
    return {section: {name: value}}


def main(key: str, names: list[str]) -> int:
    real_packed_run = parity.zoo.packed_run
    failures = 0
    for name in names:
        for value in (True, False):
            config = Config.from_dict(settings(key, value))
            parity.zoo.packed_run = lambda model, samples, _config=None, device=None, _c=config: \
                real_packed_run(model, samples, _c, device)
            try:
                row = parity.check_packed_parity(name, parity.LENGTHS, report=False)
                print(f"PROBE {name} {key}={value}: passed, worst {row.get('worst_of_allowed', 0):.3f} of its allowance "
                      f"({row.get('worst_param')}), loss error {row.get('loss_error', 0):.2e}, "
                      f"gradient error {row.get('grad_error', 0):.3e}", flush=True)
            except BaseException as exc:  # noqa: BLE001 - a probe reports every outcome and goes on
                failures += 1
                print(f"PROBE {name} {key}={value}: FAILED {type(exc).__name__}: {str(exc)[:600]}", flush=True)
                traceback.print_exc(limit=-6)
            finally:
                parity.zoo.packed_run = real_packed_run
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) < 3 or "." not in sys.argv[1]:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2:]))

"""Every causal-LM model type of the installed transformers that the zoo (tests/model_zoo.py) does
not hold, built tiny from the zoo's shared shape, run packed under hasten.accelerate against each
sample alone (CPU, float32): what hasten does with a type nobody wrote a test for yet.

Each type gets one line (and one JSON row in --out): `build` (the shared shape is not enough for
its config; nothing learned), `reference` (the model alone fails), `refused` (hasten refuses
packed batches: fine, if the reason is right), `equal`, `MISMATCH` (hasten computes something
else, silently: the worst defect), `crash` (hasten raised something else), `killed` (the process
died, as the OOM killer leaves it: a multimodal default that builds big), `timeout`. Dropout is
switched off under every name a model gives it (BERT's *_prob, CTRL's *_pdrop), and a gradient is
compared relative to its norm floored at 1e-4 of the largest: a key bias's gradient is zero in exact
arithmetic (softmax ignores a constant per query), so its float32 noise has no relative error
worth reading. A MISMATCH is confirmed by hand before it is called a defect.

Found with it (2026-12-05): RoBERTa's family trained packed rows with position_ids from 0 where
alone they start at padding_idx + 1 (now refused: contract.positions_from_tokens); dots3's text
model crashed accelerate() on its per-layer head sizes (contract.config_values).

    python scripts/type_sweep.py [types...] [--timeout 90] [--out rows.jsonl]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# state-space and recurrent types run their scans in Python on the CPU: minutes each, refused anyway
SLOW = {"jamba", "mamba", "mamba2", "falcon_mamba", "zamba", "zamba2", "bamba", "falcon_h1", "granitemoehybrid",
        "nemotron_h", "rwkv", "xlstm", "recurrent_gemma"}


def _without_dropout(model) -> None:
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "drop" in name and isinstance(value, float):
                setattr(module, name, 0.0)


def sweep_one(model_type: str) -> tuple[str, str]:
    sys.path.insert(0, str(ROOT))
    from tests import model_zoo as zoo

    from hasten.packing import PackingError

    try:
        model = zoo.build(zoo.Entry(model_type, {}, "transformers"))
        _without_dropout(model)
    except BaseException as exc:  # noqa: BLE001 - a config the shared shape does not satisfy
        return "build", f"{type(exc).__name__}: {str(exc)[:200]}"
    try:
        want_loss, want = zoo.per_sample_reference(zoo.clone(model), zoo.samples())
    except Exception as exc:  # noqa: BLE001
        return "reference", f"{type(exc).__name__}: {str(exc)[:200]}"
    try:
        handle, loss, got = zoo.packed_run(model, zoo.samples())
    except PackingError as exc:
        return "refused", f"{type(exc).__name__}: {str(exc)[:300]}"
    except Exception as exc:  # noqa: BLE001
        frames = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in traceback.extract_tb(exc.__traceback__)[-5:])
        return "crash", f"{type(exc).__name__}: {str(exc)[:300]} | {frames}"
    handle.undo()
    loss_error = abs(float(loss) - float(want_loss))
    top = max((float(w.double().norm()) for w in want.values()), default=0.0)
    grad_error = max((float((got[n].double() - w.double()).norm()) / max(float(w.double().norm()), 1e-4 * top, 1e-30)
                      for n, w in want.items()), default=0.0)
    outcome = "equal" if loss_error < 1e-4 and grad_error < 1e-3 else "MISMATCH"
    return outcome, f"loss {loss_error:.2e}, gradient {grad_error:.2e}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("types", nargs="*", help="model types (default: every causal-LM type outside the zoo)")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds per type (each runs in its own process)")
    parser.add_argument("--out", type=Path, default=None, help="append one JSON row per type here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process's type
    args = parser.parse_args()
    if args.one:
        print(json.dumps(sweep_one(args.one)))
        return 0
    types = args.types
    if not types:
        sys.path.insert(0, str(ROOT))
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        from tests import model_zoo as zoo

        types = sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(zoo.ENTRIES) - SLOW)
    counts: dict[str, int] = {}
    for model_type in types:
        try:
            done = subprocess.run([sys.executable, __file__, "--one", model_type], capture_output=True, text=True,
                                  timeout=args.timeout, cwd=ROOT)
            last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
            if last.startswith("["):
                outcome, detail = json.loads(last)
            elif done.returncode < 0 or done.returncode == 137:  # the kernel's OOM killer: the build, not hasten
                outcome, detail = "killed", f"exit {done.returncode} (out of memory building the tiny model?)"
            else:
                outcome, detail = "crash", done.stderr.strip()[-300:]
        except subprocess.TimeoutExpired:
            outcome, detail = "timeout", f"over {args.timeout:.0f} s"
        counts[outcome] = counts.get(outcome, 0) + 1
        print(f"{model_type:28s} {outcome:9s} {detail}", flush=True)
        if args.out is not None:
            with args.out.open("a") as rows:
                rows.write(json.dumps({"model_type": model_type, "outcome": outcome, "detail": detail}) + "\n")
    print("; ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 1 if counts.get("MISMATCH") or counts.get("crash") else 0


if __name__ == "__main__":
    sys.exit(main())

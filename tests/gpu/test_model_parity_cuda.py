"""Every model type of tests/model_zoo.py on the GPU, bf16 with hasten's kernels (cuDNN attention,
fused norm / SwiGLU / RoPE / loss, fused MoE): a packed batch against the unpatched float32 model
run one sample at a time, within the bf16 noise of the unpatched model -- or refused.

The yardstick is measured, not assumed: the unpatched model in bf16, one sample at a time, against
the same float32 reference. hasten may be no further off than a small multiple of that. Set
HASTEN_PARITY_REPORT to a file to append one JSON row per type (errors and noise)."""

import json
import os

import pytest
import torch

from hasten.integrations.transformers import PackedBatchRefused
from hasten.observability import fallback_counts
from tests import model_zoo as zoo

LENGTHS = (7, 1, 19, 12, 1, 33, 157, 301)  # one-token samples, and samples far past the window
# A dropped feature gives errors of order 1 (the CPU test checks each feature moves the reference
# by more than 1e-2); bf16 noise of these tiny models is 1e-3..3e-2.
NOISE_FACTOR, FLOOR = 3.0, 5e-3


def _global(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    diff = torch.cat([(got[n].double() - want[n].double()).flatten() for n in want]).norm()
    return float(diff / torch.cat([want[n].double().flatten() for n in want]).norm())


def _report(row: dict) -> None:
    path = os.environ.get("HASTEN_PARITY_REPORT")
    print(json.dumps(row))
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(row) + "\n")


@pytest.mark.parametrize("name", sorted(zoo.ENTRIES))
def test_packed_bf16_within_noise_of_each_sample_alone_or_refused(name):
    entry = zoo.ENTRIES[name]
    batch_samples = zoo.samples(lengths=LENGTHS)
    reference = zoo.build(entry).to("cuda")
    plain_bf16 = zoo.clone(reference).to(torch.bfloat16)
    patched = zoo.clone(reference).to(torch.bfloat16)
    want_loss, want = zoo.per_sample_reference(reference, batch_samples, device="cuda")
    noise_loss, noise = zoo.per_sample_reference(plain_bf16, batch_samples, device="cuda")

    if entry.attention == "refused":
        with pytest.raises(PackedBatchRefused, match="packed_sequence: false"):
            zoo.packed_run(patched, batch_samples, device="cuda")
        _report({"model_type": name, "outcome": "refused"})
        return
    handle, loss, got = zoo.packed_run(patched, batch_samples, device="cuda")
    noise_errors, errors = zoo.relative_errors(noise, want), zoo.relative_errors(got, want)
    row = {"model_type": name, "outcome": entry.attention,
           "loss_error": abs(float(loss) - float(want_loss)), "loss_noise": abs(float(noise_loss) - float(want_loss)),
           "grad_error": _global(got, want), "grad_noise": _global(noise, want),
           "worst_param": max(errors, key=lambda n: errors[n] - NOISE_FACTOR * noise_errors[n]),
           "fallbacks": fallback_counts(), "active": handle.active}
    row["worst_error"], row["worst_noise"] = errors[row["worst_param"]], noise_errors[row["worst_param"]]
    _report(row)
    if entry.attention == "hasten":
        assert "attention_per_sequence" not in fallback_counts(), row
    assert row["loss_error"] <= NOISE_FACTOR * row["loss_noise"] + FLOOR, row
    assert row["grad_error"] <= NOISE_FACTOR * row["grad_noise"] + FLOOR, row
    for param in want:  # a dropped feature can hide in one parameter (sinks get zero gradient)
        assert errors[param] <= NOISE_FACTOR * noise_errors[param] + 10 * FLOOR, (param, errors[param], row)

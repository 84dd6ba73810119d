"""Every op's bad-input path raises a clear error instead of crashing the process.

Each case runs in a fresh interpreter: a regression here was a segfault (the GPU build once
crashed on any error message holding a number), which would take pytest down with it.
"""

import subprocess
import sys

import pytest
import torch

CASES = {
    "varlen_meta float": ("torch.ops.hasten.varlen_meta(torch.zeros(4, device=D))", "must be Long or Int"),
    "moe_group 1-D": ("torch.ops.hasten.moe_group(torch.tensor([0, 1], device=D), 4)", "must be (tokens, top_k)"),
    "swiglu odd width": ("torch.ops.hasten.swiglu(torch.randn(2, 3, device=D))", "odd width 3"),
    "moe_permute slots": ("torch.ops.hasten.moe_permute(torch.randn(2, 4, device=D), torch.zeros(4, dtype=torch.int32,"
                          " device=D), torch.zeros(3, dtype=torch.int32, device=D), 3, None)", "slots (4) must be"),
    "moe_permute slot_scale": ("torch.ops.hasten.moe_permute(torch.randn(2, 4, device=D), torch.zeros(4, "
                               "dtype=torch.int32, device=D), torch.tensor([0, 4], dtype=torch.int32, device=D), 2, "
                               "torch.ones(3, device=D))", "`slot_scale` needs one value per slot (4)"),
    "moe_combine weights": ("torch.ops.hasten.moe_combine(torch.randn(4, 8, device=D), torch.zeros(4, dtype=torch.int32,"
                            " device=D), torch.zeros(3, dtype=torch.int32, device=D), 2, torch.randn(3, device=D))",
                            "`weights` must be (tokens, top_k)"),
}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_error_is_raised_not_crashed(case, device):
    expr, message = CASES[case]
    # `import hasten` loads no op library; require_extension() does (an alias of ops._lib.load())
    code = (f"import torch\nfrom hasten.ops._lib import require_extension\nrequire_extension()\nD = {device!r}\n"
            f"try:\n    {expr}\nexcept RuntimeError as e:\n"
            f"    print('RAISED', str(e).splitlines()[0])\nelse:\n    print('NO ERROR')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{case} on {device} crashed (rc {proc.returncode}): {proc.stderr[-500:]}"
    assert "RAISED" in proc.stdout and message in proc.stdout, proc.stdout

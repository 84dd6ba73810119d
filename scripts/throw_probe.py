"""Each hasten op error case in its own process: prints which raise cleanly and which crash."""
import subprocess
import sys

CASES = {
    "varlen_meta float": "torch.ops.hasten.varlen_meta(torch.zeros(4))",
    "moe_group 1-D": "torch.ops.hasten.moe_group(torch.tensor([0, 1]), 4)",
    "moe_group out of range": "torch.ops.hasten.moe_group(torch.tensor([[0, 1], [9, 2]]), 4)",
    "swiglu odd": "torch.ops.hasten.swiglu(torch.randn(2, 3))",
    "moe_permute bad top_k": "torch.ops.hasten.moe_permute(torch.randn(2, 4), torch.zeros(4, dtype=torch.int32), "
                             "torch.zeros(3, dtype=torch.int32), 3, None)",
}
for name, expr in CASES.items():
    code = f"import torch, hasten\ntry:\n    {expr}\nexcept RuntimeError as e:\n    print('raised:', str(e).splitlines()[0][:100])"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    print(f"{name:>24}: rc={proc.returncode} {proc.stdout.strip()[:110]}")

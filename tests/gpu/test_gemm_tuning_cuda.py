"""training.gemm_tuning on the GPU: with TunableOp on, hasten's fused LoRA projection and a plain
bf16 GEMM give what cuBLAS's heuristic pick gives (float32 accumulation both ways: within bf16
rounding), at least one shape is tuned and its result lands in our file, and undo() switches
TunableOp off again."""

import pytest
import torch

from hasten.training.gemm_tuning import enable_gemm_tuning

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_tuned_gemms_equal_the_heuristic_pick_and_the_file_is_ours(tmp_path):
    torch.manual_seed(0)
    # sizes off the tile multiples
    x = torch.randn(1000, 520, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(776, 520, device="cuda", dtype=torch.bfloat16) / 520**0.5
    want = x @ w.t()
    tuning = enable_gemm_tuning(torch.device("cuda"), tmp_path / "gemm_tuning.csv", max_ms=2)
    try:
        assert torch.cuda.tunable.is_enabled()
        got = x @ w.t()
        torch.cuda.synchronize()
        assert tuning.tuned_shapes() >= 1
    finally:
        tuning.undo()
    assert not torch.cuda.tunable.is_enabled()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    written = list(tmp_path.glob("gemm_tuning*.csv"))
    assert written, "TunableOp wrote no results file of ours"
    assert "GemmTunableOp" in written[0].read_text()


def test_fused_lora_projection_under_tuning_equals_untuned(tmp_path):
    from hasten.ops.lora import lora_linear

    torch.manual_seed(1)
    x = torch.randn(777, 264, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(392, 264, device="cuda", dtype=torch.bfloat16) / 16
    a = (torch.randn(8, 264, device="cuda", dtype=torch.bfloat16) / 16).requires_grad_()
    b = (torch.randn(392, 8, device="cuda", dtype=torch.bfloat16) / 4).requires_grad_()

    def run():
        y = lora_linear(x, weight, None, a, b, 2.0)
        grads = torch.autograd.grad(y.float().square().sum(), (x, a, b))
        return [y.detach().float(), *[g.float() for g in grads]]

    want = run()
    tuning = enable_gemm_tuning(torch.device("cuda"), tmp_path / "gemm_tuning.csv", max_ms=2)
    try:
        got = run()
    finally:
        tuning.undo()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=3e-2, atol=3e-2 * float(w.abs().max()))

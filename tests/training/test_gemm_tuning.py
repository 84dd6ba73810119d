"""training.gemm_tuning (hasten/training/gemm_tuning.py): TunableOp switched on with a results file
of ours and its earlier settings restored by undo(); said once where there is no CUDA device. The
GPU twin (tuned GEMMs equal to cuBLAS's pick, the file written): tests/gpu/test_gemm_tuning_cuda.py."""

import types

import pytest
import torch

from hasten.observability import fallback_counts, reset_fallbacks
from hasten.training import gemm_tuning
from hasten.training.gemm_tuning import GemmTuning, enable_gemm_tuning


class FakeTunable:
    """torch.cuda.tunable's settings as plain attributes (a CPU build of torch has no TunableOp)."""

    def __init__(self):
        self.enabled, self.tuning, self.filename, self.max_ms, self.ordinal = False, True, "", 30, None
        self.results = []

    def is_enabled(self):
        return self.enabled

    def enable(self, value=True):
        self.enabled = value

    def tuning_is_enabled(self):
        return self.tuning

    def tuning_enable(self, value=True):
        self.tuning = value

    def get_filename(self):
        return self.filename

    def set_filename(self, filename, insert_device_ordinal=False):
        self.filename, self.ordinal = filename, insert_device_ordinal

    def get_max_tuning_duration(self):
        return self.max_ms

    def set_max_tuning_duration(self, value):
        self.max_ms = value

    def get_results(self):
        return self.results


@pytest.fixture
def fake_tunable(monkeypatch):
    fake = FakeTunable()
    monkeypatch.setattr(gemm_tuning.torch, "cuda", types.SimpleNamespace(tunable=fake, is_available=lambda: True))
    return fake


def test_switches_tunableop_on_with_our_file_and_undo_restores(fake_tunable, tmp_path):
    results = tmp_path / "run" / "gemm_tuning.csv"
    tuning = enable_gemm_tuning(torch.device("cuda"), results, max_ms=7)
    assert isinstance(tuning, GemmTuning)
    assert (fake_tunable.enabled, fake_tunable.tuning, fake_tunable.max_ms) == (True, True, 7)
    # our file, never PyTorch's default in the working directory, one per device
    assert (fake_tunable.filename, fake_tunable.ordinal) == (str(results), True)
    assert results.parent.is_dir()
    fake_tunable.results = [("GemmTunableOp_BFloat16_NT", "nt_16384_4096_4096", "Gemm_Cublaslt_3", 0.7)]
    assert tuning.tuned_shapes() == 1
    tuning.undo()
    tuning.undo()  # twice is once
    assert (fake_tunable.enabled, fake_tunable.tuning, fake_tunable.filename, fake_tunable.max_ms) == (False, True, "", 30)


def test_undo_restores_settings_someone_else_made(fake_tunable, tmp_path):
    fake_tunable.enabled, fake_tunable.tuning, fake_tunable.filename = True, False, "theirs.csv"
    enable_gemm_tuning(torch.device("cuda"), tmp_path / "gemm_tuning.csv").undo()
    assert (fake_tunable.enabled, fake_tunable.tuning, fake_tunable.filename) == (True, False, "theirs.csv")


def test_on_the_cpu_said_once_and_nothing_changes(tmp_path):
    reset_fallbacks()
    assert enable_gemm_tuning(torch.device("cpu"), tmp_path / "gemm_tuning.csv") is None
    assert fallback_counts().get("gemm_tuning") == 1
    assert not (tmp_path / "gemm_tuning.csv").exists()

"""benchmarks/default_job.py on the CPU with the tiny default model: each variant's config differs
from the defaults only in its switches, rows are written with a loss check against eager that
fails when the curves differ, and an unknown variant is refused with exit 2."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

pytest.importorskip("transformers")
import default_job as dj  # noqa: E402


def test_variant_configs_change_only_their_switches():
    eager = dj.variant_config("eager", 3, "tiny").to_dict()
    assert eager["training"]["max_steps"] == 3 and eager["training"]["logging_steps"] == 1
    assert eager["model"]["default_size"] == "tiny" and eager["training"]["packed_sequence"] is True
    for name, settings in dj.SETTINGS.items():
        raw = dj.variant_config(name, 3, "tiny").to_dict()
        changed = {k: v for k, v in raw["training"].items() if eager["training"][k] != v}
        assert changed == settings, name
        assert {k: v for k, v in raw.items() if k != "training"} == \
            {k: v for k, v in eager.items() if k != "training"}
    baseline = dj.variant_config("baseline", 3, "tiny").to_dict()
    assert baseline["training"]["packed_sequence"] is False
    assert not any(baseline["kernels"].values())


def test_rows_on_the_cpu_and_the_loss_check(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["default_job.py", "--steps", "2", "--warmup", "1", "--size", "tiny",
                                      "--variants", "graphed_optimizer,eager", "--out", str(tmp_path)])
    assert dj.main() == 0
    rows = [json.loads(line) for line in (tmp_path / "default_job.jsonl").read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["eager", "graphed_optimizer"]  # the reference first
    eager, graphed = rows
    assert len(eager["losses"]) == 2 and eager["tokens_per_s"] > 0 and eager["run_id"] == graphed["run_id"]
    # on the CPU the graphed optimizer falls back (loudly, counted) and computes the same steps
    assert graphed["fallbacks"].get("cuda_graph_optimizer") == 1
    assert graphed["correct"] is True and graphed["loss_max_abs_diff_vs_eager"] == 0.0


def test_loss_check_fails_a_curve_that_differs_or_is_short():
    eager = [5.0, 4.5, 4.0]
    assert dj.loss_check(eager, [5.0, 4.5, 4.0], 2e-2) == (0.0, True)
    worst, ok = dj.loss_check(eager, [5.0, 4.53, 4.0], 2e-2)
    assert not ok and worst == pytest.approx(0.03)
    assert dj.loss_check(eager, [5.0, 4.5], 2e-2)[1] is False  # a run that stopped early


def test_unknown_variant_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["default_job.py", "--variants", "eager,turbo"])
    assert dj.main() == 2
    assert "turbo" in capsys.readouterr().err

"""`hasten bench` through hasten.cli.main: the A/B run, its table, JSON, plot and exit codes."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import statistics
import sys
from pathlib import Path

import pytest
import torch
import transformers

import hasten
from hasten.cli.main import main
from hasten.training import bench as bench_lib

TINY = """
model: {default_size: tiny}
training: {max_tokens: 512, learning_rate: 0.003, warmup_steps: 1}
"""
STEPS = 3
LAYERS = 2  # the tiny embedded model
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
TABLE_METRICS = ["tokens/s (median)", "step time (median)", "peak memory", "final loss", "fallbacks"]


def run_bench(tmp_path: Path, *extra: str, config_text: str = TINY) -> tuple[int, str, str, Path]:
    config = tmp_path / "config.yaml"
    config.write_text(config_text)
    out_dir = tmp_path / "bench"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(["bench", "--config", str(config), "--steps", str(STEPS), "--output_dir", str(out_dir),
                   "--no_progress", *extra])
    return rc, stdout.getvalue(), stderr.getvalue(), out_dir


def table_rows(stdout: str) -> dict[str, list[str]]:
    """metric -> [baseline, hasten, ratio] from the printed table (columns split on 2+ spaces)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split() == ["metric", "baseline", "hasten", "ratio"])
    assert set(lines[start + 1]) == {"-", " "}
    rows = {}
    for line in lines[start + 2: start + 2 + len(TABLE_METRICS)]:
        cells = [c for c in line.split("  ") if c.strip()]
        rows[cells[0].strip()] = [c.strip() for c in cells[1:]]
    return rows


@pytest.fixture(scope="module")
def good_run(tmp_path_factory: pytest.TempPathFactory):
    tmp_path = tmp_path_factory.mktemp("bench_ok")
    rc, out, err, out_dir = run_bench(tmp_path)
    return rc, out, err, out_dir, json.loads((out_dir / "bench.json").read_text())


def test_exit_code_and_json_variants(good_run) -> None:
    rc, _, err, out_dir, report = good_run
    assert rc == 0, err
    assert report["exit_code"] == 0 and report["engaged"] is True and report["problems"] == []
    assert report["steps"] == STEPS
    assert set(report["variants"]) == {"baseline", "hasten"}
    for name, variant in report["variants"].items():
        assert variant["name"] == name
        assert variant["steps"] == STEPS
        assert variant["curve_steps"] == [1, 2, 3]
        rows = [json.loads(line) for line in (out_dir / name / "logs" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert variant["curve_loss"] == [r["loss"] for r in rows]
        # three logged steps: the first is warm-up and left out of the medians
        assert variant["warmup_skipped"] is True
        assert variant["tokens_per_s"] == statistics.median(r["tokens_per_s"] for r in rows[1:])
        assert variant["step_s"] == statistics.median(r["step_s"] for r in rows[1:])
        assert variant["tokens_per_s"] > 0 and variant["step_s"] > 0 and variant["peak_gib"] > 0
        assert variant["final_loss"] == rows[-1]["loss"]
    base, fast = report["variants"]["baseline"], report["variants"]["hasten"]
    assert base["hasten_active"] == []
    assert fast["hasten_active"][0] == "varlen attention (packed sequences, no mask)"
    assert fast["packing_efficiency"] == 1.0 and base["packing_efficiency"] is None


def test_variant_configs_are_hasten_off_and_on(good_run) -> None:
    out_dir = good_run[3]
    configs = {name: json.loads((out_dir / name / "logs" / "config.json").read_text())["training"]
               for name in ("baseline", "hasten")}
    for training in configs.values():
        assert (training["max_steps"], training["logging_steps"], training["max_tokens"]) == (STEPS, 1, 512)
        assert training["seed"] == 0 and training["learning_rate"] == 0.003
        assert training["checkpoint"]["interval_steps"] == STEPS + 1  # no checkpoint inside the timed steps
    off, on = configs["baseline"], configs["hasten"]
    assert (off["packed_sequence"], off["metadata_cache"], off["moe"]["fused_grouping"]) == (False, False, False)
    assert (on["packed_sequence"], on["metadata_cache"], on["moe"]["fused_grouping"]) == (True, True, True)
    assert (off["checkpoint"]["offload"], off["checkpoint"]["double_buffer"]) == ("none", False)
    kernels = {name: json.loads((out_dir / name / "logs" / "config.json").read_text())["kernels"]
               for name in ("baseline", "hasten")}
    assert not any(kernels["baseline"].values()) and kernels["hasten"]["fused_cross_entropy"]


def test_ratios_loss_agreement_and_environment(good_run) -> None:
    report = good_run[4]
    base, fast = report["variants"]["baseline"], report["variants"]["hasten"]
    ratios = report["ratios"]
    assert set(ratios) == {"tokens_per_s", "step_s", "peak_gib", "final_loss"}
    assert ratios["tokens_per_s"] == pytest.approx(fast["tokens_per_s"] / base["tokens_per_s"], rel=1e-12)
    assert ratios["step_s"] == pytest.approx(fast["step_s"] / base["step_s"], rel=1e-12)
    assert ratios["final_loss"] == pytest.approx(fast["final_loss"] / base["final_loss"], rel=1e-12)
    on_cuda = fast["device"].startswith("cuda")
    if on_cuda:
        assert ratios["peak_gib"] == pytest.approx(fast["peak_gib"] / base["peak_gib"], rel=1e-12)
    else:
        assert ratios["peak_gib"] is None  # process max RSS on the CPU: not per run

    diffs = [abs(h - b) for b, h in zip(base["curve_loss"], fast["curve_loss"])]
    relative = statistics.fmean(diffs) / statistics.fmean(base["curve_loss"])
    agreement = report["loss_agreement"]
    assert agreement["mean_abs_diff"] == pytest.approx(statistics.fmean(diffs), rel=1e-12)
    assert agreement["relative"] == pytest.approx(relative, rel=1e-12)
    assert agreement["threshold"] == 0.10
    assert report["loss_agreement_ok"] is agreement["ok"] is (relative <= 0.10)
    assert report["loss_agreement_ok"] is True  # same init, same samples per step

    env = report["environment"]
    assert (env["torch"], env["transformers"], env["hasten"]) == (
        torch.__version__, transformers.__version__, hasten.__version__)
    assert env["device"] == fast["device"] == base["device"]


def test_table_printed(good_run) -> None:
    _, out, _, out_dir, report = good_run
    base, fast = report["variants"]["baseline"], report["variants"]["hasten"]
    rows = table_rows(out)
    assert list(rows) == TABLE_METRICS
    assert rows["tokens/s (median)"] == [f"{base['tokens_per_s']:,.0f}", f"{fast['tokens_per_s']:,.0f}",
                                         f"{report['ratios']['tokens_per_s']:.2f}x"]
    assert rows["step time (median)"] == [f"{base['step_s'] * 1000:.1f} ms", f"{fast['step_s'] * 1000:.1f} ms",
                                          f"{report['ratios']['step_s']:.2f}x"]
    assert rows["final loss"] == [f"{base['final_loss']:.4f}", f"{fast['final_loss']:.4f}",
                                  f"{report['ratios']['final_loss']:.2f}x"]
    assert f"hasten bench: report in {out_dir / 'bench.json'}" in out.splitlines()


def test_expected_cpu_fallbacks_listed(good_run) -> None:
    rc, out, _, _, report = good_run
    fast = report["variants"]["hasten"]
    if fast["device"] != "cpu":
        assert fast["fallbacks"] == {} and report["expected_fallbacks"] == {}
        return
    # 2 attention layers x 3 steps through the per-sequence path; no MoE in the tiny model
    assert fast["fallbacks"] == {"attention_per_sequence": LAYERS * STEPS}
    assert report["expected_fallbacks"] == {"attention_per_sequence": "expected on CPU"}
    assert report["variants"]["baseline"]["fallbacks"] == {}
    assert table_rows(out)["fallbacks"] == ["none", str(LAYERS * STEPS)]
    line = next(line for line in out.splitlines() if line.startswith("fallback [hasten]"))
    assert line.startswith(f"fallback [hasten] attention_per_sequence x{LAYERS * STEPS} (expected on CPU): "
                           "packed attention runs one sequence at a time")
    assert rc == 0


def test_plot_written(good_run) -> None:
    _, out, _, out_dir, report = good_run
    if not HAS_MATPLOTLIB:
        assert report["plot"] is None
        pytest.skip("matplotlib is not installed")
    png = out_dir / "bench.png"
    assert report["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"hasten bench: plot in {png}" in out.splitlines()


def test_without_matplotlib_plot_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    json_path, plot_path = tmp_path / "elsewhere" / "report.json", tmp_path / "plot.png"
    rc, out, err, _ = run_bench(tmp_path, "--json", str(json_path), "--plot", str(plot_path))
    assert rc == 0, err
    notices = [line for line in out.splitlines() if line.startswith("hasten bench: plot skipped: ")]
    assert len(notices) == 1 and "matplotlib is not importable" in notices[0]
    assert "error" not in err.lower()
    assert not plot_path.exists()
    report = json.loads(json_path.read_text())
    assert report["plot"] is None and report["exit_code"] == 0


def _tamper_hasten_summary(monkeypatch: pytest.MonkeyPatch, edit) -> None:
    """Run the real loop, then rewrite the hasten run's summary.json as `edit` says."""
    real_train = bench_lib.train

    def train(config, output_dir, log_dir, **kwargs):
        result = real_train(config, output_dir, log_dir, **kwargs)
        if config.training.packed_sequence:
            path = Path(log_dir) / "summary.json"
            summary = json.loads(path.read_text())
            edit(summary)
            path.write_text(json.dumps(summary))
        return result

    monkeypatch.setattr(bench_lib, "train", train)


def test_unexpected_fallback_exits_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def edit(summary):
        summary["fallbacks"]["attention_padded_batch"] = 3
        summary["fallback_reasons"]["attention_padded_batch"] = "a batch came with a padding attention_mask"

    _tamper_hasten_summary(monkeypatch, edit)
    rc, out, err, out_dir = run_bench(tmp_path)
    assert rc == 3
    device = json.loads((out_dir / "hasten" / "logs" / "summary.json").read_text())["device"]
    where = "on CUDA any fallback counts" if device.startswith("cuda") else f"on {device}"
    problem = (f"unexpected fallback `attention_padded_batch` (3 calls, {where}): "
               "a batch came with a padding attention_mask")
    assert err.splitlines()[-2:] == ["hasten bench: the optimized path did not engage in the hasten run:",
                                     f"  - {problem}"]
    assert "fallback [hasten] attention_padded_batch x3 (UNEXPECTED): " in out
    report = json.loads((out_dir / "bench.json").read_text())  # the report is still written
    assert (report["exit_code"], report["engaged"], report["problems"]) == (3, False, [problem])


def test_missing_varlen_entry_exits_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def edit(summary):
        summary["hasten_active"] = [a for a in summary["hasten_active"] if not a.startswith("varlen attention")]
        summary["hasten_inactive"].append("varlen attention (model type 'x' not supported)")

    _tamper_hasten_summary(monkeypatch, edit)
    rc, _, err, out_dir = run_bench(tmp_path)
    assert rc == 3
    report = json.loads((out_dir / "bench.json").read_text())
    (problem,) = report["problems"]  # names what was active instead, and why varlen was not
    assert problem.startswith("varlen attention is not in hasten_active (active: metadata cache (once per batch)")
    assert problem.endswith("; varlen attention (model type 'x' not supported))")
    assert err.splitlines()[-1] == f"  - {report['problems'][0]}"


def _variant(device: str, fallbacks: dict[str, int], active=("varlen attention (packed sequences, no mask)",)):
    return bench_lib.VariantResult(
        name="hasten", steps=1, tokens_per_s=1.0, step_s=1.0, peak_gib=1.0, final_loss=1.0, tokens=1,
        fallbacks=fallbacks, fallback_reasons={k: f"why {k}" for k in fallbacks}, hasten_active=list(active),
        hasten_inactive=[], device=device, dtype="torch.bfloat16", packing_efficiency=1.0, warmup_skipped=False)


def test_expected_fallbacks_depend_on_device() -> None:
    cpu_fallbacks = {"attention_per_sequence": 4, "moe_grouped_gemm": 2}
    assert bench_lib.engagement_problems(_variant("cpu", cpu_fallbacks)) == (
        [], {"attention_per_sequence": "expected on CPU", "moe_grouped_gemm": "expected on CPU"})
    # on CUDA every fallback counts
    assert bench_lib.engagement_problems(_variant("cuda:0", cpu_fallbacks)) == ([
        "unexpected fallback `attention_per_sequence` (4 calls, on CUDA any fallback counts): "
        "why attention_per_sequence",
        "unexpected fallback `moe_grouped_gemm` (2 calls, on CUDA any fallback counts): why moe_grouped_gemm",
    ], {})
    assert bench_lib.engagement_problems(_variant("cuda:0", {})) == ([], {})
    assert bench_lib.engagement_problems(_variant("cpu", {"gqa_repeat_kv": 1})) == (
        ["unexpected fallback `gqa_repeat_kv` (1 calls, on cpu): why gqa_repeat_kv"], {})


def test_bad_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    rc, out, err, _ = run_bench(tmp_path, config_text="training: {max_tokenz: 512}\n")
    assert rc == 2
    assert err == (f"hasten bench: error: {tmp_path / 'config.yaml'}: unknown key `training.max_tokenz`; "
                   "did you mean `training.max_tokens`?\n")
    assert out == ""


def test_bad_steps_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(TINY)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        rc = main(["bench", "--config", str(config), "--steps", "0", "--output_dir", str(tmp_path / "b")])
    assert rc == 2
    assert stderr.getvalue().endswith("`training.max_steps` must be at least 1; got 0\n")
    assert not (tmp_path / "b").exists()


def test_foreign_output_folder_is_not_overwritten(tmp_path: Path) -> None:
    mine = tmp_path / "bench" / "baseline" / "notes.txt"
    mine.parent.mkdir(parents=True)
    mine.write_text("keep me")
    rc, _, err, _ = run_bench(tmp_path)
    assert rc == 2
    assert err == (f"hasten bench: error: {mine.parent} exists, is not empty and was not written by hasten bench; "
                   "choose another --output_dir or remove it\n")
    assert mine.read_text() == "keep me"


def test_previous_bench_folder_is_replaced(tmp_path: Path) -> None:
    folder = tmp_path / "hasten"
    (folder / "logs").mkdir(parents=True)
    (folder / ".hasten-bench").write_text("")
    (folder / "logs" / "metrics.jsonl").write_text('{"step": 1}\n')  # appended to by the loop: must go
    bench_lib._prepare_dir(folder)
    assert sorted(p.name for p in folder.iterdir()) == [".hasten-bench"]

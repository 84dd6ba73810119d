"""Before/after comparison behind `hasten bench`: the same job with hasten off, then on.

`run_ab(config, steps, output_dir)` trains twice through `hasten.training.loop.train`,
same data and seed:

  baseline  hasten off: training.packed_sequence, training.metadata_cache,
            training.moe.fused_grouping and every kernels.* switch false and activation offload
            off, so batches are padded micro-batches through transformers' own attention,
            experts, norms, MLPs and loss (activation checkpointing stays as configured)
  hasten    the config as given, with training.packed_sequence forced true

each for `steps` steps with a metrics row per step, in `output_dir/baseline` and
`output_dir/hasten`. The report holds per variant the median tokens/s and step time
(the first step skipped as warm-up when there are three or more), the peak memory,
the final loss and the fallbacks; the ratios hasten / baseline; how far apart the two
loss curves are; and whether the optimized path engaged (`problems`, empty when it did).
"""

from __future__ import annotations

import json
import platform
import shutil
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from hasten.config import Config, ConfigError
from hasten.training.loop import train
from hasten.training.metrics import median_rates, read_metrics
from hasten.training.telemetry import version_record

VARIANTS = ("baseline", "hasten")
# hasten_active entry that says packed batches reach hasten's varlen attention
VARLEN_ACTIVE_PREFIX = "varlen attention"
# Fallbacks a CPU run takes by design: the varlen kernels and grouped GEMM need a GPU.
EXPECTED_CPU_FALLBACKS = ("attention_per_sequence", "moe_grouped_gemm")
LOSS_AGREEMENT_THRESHOLD = 0.10
_MARKER = ".hasten-bench"


class BenchInterrupted(Exception):
    """A signal (SIGINT / SIGTERM) stopped one of the runs; there is no comparison to report."""

    def __init__(self, signal_name: str, variant: str) -> None:
        super().__init__(f"stopped by {signal_name} during the {variant} run; no comparison was made")
        self.signal_name = signal_name
        self.variant = variant


@dataclass
class VariantResult:
    name: str
    steps: int
    tokens_per_s: float          # median over logged steps (first skipped as warm-up when >= 3)
    step_s: float                # median, same steps
    peak_gib: float              # CUDA: max allocated in this run; CPU: process max RSS so far
    final_loss: float
    tokens: int
    fallbacks: dict[str, int]
    fallback_reasons: dict[str, str]
    hasten_active: list[str]
    hasten_inactive: list[str]
    device: str
    dtype: str
    packing_efficiency: float | None
    warmup_skipped: bool
    curve_steps: list[int] = field(default_factory=list)
    curve_loss: list[float] = field(default_factory=list)
    curve_tokens_per_s: list[float] = field(default_factory=list)
    log_dir: str = ""


@dataclass
class BenchReport:
    steps: int
    output_dir: str
    baseline: VariantResult
    hasten: VariantResult
    ratios: dict[str, float | None]       # hasten / baseline
    loss_mean_abs_diff: float
    loss_relative_diff: float             # mean |loss_h - loss_b| / mean(loss_b)
    loss_agreement_ok: bool
    expected_fallbacks: dict[str, str]    # fallback key -> why it is expected on this device
    problems: list[str]                   # why the optimized path did not engage; empty when it did
    environment: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    @property
    def engaged(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "output_dir": self.output_dir,
            "variants": {"baseline": asdict(self.baseline), "hasten": asdict(self.hasten)},
            "ratios": dict(self.ratios),
            "loss_agreement": {"mean_abs_diff": self.loss_mean_abs_diff, "relative": self.loss_relative_diff,
                               "threshold": LOSS_AGREEMENT_THRESHOLD, "ok": self.loss_agreement_ok},
            "loss_agreement_ok": self.loss_agreement_ok,
            "engaged": self.engaged,
            "problems": list(self.problems),
            "expected_fallbacks": dict(self.expected_fallbacks),
            "environment": dict(self.environment),
            "notes": list(self.notes),
        }


def variant_configs(config: Config, steps: int) -> dict[str, Config]:
    """The two configs of the comparison (ConfigError when `steps` is not a valid step count)."""
    base = config.to_dict()
    # a metrics row per step; no periodic checkpoint inside the timed steps
    base["training"].update(max_steps=steps, logging_steps=1)
    if isinstance(steps, int) and steps >= 1:
        base["training"]["checkpoint"]["interval_steps"] = steps + 1
    off = json.loads(json.dumps(base))
    off["training"].update(packed_sequence=False, metadata_cache=False)
    off["training"]["moe"]["fused_grouping"] = False
    off["kernels"] = {name: False for name in off["kernels"]}  # every fused kernel, whatever the version has
    off["training"]["checkpoint"].update(offload="none", double_buffer=False, max_memory_gib=None)
    on = json.loads(json.dumps(base))
    on["training"]["packed_sequence"] = True
    return {"baseline": Config.from_dict(off, source="hasten bench (baseline)"),
            "hasten": Config.from_dict(on, source="hasten bench (hasten)")}


def _prepare_dir(folder: Path) -> None:
    """An empty folder for one variant. A previous bench's folder is replaced (metrics.jsonl is
    appended to, so stale rows would mix in); a folder bench did not make is left alone."""
    if folder.exists():
        if not folder.is_dir():
            raise ConfigError(f"{folder} exists and is not a folder; choose another --output_dir")
        if (folder / _MARKER).is_file():
            shutil.rmtree(folder)
        elif any(folder.iterdir()):
            raise ConfigError(f"{folder} exists, is not empty and was not written by hasten bench; "
                              "choose another --output_dir or remove it")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / _MARKER).write_text("written by hasten bench; replaced by the next bench run here\n")
    except OSError as exc:
        raise ConfigError(f"cannot create {folder}: {exc.strerror}; choose a writable --output_dir") from exc


def read_summary(log_dir: Path) -> dict[str, Any]:
    """A finished run's summary.json."""
    return json.loads((log_dir / "summary.json").read_text(encoding="utf-8"))


def run_variant(name: str, config: Config, output_dir: Path, progress: bool) -> VariantResult:
    """Train `config` in `output_dir/name` (replacing an earlier bench's folder there) and read its
    metrics back: also what benchmarks/default_job.py times its variants with."""
    folder = output_dir / name
    _prepare_dir(folder)
    log_dir = folder / "logs"
    result = train(config, folder, log_dir, progress=progress)
    stopped_by = getattr(result, "interrupted_by", None)
    if stopped_by is not None:
        raise BenchInterrupted(stopped_by, name)
    count = len(result.losses)  # this run's rows: the file may hold an earlier run's too
    rows = read_metrics(Path(result.metrics_path))[-count:] if count else []
    if not rows:
        raise ConfigError(f"the {name} run logged no metrics in {result.metrics_path}")
    summary = read_summary(log_dir)
    warmup_skipped = len(rows) >= 3
    tokens_per_s, step_s = median_rates(rows, warmup_rows=1 if warmup_skipped else 0)
    packing = summary.get("packing") or {}
    return VariantResult(
        name=name,
        steps=int(summary.get("steps", result.steps)),
        tokens_per_s=tokens_per_s,
        step_s=step_s,
        peak_gib=float(max(r["peak_gib"] for r in rows)),
        final_loss=float(summary.get("final_loss", result.final_loss)),
        tokens=int(summary.get("tokens", result.tokens)),
        fallbacks=dict(summary.get("fallbacks") or {}),
        fallback_reasons=dict(summary.get("fallback_reasons") or {}),
        hasten_active=list(summary.get("hasten_active") or []),
        hasten_inactive=list(summary.get("hasten_inactive") or []),
        device=str(summary.get("device", "?")),
        dtype=str(summary.get("dtype", "?")),
        packing_efficiency=packing.get("efficiency"),
        warmup_skipped=warmup_skipped,
        curve_steps=[int(r["step"]) for r in rows],
        curve_loss=[float(r["loss"]) for r in rows],
        curve_tokens_per_s=[float(r["tokens_per_s"]) for r in rows],
        log_dir=str(log_dir),
    )


def expected_fallbacks(device: str) -> dict[str, str]:
    """Fallbacks that do not mean "hasten silently did not engage" on this device."""
    if device.split(":")[0] == "cpu":
        return {key: "expected on CPU" for key in EXPECTED_CPU_FALLBACKS}
    return {}


def engagement_problems(variant: VariantResult) -> tuple[list[str], dict[str, str]]:
    """Why the optimized run did not take the optimized path (empty when it did), and the
    fallbacks it took that are expected on its device."""
    problems: list[str] = []
    if not any(item.startswith(VARLEN_ACTIVE_PREFIX) for item in variant.hasten_active):
        inactive = "; ".join(i for i in variant.hasten_inactive if "attention" in i) or "no reason recorded"
        problems.append(f"varlen attention is not in hasten_active (active: "
                        f"{', '.join(variant.hasten_active) or 'nothing'}; {inactive})")
    allowed = expected_fallbacks(variant.device)
    expected = {}
    for key, count in sorted(variant.fallbacks.items()):
        if key in allowed:
            expected[key] = allowed[key]
            continue
        reason = variant.fallback_reasons.get(key, "no reason recorded")
        where = "on CUDA any fallback counts" if variant.device.startswith("cuda") else f"on {variant.device}"
        problems.append(f"unexpected fallback `{key}` ({count} calls, {where}): {reason}")
    return problems, expected


def _ratio(new: float, old: float) -> float | None:
    return new / old if old else None


def environment(device: str) -> dict[str, Any]:
    """The run's version combination (the same record `hasten train` writes) plus the device."""
    import hasten

    record = version_record()
    packages = record["packages"]
    env: dict[str, Any] = {"hasten": hasten.__version__, "torch": torch.__version__,
                           "transformers": packages.get("transformers"), **record, "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name(torch.device(device).index or 0)
    else:
        env["device_name"] = platform.processor() or platform.machine()
        env["cpu_threads"] = torch.get_num_threads()
    return env


def run_ab(config: Config, steps: int = 20, output_dir: str | Path = "runs/bench", *,
           progress: bool = True) -> BenchReport:
    """Train the baseline and the hasten variant of `config` for `steps` steps each and compare."""
    output_dir = Path(output_dir)
    configs = variant_configs(config, steps)
    results = {name: run_variant(name, configs[name], output_dir, progress) for name in VARIANTS}
    base, fast = results["baseline"], results["hasten"]

    n = min(len(base.curve_loss), len(fast.curve_loss))
    diffs = [abs(h - b) for b, h in zip(base.curve_loss[:n], fast.curve_loss[:n])]
    mean_abs = statistics.fmean(diffs) if diffs else float("nan")
    base_mean = statistics.fmean(base.curve_loss[:n]) if n else float("nan")
    relative = mean_abs / abs(base_mean) if base_mean else float("inf")

    on_cuda = fast.device.startswith("cuda")
    notes = []
    if not on_cuda:
        notes.append("peak memory on the CPU is the process's max RSS, which includes the baseline run before it; "
                     "the two are not comparable (no ratio)")
        notes.append("on the CPU hasten's packed attention runs one sequence at a time (the expected fallback), "
                     "so no speedup is expected here; run on a CUDA GPU for the real comparison")
    if base.tokens and fast.tokens and abs(base.tokens - fast.tokens) > 0.01 * base.tokens:
        notes.append(f"the baseline processed {base.tokens:,} tokens and hasten {fast.tokens:,}: padded batches "
                     "do not apply training.overlong to samples longer than training.max_tokens, so the steps are "
                     "not the same work; compare tokens/s rather than step time")
    ratios = {
        "tokens_per_s": _ratio(fast.tokens_per_s, base.tokens_per_s),
        "step_s": _ratio(fast.step_s, base.step_s),
        "peak_gib": _ratio(fast.peak_gib, base.peak_gib) if on_cuda else None,
        "final_loss": _ratio(fast.final_loss, base.final_loss),
    }
    problems, expected = engagement_problems(fast)
    return BenchReport(steps=steps, output_dir=str(output_dir), baseline=base, hasten=fast, ratios=ratios,
                       loss_mean_abs_diff=mean_abs, loss_relative_diff=relative,
                       loss_agreement_ok=relative <= LOSS_AGREEMENT_THRESHOLD, expected_fallbacks=expected,
                       problems=problems, environment=environment(fast.device), notes=notes)


def format_table(report: BenchReport) -> str:
    """The comparison as a fixed-width table (ratio = hasten / baseline) with notes below it."""
    b, h, r = report.baseline, report.hasten, report.ratios

    def ratio(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f}x"

    def fallbacks(v: VariantResult) -> str:
        return str(sum(v.fallbacks.values())) if v.fallbacks else "none"

    rows = [
        ("metric", "baseline", "hasten", "ratio"),
        ("tokens/s (median)", f"{b.tokens_per_s:,.0f}", f"{h.tokens_per_s:,.0f}", ratio(r["tokens_per_s"])),
        ("step time (median)", f"{b.step_s * 1000:.1f} ms", f"{h.step_s * 1000:.1f} ms", ratio(r["step_s"])),
        ("peak memory", f"{b.peak_gib:.2f} GiB", f"{h.peak_gib:.2f} GiB", ratio(r["peak_gib"])),
        ("final loss", f"{b.final_loss:.4f}", f"{h.final_loss:.4f}", ratio(r["final_loss"])),
        ("fallbacks", fallbacks(b), fallbacks(h), ""),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [f"hasten bench: {report.steps} steps per variant on {h.device} ({h.dtype}), same data and seed; "
             f"ratio = hasten / baseline"
             + ("; medians skip step 1 (warm-up)" if h.warmup_skipped else "")]
    for i, row in enumerate(rows):
        lines.append("  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])])
                     .rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    for v in (b, h):
        for key, count in sorted(v.fallbacks.items()):
            tag = ""
            if v is h:
                tag = f" ({report.expected_fallbacks[key]})" if key in report.expected_fallbacks else " (UNEXPECTED)"
            lines.append(f"fallback [{v.name}] {key} x{count}{tag}: {v.fallback_reasons.get(key, '')}")
    verdict = "ok" if report.loss_agreement_ok else "NOT ok"
    lines.append(f"loss agreement: mean |loss difference| {report.loss_mean_abs_diff:.4f} = "
                 f"{report.loss_relative_diff:.2%} of the baseline's mean loss ({verdict}, threshold "
                 f"{LOSS_AGREEMENT_THRESHOLD:.0%}; padded and packed batches differ, so the curves are close, "
                 "not identical)")
    lines += [f"note: {note}" for note in report.notes]
    return "\n".join(lines)


def write_plot(report: BenchReport, path: str | Path) -> Path:
    """Loss per step (left) and tokens/s per step (right) for both variants, as a PNG.
    Raises ImportError when matplotlib is not installed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg, without touching pyplot's global backend
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(11, 4), layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, speed_ax = fig.subplots(1, 2)
    for v, style in ((report.baseline, "o-"), (report.hasten, "s-")):
        loss_ax.plot(v.curve_steps, v.curve_loss, style, label=v.name, markersize=3)
        speed_ax.plot(v.curve_steps, v.curve_tokens_per_s, style, label=v.name, markersize=3)
    loss_ax.set(title="loss per step", xlabel="step", ylabel="loss")
    speed_ax.set(title="tokens/s per step", xlabel="step", ylabel="tokens/s")
    for ax in (loss_ax, speed_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"hasten bench: {report.hasten.device}, {report.steps} steps")
    fig.savefig(path, dpi=100)
    return path

"""`hasten doctor`: checks this machine against the deployment guide before a run.

GPU, driver and CUDA runtime, versions against hasten.compat's table, the op library, and
access to the data, output and log folders a run will use. Exit code 1 means a blocker.

torch and the op library are imported by the checks that read them, not with this module: the
`hasten` command builds its parser from it (`hasten --version` loads neither), and a missing or
broken hasten._C is a blocker to report, not an import error.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import platform
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from hasten import compat
from hasten.compat import Finding

NO_GPU = "no CUDA GPU: hasten runs its CPU reference paths, correct but slow"
REBUILD_WITH_CUDA = "rebuild with a CUDA torch and nvcc: pip install --no-build-isolation -e ."
TORCH_INSTALL_URL = "https://pytorch.org/get-started/locally/"
PROBE_PREFIX = ".hasten-doctor-probe"
STATUS_WIDTH = len("blocker")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "doctor",
        help="check GPU, driver, CUDA, versions, op library and folder access",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="PATH",
        help="data file or folder that must be readable (repeatable)",
    )
    parser.add_argument(
        "--output_dir", action="append", default=[], metavar="PATH", help="folder that must be writable (repeatable)"
    )
    parser.add_argument(
        "--log_dir", action="append", default=[], metavar="PATH", help="folder that must be writable (repeatable)"
    )
    parser.add_argument(
        "--model", default=None, metavar="PATH_OR_TYPE",
        help="a local Hugging Face model folder (its config.json) or a model type such as qwen3: what hasten would "
             "run for each of its pieces (built on the meta device: no weights are read)",
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    findings = collect_findings(data=args.data, output_dirs=args.output_dir, log_dirs=args.log_dir)
    if args.model:
        findings += model_findings(args.model)
    counts = summarize(findings)
    if args.json:
        print(json.dumps({"findings": [asdict(finding) for finding in findings], "summary": counts}, indent=2))
    else:
        print(format_table(findings, counts))
    return 1 if counts["blockers"] else 0


def collect_findings(data: list[str], output_dirs: list[str], log_dirs: list[str]) -> list[Finding]:
    gpu_rows, gpu_count = gpu_findings()
    return [
        *system_findings(),
        *compat.check_versions(cuda_available=gpu_count > 0),
        *gpu_rows,
        *op_library_findings(gpu_present=gpu_count > 0),
        linear_attention_finding(gpu_count),
        *offload_findings(gpu_count),
        *(readable_path_finding(path) for path in data),
        *(writable_dir_finding("output_dir", path) for path in output_dirs),
        *(writable_dir_finding("log_dir", path) for path in log_dirs),
    ]


MODEL_FIX = "pass a local Hugging Face model folder holding config.json, or a model type such as qwen3"


def model_findings(model: str) -> list[Finding]:
    """Per piece of the model, what accelerate() would run (hasten.integrations.support)."""
    import torch
    from transformers import AutoConfig

    from hasten.integrations.support import auto_model_class, describe

    path = Path(model)
    try:
        if path.is_dir():
            config = AutoConfig.from_pretrained(path, local_files_only=True)
        else:
            config = AutoConfig.for_model(model)
    except (OSError, ValueError, KeyError) as exc:
        return [Finding("model", "blocker", f"{model}: neither a model folder nor a model type this transformers "
                        f"knows ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})", MODEL_FIX)]
    try:
        with torch.device("meta"):
            built = auto_model_class(config).from_config(config)
    except Exception as exc:  # noqa: BLE001 - any model class error is a finding, not a crash
        return [Finding("model", "warn", f"{model}: transformers could not build it as a causal LM "
                        f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})", MODEL_FIX)]
    findings = [Finding("model", "info", f"{model}: {type(built).__name__}")]
    findings += [Finding(f"model {piece.name}", piece.status, piece.detail) for piece in describe(built)]
    return findings


def summarize(findings: list[Finding]) -> dict[str, int]:
    counts = Counter(finding.status for finding in findings)
    return {"blockers": counts["blocker"], "warnings": counts["warn"], "info": counts["info"], "ok": counts["ok"]}


def format_table(findings: list[Finding], counts: dict[str, int]) -> str:
    name_width = max(len("check"), *(len(finding.name) for finding in findings))
    lines = [f"{'status':<{STATUS_WIDTH}}  {'check':<{name_width}}  detail"]
    for finding in findings:
        lines.append(f"{finding.status:<{STATUS_WIDTH}}  {finding.name:<{name_width}}  {finding.detail}")
        if finding.status != "ok" and finding.fix:
            lines.append(f"{'':<{STATUS_WIDTH}}  {'':<{name_width}}  fix: {finding.fix}")
    lines.append(f"doctor: {counts['blockers']} blockers, {counts['warnings']} warnings")
    return "\n".join(lines)


def system_findings() -> list[Finding]:
    cpus = os.cpu_count() or 0
    cpu_detail = str(cpus)
    if hasattr(os, "sched_getaffinity"):
        # Containers and job schedulers often pin fewer cores than the host has.
        usable = len(os.sched_getaffinity(0))
        if usable != cpus:
            cpu_detail += f" ({usable} usable by this process)"
    return [
        Finding("platform", "info", platform.platform()),
        Finding("interpreter", "info", sys.executable),
        Finding("cpus", "info", cpu_detail),
        Finding("host memory", "info", _host_memory()),
    ]


def _host_memory() -> str:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        return "unknown"
    return _format_bytes(total)


def _format_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def gpu_findings() -> tuple[list[Finding], int]:
    """The GPU rows and the number of usable CUDA GPUs."""
    import torch

    driver = nvidia_driver_version()
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return [Finding("gpu", "warn", NO_GPU, _no_gpu_fix(driver))], 0
    try:
        rows = [Finding("gpu count", "ok", str(count))]
        for index in range(count):
            props = torch.cuda.get_device_properties(index)
            rows.append(
                compat.check_compute_capability(index, props.name, (props.major, props.minor), props.total_memory)
            )
    except RuntimeError as exc:  # a GPU is listed but CUDA cannot talk to it
        return [Finding("gpu", "blocker", f"CUDA error: {exc}", "check the GPU and driver with nvidia-smi")], count
    rows.append(driver_finding(driver))
    return rows, count


def _no_gpu_fix(driver: str | None) -> str:
    import torch

    if driver is None:
        return "for speed, run on a machine with an NVIDIA GPU (compute capability >= 8.0)"
    if torch.version.cuda is None:
        return (
            f"NVIDIA driver {driver} is installed but torch is a CPU-only build: "
            f"install a CUDA build ({TORCH_INSTALL_URL})"
        )
    return (
        f"NVIDIA driver {driver} is installed but torch sees no GPU: check CUDA_VISIBLE_DEVICES "
        f"and that the driver supports CUDA {torch.version.cuda}"
    )


def nvidia_driver_version() -> str | None:
    """The driver version nvidia-smi reports, or None when it is absent or fails."""
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return None
    try:
        result = subprocess.run(
            [executable, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    versions = sorted({line.strip() for line in result.stdout.splitlines() if line.strip()})
    return ", ".join(versions) or None


def driver_finding(driver: str | None) -> Finding:
    if driver is None:
        return Finding("driver", "info", "unknown (nvidia-smi not found or failed)")
    return Finding("driver", "ok", driver)


def offload_findings(gpu_count: int) -> list[Finding]:
    """What double-buffered activation offload and stream overlap need: copy engines (one per
    direction), pinned host memory, and the pinned link's bandwidth, measured."""
    from hasten.ops import is_loaded

    if gpu_count == 0 or not is_loaded():
        return []
    import torch

    from hasten.memory.offload import OffloadEngine, available_host_bytes, measure_link_bandwidth

    findings = []
    engines = OffloadEngine(0).copy_engine_count(torch.cuda.current_device())
    if engines >= 2:
        findings.append(Finding("copy engines", "ok", f"{engines}: host<->device copies each way overlap each "
                                "other and compute (double-buffered offload, next-batch copies)"))
    elif engines == 1:
        findings.append(Finding("copy engines", "warn", "1: offload and prefetch copies take turns",
                                "double buffering hides less here; prefer offload: auto, which plans for it"))
    else:
        findings.append(Finding("copy engines", "info", "unknown in this build"))
    available = available_host_bytes()
    findings.append(Finding("pinned host memory", "info", "up to " + (_format_bytes(available * 0.8) if available
                                                                       else "unknown") + " for offload (80% of "
                            "available now)"))
    try:
        link = measure_link_bandwidth(torch.device("cuda", torch.cuda.current_device()), nbytes=128 << 20)
    except RuntimeError as exc:  # pinning failed (container memlock limits) or CUDA error
        return findings + [Finding("host link", "warn", f"could not measure pinned copies: {exc}",
                                   "activation offload needs page-locked host memory; check the container's "
                                   "memlock limit (ulimit -l)")]
    slowest = min(link.values())
    detail = f"pinned copies d2h {link['d2h_gbps']:.1f} GB/s, h2d {link['h2d_gbps']:.1f} GB/s"
    if slowest < 10:
        findings.append(Finding("host link", "warn", detail, "slower than a PCIe 4 x16 link: offload hides little; "
                                "check the slot, NUMA placement (numactl) and that memory is pinned"))
    else:
        findings.append(Finding("host link", "ok", detail))
    return findings


def op_library_findings(gpu_present: bool) -> list[Finding]:
    from hasten.ops import extension_error, has_cuda_kernel, is_loaded, op_names

    if not is_loaded():
        return [Finding("hasten._C", "blocker", "not loaded", extension_error() or REBUILD_WITH_CUDA)]
    from hasten.attention.varlen import BUILD_CUDNN_OP

    findings = [Finding("hasten._C", "ok", "loaded")]
    for op in op_names():
        name = f"op {op}"
        if has_cuda_kernel(op):
            findings.append(Finding(name, "ok", "CUDA kernel built"))
        elif gpu_present and op.startswith("varlen_attention"):  # FlashAttention-2 stands in, slower
            findings.append(Finding(name, "warn", "not built (the cudnn-frontend headers were missing at install); "
                                    "packed attention runs FlashAttention-2, slower", BUILD_CUDNN_OP))
        elif gpu_present:
            findings.append(Finding(name, "blocker", "no CUDA kernel in this build", REBUILD_WITH_CUDA))
        else:
            findings.append(Finding(name, "info", "no CUDA kernel (none needed without a GPU)"))
    findings.append(grouped_gemm_finding(gpu_present))
    return findings


def grouped_gemm_finding(gpu_present: bool) -> Finding:
    """Whether the MoE experts' CUTLASS grouped GEMM kernels (sm90) are in this build."""
    import hasten._C

    if getattr(hasten._C, "WITH_CUTLASS", 0):
        return Finding("MoE grouped GEMM", "ok", "hasten's CUTLASS sm90 kernels built (torch's kernel where they "
                       "measured slower, and on other GPUs)")
    import torch

    detail = "torch's grouped GEMM only (CUTLASS's headers were missing at install, or 9.0 was not a target)"
    hopper = gpu_present and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    if not hopper:  # the kernels are sm90 code: nothing is lost elsewhere
        return Finding("MoE grouped GEMM", "info", detail + "; hasten's kernels are for sm90 GPUs")
    return Finding("MoE grouped GEMM", "warn", detail + "; MoE experts run torch's kernel throughout, slower",
                   "pip install nvidia-cutlass (or set HASTEN_CUTLASS_DIR), then reinstall hasten")


def linear_attention_finding(gpu_count: int) -> Finding:
    """Whether packed batches of hybrid models (Qwen3-Next, Qwen3.5, OLMo hybrid, LFM2) can run on
    this machine's GPU: flash-linear-attention's varlen kernels (hasten.stateful)."""
    from hasten.stateful import fla_problem

    name = "linear attention (fla)"
    if gpu_count == 0:
        return Finding(name, "info", "packed hybrid models run their layers once per sample without a GPU")
    problem = fla_problem(0)
    if problem is not None:
        return Finding(name, "warn", "packed batches of hybrid models (linear attention, short convolutions) are "
                       "refused on this GPU", problem)
    import fla

    return Finding(name, "ok", f"flash-linear-attention {getattr(fla, '__version__', '?')}: varlen kernels for packed "
                   "hybrid models")


def _os_error_text(exc: OSError) -> str:
    code = errno.errorcode.get(exc.errno or 0, "")
    return f"{exc.strerror or exc} [{code}]" if code else str(exc.strerror or exc)


def readable_path_finding(path: str) -> Finding:
    target = Path(path)
    fix = "pass an existing file or folder this user can read"
    try:
        if target.is_dir():
            count = len(os.listdir(target))
            return Finding("data", "ok", f"{path}: readable folder, {count} {'entry' if count == 1 else 'entries'}")
        with target.open("rb") as handle:
            handle.read(1)
        return Finding("data", "ok", f"{path}: readable file, {_format_bytes(target.stat().st_size)}")
    except OSError as exc:
        return Finding("data", "blocker", f"{path}: cannot read: {_os_error_text(exc)}", fix)


def writable_dir_finding(kind: str, path: str) -> Finding:
    """Creates the folder if missing, then writes and deletes a probe file in it."""
    target = Path(path)
    fix = f"pass a --{kind} this user can create and write to"
    if target.exists() and not target.is_dir():
        return Finding(kind, "blocker", f"{path}: exists and is not a folder", fix)
    existed = target.is_dir()
    probe = target / f"{PROBE_PREFIX}-{os.getpid()}"
    try:
        target.mkdir(parents=True, exist_ok=True)
        # A real write catches read-only mounts and ACLs that os.access does not see.
        try:
            probe.write_bytes(b"probe")
        finally:
            probe.unlink(missing_ok=True)
    except OSError as exc:
        return Finding(kind, "blocker", f"{path}: not writable: {_os_error_text(exc)}", fix)
    return Finding(kind, "ok", f"{path}: writable" + ("" if existed else " (created)"))

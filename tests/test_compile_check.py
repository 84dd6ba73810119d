"""scripts/compile_check.sh without nvcc: `make test` skips it with a NOTICE, CI requires it.

Cheap: nvcc is hidden (PATH without any folder that holds one, CUDA_HOME an empty folder, which
also stops the /usr/local/cuda fallback), so the script stops before compiling anything.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "compile_check.sh"


def _run_without_nvcc(tmp_path, **env_extra):
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and not (Path(d) / "nvcc").exists())
    if shutil.which("dirname", path=path) is None:
        pytest.skip("coreutils share a folder with nvcc here; PATH cannot hide nvcc alone")
    bash = shutil.which("bash")
    assert bash, "bash is needed to run scripts/compile_check.sh"
    cuda_home = tmp_path / "no-cuda"
    cuda_home.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_HOME", "CUDA_PATH", "HASTEN_REQUIRE_COMPILE_CHECK")}
    env.update(PATH=path, CUDA_HOME=str(cuda_home), **env_extra)
    result = subprocess.run([bash, str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=60)
    return result, result.stdout + result.stderr


def test_without_nvcc_the_check_is_skipped_with_a_notice(tmp_path):
    result, out = _run_without_nvcc(tmp_path)
    assert result.returncode == 0, out
    notice = [line for line in out.splitlines() if line.startswith("NOTICE: compile-check SKIPPED")]
    assert len(notice) == 1, out
    assert "nvcc not found" in notice[0]
    assert "csrc/kernels/*.cu" in notice[0] and "NOT compile-checked" in notice[0]  # what was skipped
    assert "install the CUDA toolkit" in notice[0] and "make compile-check" in notice[0]  # how to get it
    assert "kernel file(s) compiled" not in out


@pytest.mark.parametrize("value", ["0", ""])
def test_zero_or_empty_does_not_require_it(tmp_path, value):
    result, out = _run_without_nvcc(tmp_path, HASTEN_REQUIRE_COMPILE_CHECK=value)
    assert result.returncode == 0, out
    assert "NOTICE: compile-check SKIPPED" in out


@pytest.mark.parametrize("value", ["1", "true"])
def test_required_without_nvcc_fails_loudly(tmp_path, value):
    result, out = _run_without_nvcc(tmp_path, HASTEN_REQUIRE_COMPILE_CHECK=value)
    assert result.returncode == 1, out
    assert "compile-check: FAILED: nvcc not found" in out
    assert "HASTEN_REQUIRE_COMPILE_CHECK=1" in out and "NOT compile-checked" in out
    assert "NOTICE" not in out


def test_an_unknown_value_is_an_error_not_a_silent_skip(tmp_path):
    result, out = _run_without_nvcc(tmp_path, HASTEN_REQUIRE_COMPILE_CHECK="required")
    assert result.returncode == 2, out
    assert "must be 1 or 0" in out


def test_ci_requires_the_check_and_make_test_runs_it():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    lines = [line.strip() for line in ci.splitlines() if line.strip() and not line.strip().startswith("#")]
    required = lines.index("export HASTEN_REQUIRE_COMPILE_CHECK=1")
    assert required < lines.index("make test"), "CI must require the compile check before make test runs it"
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    test_recipe = re.search(r"^test:.*?\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert "compile-check" in test_recipe
    assert "scripts/compile_check.sh" in re.search(r"^compile-check:.*?\n((?:\t.*\n)+)", makefile, re.M).group(1)


def test_a_kernel_nvcc_rejects_fails_the_check_naming_it(tmp_path):
    """The kernels compile in parallel (one nvcc per file and arch): a failure must still fail the
    check, name the file and arch, and print nvcc's messages. A stand-in nvcc rejects one file."""
    bash = shutil.which("bash")
    assert bash, "bash is needed to run scripts/compile_check.sh"
    rejected = sorted((ROOT / "csrc" / "kernels").glob("*.cu"))[0].name
    cuda_home = tmp_path / "cuda"
    (cuda_home / "bin").mkdir(parents=True)
    nvcc = cuda_home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n"
                    f'for a in "$@"; do case "$a" in *{rejected}) echo "$a: error: rejected by the test" >&2; '
                    "exit 1;; esac; done\nexit 0\n")
    nvcc.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_PATH",)}
    env.update(CUDA_HOME=str(cuda_home), HASTEN_REQUIRE_COMPILE_CHECK="1")
    result = subprocess.run([bash, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert f"csrc/kernels/{rejected}: error: rejected by the test" in out  # nvcc's message
    failed = [line for line in out.splitlines() if line.startswith("compile-check: FAILED: nvcc could not compile")]
    assert len(failed) == 1 and f"{rejected} (sm_80)" in failed[0] and f"{rejected} (sm_90)" in failed[0], out
    assert "kernel file(s) compiled" not in out

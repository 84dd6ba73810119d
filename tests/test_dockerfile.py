"""docker/Dockerfile installs hasten with the same steps as README and CI (`make install`).

Static checks only: there is no container engine in CI, and the image is not built there.
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, current = [], ""
    for line in text.splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        word, _, rest = current.strip().partition(" ")
        out.append((word.upper(), " ".join(rest.split())))
        current = ""
    return out


@pytest.fixture(scope="module")
def steps() -> list[tuple[str, str]]:
    return _instructions(DOCKERFILE.read_text(encoding="utf-8"))


def _args(steps, name: str) -> list[str]:
    return [args for word, args in steps if word == name]


def test_installs_with_make_install_like_readme_and_ci(steps):
    runs = _args(steps, "RUN")
    assert any(re.search(r"\bmake install\b", run) for run in runs), "the image must run `make install`"
    # The build itself stays in the Makefile, not repeated here where it could drift.
    assert not any("--no-build-isolation" in run for run in runs)
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for step in ("pip install -r requirements.txt", "pip install --no-build-isolation --no-deps -e ."):
        assert step in makefile and step in readme, step
    # torch comes from the CUDA index before make runs, so make's "torch if missing" keeps it.
    torch_run = next(i for i, run in enumerate(runs) if "TORCH_INDEX_URL" in run and "TORCH_SPEC" in run)
    make_run = next(i for i, run in enumerate(runs) if re.search(r"\bmake install\b", run))
    assert torch_run < make_run


def test_runs_as_non_root_user(steps):
    users = _args(steps, "USER")
    assert users, "no USER instruction: the image would run as root"
    assert users[-1].split(":")[0] not in ("root", "0")
    assert any("useradd" in run and users[-1].split(":")[0] in run for run in _args(steps, "RUN"))
    # The install runs as that user, after the switch.
    words = [word for word, _ in steps]
    assert words.index("USER") < max(i for i, (w, a) in enumerate(steps) if w == "RUN" and "make install" in a)


def test_healthcheck_runs_doctor(steps):
    checks = _args(steps, "HEALTHCHECK")
    assert len(checks) == 1
    command = checks[0].split("CMD", 1)[1].strip()
    assert json.loads(command) == ["hasten", "doctor", "--json"]


def test_cuda_arch_list_and_base_are_build_args(steps):
    assert any(a.startswith("TORCH_CUDA_ARCH_LIST=") and "8.0;9.0" in a for a in _args(steps, "ARG"))
    assert any("TORCH_CUDA_ARCH_LIST=" in a for a in _args(steps, "ENV")), "setup.py reads it from the environment"
    assert any(a.startswith("BASE_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu24.04") for a in _args(steps, "ARG"))
    assert _args(steps, "FROM") == ["${BASE_IMAGE}"]
    assert any(a.startswith('TORCH_SPEC="torch==2.11.0"') for a in _args(steps, "ARG"))


def test_entrypoint_is_the_cli(steps):
    assert json.loads(_args(steps, "ENTRYPOINT")[-1]) == ["hasten"]
    assert json.loads(_args(steps, "CMD")[-1]) == ["doctor"]

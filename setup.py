"""Builds hasten._C against the torch that is already installed.

CUDA kernels are compiled when torch is a CUDA build and nvcc is found (default
architectures 8.0 and 9.0; set TORCH_CUDA_ARCH_LIST to change them); otherwise the
CPU implementations alone are built and this script says so. HASTEN_CPU_ONLY=1
forces the CPU-only build.
"""

import glob
import os

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError as exc:  # pragma: no cover - build-time guidance
    raise SystemExit(
        "hasten builds its C++/CUDA ops against an installed torch, and none was found.\n"
        "Install torch first (pip install 'torch>=2.10'), then install hasten with\n"
        "pip install --no-build-isolation ."
    ) from exc

ROOT = os.path.dirname(os.path.abspath(__file__))


def _sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))


def _want_cuda() -> tuple[bool, str]:
    if os.environ.get("HASTEN_CPU_ONLY") == "1":
        return False, "HASTEN_CPU_ONLY=1 is set"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is a CPU-only build"
    if CUDA_HOME is None:
        return False, "nvcc was not found (set CUDA_HOME)"
    return True, ""


def _extension():
    # every build: schemas, CPU ops, and the host-side offload code (pinned memory on CUDA builds)
    cpu_sources = (["csrc/registration.cpp"] + _sources("csrc/*/*_cpu.cpp") + _sources("csrc/*/*_composite.cpp")
                   + _sources("csrc/offload/*.cpp"))
    include_dirs = [os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "csrc")]
    cxx_flags = ["-O3", "-std=c++17"]
    with_cuda, why_not = _want_cuda()
    if not with_cuda:
        print(f"hasten: building the CPU ops only ({why_not}); CUDA kernels are not compiled.")
        return CppExtension("hasten._C", cpu_sources, include_dirs=include_dirs,
                            extra_compile_args={"cxx": cxx_flags})
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    print(f"hasten: building CPU and CUDA ops for TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}")
    # Torch-facing glue (*_cuda.cpp) is host C++ for the host compiler; nvcc compiles only the
    # torch-free kernels. Host code that nvcc compiled emitted its own copies of libstdc++
    # templates (ostream << long) that crashed every error message with a number in it.
    cuda_sources = _sources("csrc/*/*_cuda.cpp") + _sources("csrc/kernels/*.cu")
    return CUDAExtension(
        "hasten._C",
        cpu_sources + cuda_sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags + ["-DHASTEN_WITH_CUDA"],
                            "nvcc": ["-O3", "-std=c++17", "-lineinfo", "-DHASTEN_WITH_CUDA"]},
    )


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)

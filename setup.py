"""Builds hasten._C against the torch that is already installed.

CUDA kernels are compiled when torch is a CUDA build and nvcc is found (default
architectures 8.0 and 9.0; set TORCH_CUDA_ARCH_LIST to change them); otherwise the
CPU implementations alone are built and this script says so. HASTEN_CPU_ONLY=1
forces the CPU-only build. With CUTLASS's headers (HASTEN_CUTLASS_DIR, or the nvidia-cutlass
pip package) and 9.0 among the architectures, the MoE experts' grouped GEMM kernels are built
too, for 9.0a (the arch-specific Hopper target their WGMMA/TMA code needs).
"""

import glob
import os
import shlex
import subprocess
import sys

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


def _package_dir(module: str) -> str | None:
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return locations[0] if locations else None


def _shared_libstdcxx() -> list[str]:
    """Link arguments that make the extensions use the process's shared libstdc++.

    A compiler whose private library folder holds only libstdc++.a (the H200 image's
    /opt/gcc/bin/g++ wrapper: `-B/opt/gcc/lib/gcc/...`) links libstdc++ statically into each
    extension. Python's LDSHARED adds -Bsymbolic-functions, so that copy's functions bind inside
    the extension while its data (locale facet ids, the classic locale) bind to the libstdc++.so.6
    torch already loaded: the first `ostream << long` (cudnn-frontend's engine tags, error messages
    with numbers) crashed. Naming the shared library first on the link line satisfies every
    libstdc++ symbol from it, so nothing is pulled from the archive.
    """
    if not sys.platform.startswith("linux"):
        return []
    compiler = shlex.split(os.environ.get("CXX", "c++"))
    try:
        found = subprocess.run(compiler + ["-print-file-name=libstdc++.so.6"], capture_output=True, text=True,
                               timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return []
    return [os.path.realpath(found)] if os.path.isabs(found) and os.path.exists(found) else []


def _cudnn_attention() -> tuple[dict, str]:
    """Compiler settings for the cuDNN attention op, or why it is not built.

    Built by default on CUDA builds. Needs the cudnn-frontend headers (pip package
    nvidia-cudnn-frontend, which `make install` adds for a CUDA torch, or
    HASTEN_CUDNN_FRONTEND_INCLUDE) and the cuDNN that torch loads (nvidia-cudnn-cu*): the op links
    against that very libcudnn.so.9, so there is no second copy. HASTEN_CUDNN_ATTENTION=0 skips it.
    """
    from importlib import metadata

    if os.environ.get("HASTEN_CUDNN_ATTENTION") == "0":
        return {}, "HASTEN_CUDNN_ATTENTION=0 is set"
    frontend = os.environ.get("HASTEN_CUDNN_FRONTEND_INCLUDE")
    if frontend is None:
        try:
            located = metadata.distribution("nvidia-cudnn-frontend").locate_file("include")
            frontend = str(located) if os.path.exists(os.path.join(str(located), "cudnn_frontend.h")) else None
        except metadata.PackageNotFoundError:
            frontend = None
    if frontend is None or not os.path.exists(os.path.join(frontend, "cudnn_frontend.h")):
        return {}, "the cudnn-frontend headers were not found (pip install nvidia-cudnn-frontend, then reinstall)"
    cudnn = _package_dir("nvidia.cudnn")
    if cudnn is None or not glob.glob(os.path.join(cudnn, "lib", "libcudnn.so.*")):
        return {}, "torch's cuDNN (the nvidia-cudnn pip package) was not found"
    include_dirs = [frontend, os.path.join(cudnn, "include")]
    nvidia = os.path.dirname(cudnn)
    # nvrtc.h and libnvrtc: the frontend's runtime-compiled engines
    include_dirs += [d for d in glob.glob(os.path.join(nvidia, "*", "include")) if os.path.exists(os.path.join(d, "nvrtc.h"))]
    nvrtc = sorted(glob.glob(os.path.join(nvidia, "*", "lib", "libnvrtc.so.*[0-9]")))
    if CUDA_HOME is not None:
        nvrtc += sorted(glob.glob(os.path.join(CUDA_HOME, "lib64", "libnvrtc.so.*[0-9]")))
    nvrtc = [n for n in nvrtc if "builtins" not in n and "alt" not in os.path.basename(n)]
    if not nvrtc:
        return {}, "libnvrtc (the nvidia-cuda-nvrtc pip package or the CUDA toolkit) was not found"
    libcudnn = sorted(glob.glob(os.path.join(cudnn, "lib", "libcudnn.so.*")))[0]
    link = [libcudnn, nvrtc[0]] + [f"-Wl,-rpath,{os.path.dirname(x)}" for x in (libcudnn, nvrtc[0])]
    return {"include_dirs": include_dirs, "extra_link_args": link}, ""


def _cutlass_include() -> tuple[str | None, str]:
    """CUTLASS's include folder (holding cutlass/ and cute/), or why it is not there.

    HASTEN_CUTLASS_DIR names a CUTLASS checkout (its include/) or an include folder itself;
    otherwise the nvidia-cutlass pip package's copy (cutlass_library/source/include) is used.
    HASTEN_CUTLASS=0 skips the grouped GEMM kernels (torch's own grouped GEMM then runs them all).
    """
    if os.environ.get("HASTEN_CUTLASS") == "0":
        return None, "HASTEN_CUTLASS=0 is set"
    candidates = []
    if os.environ.get("HASTEN_CUTLASS_DIR"):
        root = os.environ["HASTEN_CUTLASS_DIR"]
        candidates = [os.path.join(root, "include"), root]
    else:
        library = _package_dir("cutlass_library")
        if library is not None:
            candidates = [os.path.join(library, "source", "include")]
    for include in candidates:
        if os.path.exists(os.path.join(include, "cutlass", "cutlass.h")) and os.path.isdir(os.path.join(include, "cute")):
            return include, ""
    if os.environ.get("HASTEN_CUTLASS_DIR"):
        return None, f"HASTEN_CUTLASS_DIR={os.environ['HASTEN_CUTLASS_DIR']} holds no cutlass/cutlass.h and cute/"
    return None, "CUTLASS's headers were not found (pip install nvidia-cutlass, or set HASTEN_CUTLASS_DIR)"


def _extensions() -> list:
    # every build: schemas, CPU ops, and the host-side offload code (pinned memory on CUDA builds)
    cpu_sources = (["csrc/registration.cpp"] + _sources("csrc/*/*_cpu.cpp") + _sources("csrc/*/*_composite.cpp")
                   + _sources("csrc/offload/*.cpp"))
    include_dirs = [os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "csrc")]
    cxx_flags = ["-O3", "-std=c++17"]
    libstdcxx = _shared_libstdcxx()
    with_cuda, why_not = _want_cuda()
    if not with_cuda:
        print(f"hasten: building the CPU ops only ({why_not}); CUDA kernels are not compiled.")
        return [CppExtension("hasten._C", cpu_sources, include_dirs=include_dirs,
                             extra_compile_args={"cxx": cxx_flags}, extra_link_args=libstdcxx)]
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    # the experts' grouped GEMMs on CUTLASS: sm90a code, so 9.0 becomes 9.0a (the other kernels
    # lose nothing: 9.0a runs wherever 9.0 SASS does, on Hopper)
    cutlass, why_no_cutlass = _cutlass_include()
    archs = os.environ["TORCH_CUDA_ARCH_LIST"].replace(" ", ";").split(";")
    if cutlass is not None and not any(a.split("+")[0] in ("9.0", "9.0a") for a in archs):
        cutlass, why_no_cutlass = None, "9.0 is not in TORCH_CUDA_ARCH_LIST"
    if cutlass is not None:
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join("9.0a" + a[3:] if a.startswith("9.0") and not a.startswith("9.0a")
                                                      else a for a in archs if a)
    print(f"hasten: building CPU and CUDA ops for TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}")
    # Torch-facing glue (*_cuda.cpp) is host C++ for the host compiler; nvcc compiles only the
    # torch-free kernels. Host code that nvcc compiled emitted its own copies of libstdc++
    # templates (ostream << long) that crashed every error message with a number in it.
    cuda_sources = _sources("csrc/*/*_cuda.cpp") + _sources("csrc/kernels/*.cu")
    defines = ["-DHASTEN_WITH_CUDA"]
    if cutlass is not None:
        cuda_sources += _sources("csrc/kernels/grouped_gemm_sm90/*.cu")
        include_dirs = include_dirs + [cutlass]
        defines.append("-DHASTEN_WITH_CUTLASS")
        print(f"hasten: building the CUTLASS grouped GEMM kernels ({cutlass})")
    else:
        print(f"hasten: NOT building the CUTLASS grouped GEMM kernels: {why_no_cutlass}. MoE experts use "
              "torch's grouped GEMM.")
    # attention on CUDA is cuDNN's fused SDPA: built only with the cudnn-frontend headers
    cudnn, why_no_cudnn = _cudnn_attention()
    extensions = []
    if cudnn:
        # its own shared object, opened by _C.so at first use (csrc/attention/cudnn_sdpa.h says why)
        extensions.append(CUDAExtension("hasten._cudnn_sdpa", ["csrc/attention/cudnn_sdpa.cpp"],
                                        include_dirs=include_dirs + cudnn["include_dirs"],
                                        extra_compile_args={"cxx": cxx_flags},
                                        extra_link_args=libstdcxx + cudnn["extra_link_args"]))
        print("hasten: building the cuDNN attention op")
    else:
        cuda_sources.remove("csrc/attention/varlen_attention_cuda.cpp")
        print(f"hasten: NOT building the cuDNN attention op: {why_no_cudnn}. Packed attention will use "
              "flash-attn or torch's varlen kernel (hasten reports it at run time).")
    return [CUDAExtension(
        "hasten._C",
        cpu_sources + cuda_sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags + defines, "nvcc": ["-O3", "-std=c++17", "-lineinfo"] + defines},
        extra_link_args=libstdcxx + ["-ldl"],
    )] + extensions


setup(
    ext_modules=_extensions(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)

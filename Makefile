# Two commands do all the set-up on a fresh machine:
#   make train   install, then train the embedded default (GPU if present, else CPU)
#   make test    install, then CPU tests, C++ op tests and the CUDA compile check (skipped with a
#                NOTICE where there is no nvcc; HASTEN_REQUIRE_COMPILE_CHECK=1, as in CI, makes that an error)
PYTHON ?= python3
# torch is installed only when missing; the extension builds against whatever torch is there.
TORCH_SPEC ?= torch==2.13.0
# header-only C++ API of cuDNN for hasten's attention op (tested: 1.32.0 with cuDNN 9.19, H200)
CUDNN_FRONTEND_SPEC ?= nvidia-cudnn-frontend==1.32.0
# CUTLASS's headers for the MoE experts' grouped GEMM kernels (the package's Python side is not used)
CUTLASS_SPEC ?= nvidia-cutlass==4.2.0.0
TRAIN_ARGS ?=
STAMP := build/.installed

.PHONY: install train test compile-check gpu-test clean

install: $(STAMP)

$(STAMP): setup.py pyproject.toml requirements.txt $(wildcard csrc/*.cpp csrc/*/*.cpp csrc/*/*.cu csrc/*/*.cuh csrc/*/*.h csrc/kernels/*/*.cu csrc/kernels/*/*.h csrc/include/hasten/*.h)
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "$(TORCH_SPEC)"
	$(PYTHON) -m pip install -r requirements.txt
	@# a CUDA torch: the cudnn-frontend and CUTLASS headers, so the cuDNN attention op and the
	@# grouped GEMM kernels are built (setup.py)
	@if $(PYTHON) -c "import sys, torch; sys.exit(torch.version.cuda is None)" 2>/dev/null; then \
		$(PYTHON) -m pip install --no-deps "$(CUDNN_FRONTEND_SPEC)" "$(CUTLASS_SPEC)"; fi
	$(PYTHON) -m pip install --no-build-isolation --no-deps -e .
	@mkdir -p build && touch $(STAMP)

train: install
	$(PYTHON) -m hasten train --output_dir runs/default --log_dir runs/default/logs $(TRAIN_ARGS)

test: install
	@$(PYTHON) -m pip install -q -r requirements-test.txt || echo "NOTE: requirements-test.txt (TRL, datasets, bitsandbytes) could not be installed: the TRL example and QLoRA layer tests are skipped"
	$(PYTHON) -m pytest tests -q
	$(MAKE) --no-print-directory compile-check

# Every CUDA kernel (csrc/kernels, torch-free) compiled for the default archs, no GPU needed; needs nvcc
# (without it: a NOTICE and exit 0, or exit 1 under HASTEN_REQUIRE_COMPILE_CHECK=1).
compile-check:
	@bash scripts/compile_check.sh

# On the GPU machine: build for sm_90 and run the CUDA tests.
gpu-test: install
	$(PYTHON) -m pytest tests/gpu -q

clean:
	rm -rf build src/hasten/*.so src/*.egg-info

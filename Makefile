# jax_s2attn: set-up, demo, tests and benchmarks. `make demo` and `make test` are all a newcomer needs:
# each creates the virtual environment $(VENV) if missing, builds the native modules against the jax installed
# there (without build isolation) and runs. `make help` lists every target.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VENV ?= .venv
BIN := $(VENV)/bin
# What a change of triggers a rebuild of the native modules.
SOURCES := pyproject.toml requirements-build.txt $(shell find cuda jax_s2attn -type f \( -name '*.py' -o -name '*.h' \
             -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' -o -name CMakeLists.txt \) 2>/dev/null)

# The CUDA kernels: `make test` compiles them wherever nvcc exists (CI's compile check). `make demo`, `make
# test-fast` and `make bench` skip them unless asked (JAX_S2ATTN_CUDA=ON): the jax that requirements-build.txt
# installs runs on the CPU. JAX_S2ATTN_CUDA=ON|OFF overrides both.
HAS_NVCC := $(shell command -v nvcc >/dev/null 2>&1 && echo yes)
CUDA_TEST := $(or $(JAX_S2ATTN_CUDA),$(if $(HAS_NVCC),ON,OFF))
CUDA_RUN := $(or $(JAX_S2ATTN_CUDA),OFF)
# The torch-harmonics parity tests: its 0.9.3 CPU kernels load with torch 2.13; its metadata asks for
# torch >= 2.14, hence --no-deps.
TORCH := torch==2.13.0
TORCH_HARMONICS := torch-harmonics==0.9.3
# The CuTe/CUTLASS headers that experimental/mainloop_primitives.sh builds against (tests/test_experimental.py): only
# the headers are used, hence --no-deps (its metadata asks for cuda-python, scipy and graph tools).
CUTLASS_HEADERS := nvidia-cutlass==4.2.0.0
# cuobjdump and the nvdisasm it runs, which benchmarks/sass_loops.py reads kernels' SASS with
# (tests/test_benchmarks.py); nvcc alone lacks both.
CUOBJDUMP := nvidia-cuda-cuobjdump==13.5.37 nvidia-cuda-nvdisasm==13.5.37

PIP := $(BIN)/python -m pip
PIP_QUIET := --quiet --disable-pip-version-check

.PHONY: help demo test test-setup test-fast bench gpu-suite clean distclean

help:
	@echo "make demo       set up $(VENV) and train the example model (examples/train_sphere.py, ~2 min on a CPU)"
	@echo "make test       set up $(VENV) with the test extras and run the whole suite (pytest -q)"
	@echo "make test-fast  the fast tier: pytest -m 'not slow' (under 5 min on 2 cores)"
	@echo "make bench      benchmarks/attention.py, CSV in out/bench (BENCH_ARGS='--quick' by default)"
	@echo "make gpu-suite  on an sm_90 GPU machine, with the python3 on PATH (its jax[cuda]): build, GPU tests, sanitizers"
	@echo "make clean      remove build outputs; make distclean also removes $(VENV)"
	@echo "Variables: VENV=$(VENV), PYTHON=/path/to/python3.12, JAX_S2ATTN_CUDA=ON|OFF (now: test $(CUDA_TEST), run $(CUDA_RUN))"

# --- set-up ---------------------------------------------------------------------------------------------
$(BIN)/python:
	@python="$$(tools/python312.sh)"; \
	echo "jax_s2attn: creating $(VENV) with $$python"; \
	"$$python" -m venv "$(VENV)" || { rm -rf "$(VENV)"; exit 1; }

$(VENV)/.build-tools: requirements-build.txt | $(BIN)/python
	@echo "jax_s2attn: installing jax and the build tools (requirements-build.txt)"
	$(PIP) install $(PIP_QUIET) --upgrade pip
	$(PIP) install $(PIP_QUIET) -r requirements-build.txt
	@touch $@

# $(call install,EXTRAS,CUDA): builds and installs the package with those extras and JAX_S2ATTN_CUDA=CUDA, and
# fails if a module it was asked for does not import. A stamp per flavour and CUDA setting (demo, fast, test)
# records what is installed; an install stamps what it covers: the flavours with fewer extras, and with the
# CUDA kernels built, the same flavours without them.
define install
	@if [ "$(2)" = ON ]; then \
	  echo "jax_s2attn: building the native modules: C++ for the CPU and the CUDA kernels for sm_90a (several minutes on 2 cores)"; \
	else \
	  echo "jax_s2attn: building the native CPU module (C++, under a minute); the CUDA kernels are skipped (JAX_S2ATTN_CUDA=ON builds them, for a jax with CUDA)"; \
	fi
	@rm -f $(VENV)/.installed-*
	JAX_S2ATTN_CUDA=$(2) CMAKE_BUILD_PARALLEL_LEVEL=$${CMAKE_BUILD_PARALLEL_LEVEL:-$$(nproc)} \
	  $(PIP) install $(PIP_QUIET) --no-build-isolation ".[$(1)]"
	@cd / && $(abspath $(BIN))/python -c "import jax_s2attn as s; print('jax_s2attn native modules:', s.native_status().replace(chr(10), '; ')); \
	  missing = [p for p in ('cpu',) + (('cuda',) if '$(2)' == 'ON' else ()) if not s.native_backends()[p]]; \
	  assert not missing, f'the build did not produce the {missing} module(s)'"
endef

covered = $(foreach f,$(1),$(foreach c,$(sort OFF $(2)),$(VENV)/.installed-$(f)-$(c)))

$(VENV)/.installed-demo-$(CUDA_RUN): $(SOURCES) | $(VENV)/.build-tools
	$(call install,examples,$(CUDA_RUN))
	@touch $(call covered,demo,$(CUDA_RUN))

$(VENV)/.installed-fast-$(CUDA_RUN): $(SOURCES) | $(VENV)/.build-tools
	$(call install,test,$(CUDA_RUN))
	@touch $(call covered,fast demo,$(CUDA_RUN))

$(VENV)/.installed-test-$(CUDA_TEST): $(SOURCES) Makefile | $(VENV)/.build-tools
	$(call install,test,$(CUDA_TEST))
	@echo "jax_s2attn: installing $(TORCH) and $(TORCH_HARMONICS) for the parity tests"
	$(PIP) install $(PIP_QUIET) "$(TORCH)"
	$(PIP) install $(PIP_QUIET) --no-deps "$(TORCH_HARMONICS)"
	@echo "jax_s2attn: installing $(CUTLASS_HEADERS) (headers only) for the experimental programs' build test"
	$(PIP) install $(PIP_QUIET) --no-deps "$(CUTLASS_HEADERS)"
	@echo "jax_s2attn: installing $(CUOBJDUMP) for the SASS loop counts' test"
	$(PIP) install $(PIP_QUIET) --no-deps $(CUOBJDUMP)
	@touch $(call covered,test fast demo,$(CUDA_TEST))

# --- what runs ------------------------------------------------------------------------------------------
demo: $(VENV)/.installed-demo-$(CUDA_RUN)
	$(BIN)/python examples/train_sphere.py

test-setup: $(VENV)/.installed-test-$(CUDA_TEST)

test: test-setup
	$(BIN)/pytest -q

test-fast: $(VENV)/.installed-fast-$(CUDA_RUN)
	$(BIN)/pytest -q -m "not slow"

BENCH_ARGS ?= --quick
bench: $(VENV)/.installed-fast-$(CUDA_RUN)
	$(BIN)/python benchmarks/attention.py $(BENCH_ARGS) --out out/bench

gpu-suite:
	bash benchmarks/run_h200.sh tests sanitize

clean:
	rm -rf build out .pytest_cache *.egg-info train_sphere.png
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
	rm -f $(VENV)/.installed-*

distclean: clean
	rm -rf $(VENV)

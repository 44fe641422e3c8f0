# fastddp's two commands (see README.md):
#   make run    the main job: a 2-process torchrun training with fastddp, then torch DDP side by side
#   make test   Catch2 and pytest suites, with their summary lines, and PyTorch's own DDP
#               tests run against fastddp (tests/torch_ddp)
#   make test-torch-ddp-suite   PyTorch's DDP tests on stock torch and on fastddp, side by side
#   make gpu-check [OUT=dir] [DRY_RUN=1] [ARGS=...]
#               on a machine with one GPU: builds _C if needed, runs the GPU tests, NCCL at
#               world size 1 with every hook, compute-sanitizer and the benchmarks, and
#               writes one report (gpu_check.md/.json/.log) to OUT (benchmarks/ci/gpu_check.py)
# Both start with `make install`, which installs only what is missing and
# rebuilds fastddp._C only when a source changed.

PYTHON ?= python3
# The CUDA 13.0 build of torch, so that CI compiles every CUDA source; an
# existing torch (2.11-2.15) is kept as it is.
TORCH_SPEC ?= torch==2.14.1
MAX_JOBS ?= 2
SUDO := $(shell [ "$$(id -u)" = 0 ] || command -v sudo)
# ccache keeps compiled objects by content, so that the sdist check
# (tests/python/install/test_sdist.py) builds the same sources again in seconds: the compilers
# are ccache's (its masquerade folder first on PATH, nvcc through torch's PYTORCH_NVCC), paths
# under the checkout relative (CCACHE_BASEDIR), the build folder not hashed.
# tests/python/install/build_env.py sets the same.
NVCC_PATH := $(firstword $(wildcard $(CUDA_HOME)/bin/nvcc /usr/local/cuda/bin/nvcc) \
  $(shell command -v nvcc 2>/dev/null))
CCACHE_ENV := PATH=/usr/lib/ccache:$$PATH CCACHE_BASEDIR=$(CURDIR) CCACHE_NOHASHDIR=1 \
  $(if $(NVCC_PATH),PYTORCH_NVCC="ccache $(NVCC_PATH)")
BUILD_STAMP := build/.fastddp-built
SOURCES := $(shell find csrc -type f) setup.py pyproject.toml
STACKS_REQUIREMENTS := tests/stacks/requirements.txt

.PHONY: install deps deps-stacks deps-compat deps-compat-newest test-compat-newest test test-cpp test-python test-torch-ddp test-torch-ddp-suite \
  run bench gpu-check clean

install: deps $(BUILD_STAMP)

deps:
	@command -v cmake >/dev/null && command -v ninja >/dev/null && command -v ccache >/dev/null \
	  && [ -f /usr/include/catch2/catch.hpp ] \
	  || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq catch2 cmake ninja-build ccache; }
	@# one torch import (2 s) both checks and reports it
	@$(PYTHON) -c "import torch; print('[make] torch', torch.__version__, 'CUDA', torch.version.cuda)" \
	  2>/dev/null || { $(PYTHON) -m pip install -q "$(TORCH_SPEC)" && $(PYTHON) -c "import torch; \
	  print('[make] torch', torch.__version__, 'CUDA', torch.version.cuda)"; }
	@# -I: not the checkout's build/ folder as the `build` package
	@$(PYTHON) -I -c "import setuptools as s, wheel, pytest, xdist, build.__main__, sys; \
	  sys.exit(int(s.__version__.split('.')[0]) < 77)" 2>/dev/null \
	  || $(PYTHON) -m pip install -q "setuptools>=77" wheel pytest pytest-xdist build
	@$(PYTHON) -c "import matplotlib" 2>/dev/null || $(PYTHON) -m pip install -q matplotlib
	@# torch's own test modules (tests/torch_ddp) import these; the torch wheel does not
	@$(PYTHON) -c "import expecttest, numpy" 2>/dev/null \
	  || $(PYTHON) -m pip install -q expecttest numpy

# Lightning, Accelerate and transformers at the pinned versions, for
# tests/python/launch/test_stacks.py; only when one is missing or at another version. The
# installed torch is a constraint, so pip fails rather than replace it.
deps-stacks:
	@$(PYTHON) -c "import sys, importlib.metadata as md; \
	  pins = [l.strip().split('==') for l in open('$(STACKS_REQUIREMENTS)') if '==' in l and l[0] != '#']; \
	  sys.exit(any(md.version(n) != v for n, v in pins))" 2>/dev/null \
	  || { mkdir -p build \
	       && $(PYTHON) -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > build/torch-constraint.txt \
	       && $(PYTHON) -m pip install -q -r $(STACKS_REQUIREMENTS) -c build/torch-constraint.txt; }
	@$(PYTHON) -c "import torch; print('[make] stacks installed; torch still', torch.__version__)"

# When only csrc/ changed since the last build and fastddp is installed editable from this
# checkout for this torch, the extension is rebuilt in place (setup.py build_ext --inplace,
# ~3 s on top of the compiler) instead of by pip (~16 s: two setup.py runs, a wheel, an
# install); any other case, and every first build, goes through pip.
EDITABLE_STAMP := build/.fastddp-editable
TORCH_AND_HERE = $(PYTHON) -c "import importlib.metadata as md; print(md.version('torch'), '$(CURDIR)')"
EDITABLE_HERE = [ -f $(EDITABLE_STAMP) ] && [ "$$(cat $(EDITABLE_STAMP))" = "$$($(TORCH_AND_HERE))" ] \
  && $(PYTHON) -c "import importlib.metadata as md, json, sys; \
     u = json.loads(md.distribution('fastddp').read_text('direct_url.json') or '{}'); \
     sys.exit(not (u.get('dir_info', {}).get('editable') and u.get('url') == 'file://$(CURDIR)'))" \
     2>/dev/null
# fastddp installed from another checkout (or removed) since the last build here: the stamp
# alone would call it up to date, so the build runs again (through pip, as $? names FORCE).
ifneq ($(shell $(EDITABLE_HERE) && echo here),here)
$(BUILD_STAMP): FORCE
endif
.PHONY: FORCE
FORCE:
# deps order-only: under make -j the build must not start while deps's pip installs setuptools.
$(BUILD_STAMP): $(SOURCES) | deps
	@mkdir -p build
	@if [ -f $@ ] && [ -z "$(filter-out csrc/%,$?)" ] && $(EDITABLE_HERE); then \
	  echo "[make] csrc changed: rebuilding fastddp._C in place"; \
	  $(CCACHE_ENV) MAX_JOBS=$(MAX_JOBS) $(PYTHON) setup.py -q build_ext --inplace \
	    > build/pip-install.log 2>&1 || { tail -n 80 build/pip-install.log; exit 1; }; \
	else \
	  echo "[make] building fastddp._C: pip install --no-build-isolation -v -e . (through ccache)"; \
	  rm -f $(EDITABLE_STAMP); \
	  $(CCACHE_ENV) MAX_JOBS=$(MAX_JOBS) $(PYTHON) -m pip install --no-build-isolation -v -e . \
	    > build/pip-install.log 2>&1 || { tail -n 80 build/pip-install.log; exit 1; }; \
	  $(TORCH_AND_HERE) > $(EDITABLE_STAMP); \
	fi
	@grep -E '\[fastddp setup\]' build/pip-install.log | grep -v '\] units:' || true
	@$(PYTHON) -c "import fastddp; print('[make] fastddp build:', fastddp.build_info())"
	@touch $@

# The oldest and the newest torch fastddp claims, each in a venv of its own, for
# tests/python/install/test_compat.py: a _C built against the main torch must be refused under
# 2.11 with a clear ImportError, and fastddp built there must pass its self-check. --no-deps:
# the CUDA libraries come from the site-packages that holds this environment's torch (a .pth
# at the end of its path; every site-packages folder of this environment's Python, not only
# torch's: in a venv made with --system-site-packages the CUDA libraries may sit in the
# system's while torch sits in the venv), so only torch's own wheel (530 MB) is downloaded,
# plus, where torch does not import with the outer NVSHMEM (2.15), the one it pins.
# $(call compat-venv,VENV,TORCH SPEC[,PIP'S ENVIRONMENT]): makes VENV unless it imports torch
# already. Each venv has its own pip and folder, so `make -j` may make them beside `install`;
# they read this environment's torch (below), hence their prerequisite `deps`.
define compat-venv
@[ -x $(1)/bin/python ] && $(1)/bin/python -c "import torch, sys, \
  setuptools as s; sys.exit(int(s.__version__.split('.')[0]) < 77)" 2>/dev/null \
  || { rm -rf $(1) && $(PYTHON) -m venv $(1) \
       && $(3) $(1)/bin/pip install -q --no-deps "$(2)" \
       && $(3) $(1)/bin/pip install -q typing-extensions sympy networkx jinja2 fsspec filelock \
          "setuptools>=77" wheel \
       && $(PYTHON) -c "import os, site, torch; \
          print(*dict.fromkeys([os.path.dirname(os.path.dirname(torch.__file__))] + site.getsitepackages()), sep='\n')" \
          > $$($(1)/bin/python -c "import site; print(site.getsitepackages()[0])")/zz_outer.pth \
       && { $(1)/bin/python -c "import torch" 2>/dev/null \
            || $(3) $(1)/bin/pip install -q --no-deps $$($(1)/bin/python -c "from importlib.metadata \
               import requires; print(*(r.split(';')[0].replace(' ', '') for r in \
               requires('torch') if r.startswith('nvidia-nvshmem')))"); } ; }
@$(1)/bin/python -c "import torch; print('[make] compat venv: torch', torch.__version__)"
endef

COMPAT_VENV := build/torch-2.11-venv
NEWEST_VENV := build/torch-2.15-venv
deps-compat: deps
	$(call compat-venv,$(COMPAT_VENV),torch==2.11.0)

# This machine's pip constraints cap torch at its local wheels' version (2.14.1): lifted for
# this venv's pip only (a target's exported variable would reach `deps` too).
deps-compat-newest: deps
	$(call compat-venv,$(NEWEST_VENV),torch==2.15.0,PIP_CONSTRAINT=/dev/null)

# CI's second stage (.ci/run, after `make test`, which must stay under 30 minutes): fastddp
# built against torch 2.15 (a CPU build) and its self-check there.
test-compat-newest: install deps-compat-newest
	FASTDDP_COMPAT_NEWEST=$(CURDIR)/$(NEWEST_VENV)/bin/python $(PYTHON) -m pytest -q \
	  -p no:cacheprovider tests/python/install/test_compat.py -k newest

# fastddp's install here and the 2.11 venv side by side (make -j2): each is mostly one core's
# work (from ccache and pip's cache, ~15 and ~30 s on a fresh clone) and they share no
# environment. deps-stacks uses this environment's pip, so it waits for the install's.
test:
	@$(MAKE) --no-print-directory -j2 --output-sync=line install deps-compat
	@$(MAKE) --no-print-directory deps-stacks test-cpp test-python test-torch-ddp

# Through ccache with _C's settings (CCACHE_ENV: paths under the checkout made relative): a
# fresh clone of sources built before compiles nothing, where Catch2's main alone took 22 s.
test-cpp:
	cmake -S . -B build/cpp -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
	$(CCACHE_ENV) cmake --build build/cpp
	cd build/cpp && ctest --output-on-failure

# Two test files at a time (pytest-xdist, whole files per worker: a file's module worlds and
# fixtures stay in one process). Run serially, the suite left the 2 cores about 30% idle: a
# multi-rank scenario mostly waits on gloo's loopback collectives, a tuning test on its
# sleeps. With two workers the cores stay busy and the suite takes 15.5 min instead of 19
# (benchmarks/results/suite.md). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test-python:
	$(PYTHON) -m pytest tests/python -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

# The fastddp column of PyTorch's DDP tests; known_failures.txt are strict xfails.
test-torch-ddp:
	$(PYTHON) -m pytest tests/torch_ddp -q -p no:cacheprovider

# Both columns (stock torch DDP, then fastddp) and a side-by-side table; files in build/torch_ddp.
test-torch-ddp-suite: install
	$(PYTHON) tests/torch_ddp/compare_columns.py --out build/torch_ddp $(ARGS)

run: install
	$(PYTHON) -m torch.distributed.run --standalone \
	  --nproc_per_node=$$($(PYTHON) -c "import torch; print(torch.cuda.device_count() or 2)") \
	  -m fastddp.launch.demo $(ARGS)

bench: install
	$(PYTHON) benchmarks/step_time.py $(ARGS)

# Not part of `make test` (CI has no GPU), and not after `make install`: the GPU machine has
# no network for apt or pip; the check builds _C itself, only when it must. OUT may come from
# the environment. DRY_RUN=1 lists the steps and writes the report without running any.
OUT ?= build/gpu-check
gpu-check:
	$(PYTHON) benchmarks/ci/gpu_check.py --out $(OUT) $(if $(filter 1 yes true,$(DRY_RUN)),--dry-run) $(ARGS)

clean:
	rm -rf build python/fastddp/_C*.so python/*.egg-info

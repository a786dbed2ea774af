# Two commands on a fresh machine: `make run` and `make test`.
# torch is installed first at the exact version this machine carries locally (a CPU build);
# an open range would let pip download a multi-GB CUDA build. The package's own range then
# finds it satisfied.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: install run test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[test,plot]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/autopar train

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/dp_allreduce.py

clean:
	rm -rf $(VENV) runs .pytest_cache

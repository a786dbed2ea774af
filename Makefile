# Two commands on a fresh machine: `make run` and `make test`.
# torch is installed first at the exact version this machine carries locally (a CPU build);
# an open range would let pip download a multi-GB CUDA build. The package's own range then
# finds it satisfied.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: install run test bench clean test-torch2.11

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

# torch 2.11, the GPU image's, on this CPU: a second venv, the private-API check and a core subset of the suite.
# pip takes PyPI's 2.11.0, a CUDA build (about 4.7 GB in the venv), which runs on the CPU too.
COMPAT_VENV := .venv-torch2.11
COMPAT_TESTS := tests/test_torch_internals.py tests/test_grad_sync.py tests/test_zero.py tests/test_trainer.py \
	tests/test_equivalence.py tests/test_pipeline_equivalence.py tests/test_hf_labels.py tests/test_batchnorm.py \
	tests/test_checkpoint.py tests/test_models.py tests/test_frozen_params.py tests/test_dropout.py tests/test_meta_init.py

test-torch2.11:
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install --quiet "torch==2.11.0"
	$(COMPAT_VENV)/bin/python -m pip install --quiet -e ".[test]"
	$(COMPAT_VENV)/bin/python -m pytest -q $(COMPAT_TESTS)

bench: $(STAMP)
	$(PY) benchmarks/dp_allreduce.py

clean:
	rm -rf $(VENV) runs .pytest_cache

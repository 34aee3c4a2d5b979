# Two commands do all setup on a fresh machine: `make demo` and `make test`.
# torch is installed before the project so pip does not pull a CUDA build of several GB: on a CPU machine
# we take the CPU wheel; a GPU user installs their CUDA torch into the venv first and it is kept.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.gpupoor-installed

.PHONY: install demo test docs clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: install
	$(PY) -m gpupoor.demo

test: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider

docs: install
	$(PY) -m gpupoor.docs

clean:
	rm -rf build runs .pytest_cache

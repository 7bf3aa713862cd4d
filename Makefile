# Quick start: `make demo`, `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv test demo clean

venv: $(VENV)/.installed

# torch is pinned where missing: on this project's machines and CI that pin resolves
# to a local CPU build, while a bare `torch` would fetch a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# Two pytest workers: the tests wait on the processes they start about half the time, so
# on a 2-core machine like CI's the suite took 10.5 minutes, not 14.5-16 (serial: `.venv/bin/pytest`).
test: venv
	$(BIN)/pytest -q -n 2

demo: venv
	$(BIN)/preload demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

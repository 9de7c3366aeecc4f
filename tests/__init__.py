"""The suite, laid out like the package: tests/daemon/sources/otlp/ tests daemon/sources/otlp/.

Cross-cutting tests (the public API, the layers, the suite's budgets) and the core concepts' own
(tracker, scale, prompts, policy, progress, images, options) stay at the top. Fixtures every folder
shares are in conftest.py, the repository's paths in paths.py, and the helpers (brokers, scripted
servers, crash wrappers) beside them here.
"""

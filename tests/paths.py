"""Where the suite's files are, for tests in any folder under tests/ (no depth arithmetic on
`__file__`)."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
"""The repository's root (pyproject.toml, docs/, dashboards/ ...)."""
TESTS = REPO / "tests"
"""The suite's own folder: its helper scripts (crash_points.py, ...) and fixtures."""
FIXTURES = TESTS / "fixtures"
"""Recorded runs, rubrics and datasets the tests read."""

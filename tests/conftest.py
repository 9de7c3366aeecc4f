"""Shared fixtures: a private Mosquitto per test that needs a broker (the system one on 1883 is left alone)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.brokers import Mosquitto, mosquitto


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    """A private Mosquitto on a free port, with persistence (restart keeps sessions)."""
    with mosquitto(tmp_path / "mosquitto") as b:
        yield b

"""Shared fixtures: a private Mosquitto or Redis per test that needs one (the system ones on 1883
and 6379 are left alone)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.brokers import Mosquitto, mosquitto
from tests.redis_server import RedisServer, redis_server


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    """A private Mosquitto on a free port, with persistence (restart keeps sessions)."""
    with mosquitto(tmp_path / "mosquitto") as b:
        yield b


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A private Redis on a free port (in memory; skips the test when redis-server is not
    installed)."""
    with redis_server(tmp_path / "redis") as r:
        yield r

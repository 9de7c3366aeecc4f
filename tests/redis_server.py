"""A private Redis for integration tests: free port, own directory, stop / restart / kill on demand.

The system Redis (6379) is never touched. Tests that need one skip (with the reason) when
`redis-server` is not installed; CI installs it.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.brokers import free_port, wait_port


class RedisServer:
    """One private `redis-server` on a free port; `appendonly` keeps its data across a restart
    (and a kill)."""

    def __init__(self, workdir: Path, *, appendonly: bool = False, port: int | None = None) -> None:
        self.port = port or free_port()
        self.workdir = workdir
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        """The URL for `agent-monitor serve --cluster`."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        cmd = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.workdir),
        ]
        # No RDB snapshots: a test's data either lives in memory only or in the append-only file it
        # asked for.
        cmd += ["--save", "", "--appendonly", "yes" if self.appendonly else "no"]
        log = (self.workdir / "redis.log").open("ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        try:
            wait_port(self.port)
        except TimeoutError:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(
                f"redis-server did not start on port {self.port}: "
                f"{(self.workdir / 'redis.log').read_text()}"
            ) from None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the server (SIGTERM flushes the append-only file; SIGKILL loses what was not
        fsynced)."""
        if self.proc is None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        wait_port(self.port, up=False)

    def kill(self) -> None:
        """SIGKILL the server."""
        self.stop(signal.SIGKILL)

    def restart(self) -> None:
        """Stop and start again on the same port (the data survives only with appendonly)."""
        self.stop()
        self.start()


@contextmanager
def redis_server(workdir: Path, *, appendonly: bool = False) -> Iterator[RedisServer]:
    """A running private Redis for the duration of the block; skips the test if redis-server is
    not installed."""
    if shutil.which("redis-server") is None:
        pytest.skip(
            "redis-server is not installed (`apt-get install redis-server`); cluster "
            "tests need a real Redis"
        )
    server = RedisServer(workdir, appendonly=appendonly)
    server.start()
    try:
        yield server
    finally:
        server.stop()

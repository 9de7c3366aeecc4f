"""A private Arize Phoenix server for tests: `phoenix serve` from its own virtualenv, SQLite in a
temp dir, free ports.

Phoenix (`arize-phoenix`, ~850 MB with its dependencies) lives in a virtualenv of its own,
`.venv-phoenix` at the repository root (`make phoenix-venv` builds it; `make test` does first), or
where AGENT_MONITOR_PHOENIX_VENV points. Without it the tests that need a server are skipped, saying
how to build it. The server runs offline: telemetry and external resources off, no collector of its
own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.brokers import free_port

ROOT = Path(__file__).resolve().parent.parent
_START_S = 180.0  # ~12 s on a quiet machine, several times that when the suite loads it


def phoenix_bin() -> Path:
    """The `phoenix` command of the Phoenix virtualenv; skips the test when it is not built."""
    # Absolute: the server is started in a working folder of its own (make passes the venv relative
    # to the checkout).
    venv = Path(os.environ.get("AGENT_MONITOR_PHOENIX_VENV") or ROOT / ".venv-phoenix").resolve()
    exe = venv / "bin" / "phoenix"
    if not exe.exists():
        pytest.skip(
            f"no Phoenix virtualenv at {venv}: run `make phoenix-venv` (pip install "
            "arize-phoenix there)"
        )
    return exe


@dataclass
class Phoenix:
    """A running Phoenix: its base URL and process."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def traces_url(self) -> str:
        """Where OTLP/HTTP exporters send spans."""
        return f"{self.url}/v1/traces"

    def get(self, path: str) -> Any:
        """GET a REST path, the decoded JSON reply."""
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return json.load(r)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and wait until it is gone."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@contextmanager
def phoenix_server(workdir: Path) -> Iterator[Phoenix]:
    """A Phoenix server with its SQLite database under `workdir`, on free ports, stopped on exit."""
    exe = phoenix_bin()
    workdir.mkdir(parents=True, exist_ok=True)
    port, grpc = free_port(), free_port()
    env = {
        **os.environ,
        "PHOENIX_WORKING_DIR": str(workdir),
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_PORT": str(port),
        "PHOENIX_GRPC_PORT": str(grpc),
        "PHOENIX_TELEMETRY_ENABLED": "false",
        "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false",
    }
    for name in ("PHOENIX_SQL_DATABASE_URL", "PHOENIX_COLLECTOR_ENDPOINT", "PHOENIX_ENABLE_AUTH"):
        env.pop(name, None)
    log = workdir / "phoenix.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(exe), "serve"], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=workdir
        )
    server = Phoenix(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + _START_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"phoenix serve exited ({proc.returncode}): {log.read_text()[-2000:]}"
                )
            try:
                with urllib.request.urlopen(f"{server.url}/healthz", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"phoenix serve did not answer in {_START_S:g} s: {log.read_text()[-2000:]}"
                )
            time.sleep(0.5)
        yield server
    finally:
        server.stop()

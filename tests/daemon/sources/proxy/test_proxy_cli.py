"""`agent-monitor proxy` and `serve --proxy-upstream` as a user runs them: a subprocess, a real
broker, an HTTP judge.

The agent is the real openai SDK client pointed at the proxy; the upstream is the scripted one of
tests/llm_upstream.py. Its API key must reach the upstream and never the logs (debug level) or the
run store.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.brokers import Mosquitto, free_port
from tests.cli.test_serve_cli import Watch, wait_serving
from tests.daemon.sources.proxy.test_proxy import SCRIPT, SECRET, SYSTEM, TASK, chat_agent
from tests.llm_upstream import upstream
from tests.openai_server import chat_choice, chat_reply, scripted_server

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("command", ["proxy", "serve"])
def test_the_proxy_command_watches_an_unmodified_agent(
    broker: Mosquitto, tmp_path: Path, command: str
) -> None:
    from agent_monitor.daemon.sources.proxy._turns import run_key

    port = free_port()
    with scripted_server() as judge, upstream() as up:
        judge.default = chat_reply(chat_choice([("P", {"P": 0.9, "Q": 0.1})]))
        up.add(*SCRIPT)
        door = (
            ["proxy", "--upstream", up.url]
            if command == "proxy"
            else ["serve", "--proxy-upstream", up.url]
        )
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agent_monitor",
                *door,
                "--listen",
                f"127.0.0.1:{port}",
                "--broker",
                broker.url,
                "--judge",
                "openai",
                "--judge-url",
                judge.url,
                "--metrics-port",
                "0",
                "--log-level",
                "debug",
                "--state-dir",
                str(tmp_path / "state"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ},
        )
        try:
            lines = wait_serving(proc)
            assert any(f"proxy on http://127.0.0.1:{port}" in line for line in lines), lines
            rid = run_key(SYSTEM, TASK)
            with Watch(broker.port, f"agents/{rid}/progress") as out:
                client = openai.AsyncOpenAI(api_key=SECRET, base_url=f"http://127.0.0.1:{port}/v1")
                assert asyncio.run(chat_agent(client, stream=True)) == "All tests pass now."
                out.until(lambda m: m[1]["step"] == 3)
        finally:
            proc.terminate()
            _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        logged = "".join(lines) + err
        assert "proxy_listening" in logged  # the debug log did run
        assert SECRET not in logged
        journal = list((tmp_path / "state").rglob("*"))
        assert any(p.name.endswith(".sqlite3") for p in journal), journal
        for p in journal:
            if p.is_file():
                assert SECRET.encode() not in p.read_bytes(), p
        for s in up.seen:
            assert {k.lower(): v for k, v in s.headers.items()}[
                "authorization"
            ] == f"Bearer {SECRET}"


def test_proxy_without_upstream_or_on_a_taken_port_fails_with_one_line(broker: Mosquitto) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "agent_monitor", "proxy", "--broker", broker.url, *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "AGENT_MONITOR_NO_STORE": "1"},
        )

    with scripted_server() as judge:
        judge.default = chat_reply(chat_choice([("P", {"P": 1.0})]))
        base = ["--judge", "openai", "--judge-url", judge.url, "--metrics-port", "0"]
        missing = run(*base)
        assert missing.returncode == 2 and "needs --upstream URL" in missing.stderr
        bad = run(*base, "--upstream", "ftp://x")
        assert bad.returncode == 2 and "is not an HTTP URL" in bad.stderr
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            busy = run(
                *base, "--upstream", "http://127.0.0.1:9/v1", "--listen", f"127.0.0.1:{port}"
            )
        assert busy.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in busy.stderr, (
            busy.stderr
        )

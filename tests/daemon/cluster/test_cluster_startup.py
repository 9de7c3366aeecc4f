"""Cluster start-up when a replica, its peer and the broker restart together (issue 48, 3).

Seen once: a replica exited at start-up. Two ways it could, both shown here with real processes: the
broker is not up yet when the replicas start, and a replica restarted with its fixed `--replica-id`
finds its own dead incarnation's heartbeat still current in Redis (it lapses only after the lease).
Each replica now waits for both, within a deadline, instead of exiting.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent_monitor.daemon import ClusterUnavailable
from agent_monitor.wire import MonitorClient
from tests.brokers import Mosquitto
from tests.openai_server import chat_choice, chat_reply, scripted_server
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(180)

LEASE = 12.0
"""Longer than a replica takes to start here: its dead incarnation's heartbeat is still current
when it is back."""


def serve(
    broker: Mosquitto, redis: RedisServer, judge_url: str, rid: str, log: Path
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "agent_monitor",
        "serve",
        "--broker",
        broker.url,
        "--cluster",
        redis.url,
        "--cluster-name",
        "s",
        "--replica-id",
        rid,
        "--cluster-lease",
        str(LEASE),
        "--cluster-heartbeat",
        "0.5",
        "--judge",
        "openai",
        "--judge-url",
        judge_url,
        "--judge-model",
        "m",
        "--metrics-port",
        "0",
        "--client-id",
        "cl",
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("ab"))


def wait_serving(
    procs: dict[str, subprocess.Popen[bytes]], logs: dict[str, Path], lives: dict[str, int]
) -> None:
    """Wait until each replica's current life logged that it serves; fail at once if one exits."""
    deadline = time.monotonic() + 90
    for rid, p in procs.items():
        while logs[rid].read_text(errors="replace").count("agent-monitor: serving") < lives[rid]:
            text = logs[rid].read_text(errors="replace")
            assert p.poll() is None, f"replica {rid} exited with {p.returncode}:\n{text[-3000:]}"
            assert time.monotonic() < deadline, f"replica {rid} did not serve:\n{text[-3000:]}"
            time.sleep(0.05)


def test_replicas_and_broker_restarted_together_all_serve(
    broker: Mosquitto, redis: RedisServer, tmp_path: Path
) -> None:
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {rid: tmp_path / f"{rid}.log" for rid in ("a", "b")}
    lives = {"a": 1, "b": 1}
    with scripted_server() as judge:
        judge.default = chat_reply(chat_choice([("J", {"J": 1.0})]))
        try:
            for rid in ("a", "b"):
                procs[rid] = serve(broker, redis, judge.url, rid, logs[rid])
            wait_serving(procs, logs, lives)
            # A host restart: both replicas die at once (no leaving: their heartbeats stay current
            # in Redis for a lease), and the broker goes down with them.
            for p in procs.values():
                p.send_signal(signal.SIGKILL)
                p.wait(10)
            broker.stop()
            # They come back before the broker does, and well within their dead incarnations' lease.
            for rid in ("a", "b"):
                lives[rid] += 1
                procs[rid] = serve(broker, redis, judge.url, rid, logs[rid])
            # The broker comes back only once both replicas are waiting for it.
            deadline = time.monotonic() + 90
            while not all("broker_waiting" in logs[r].read_text(errors="replace") for r in procs):
                for rid, p in procs.items():
                    text = logs[rid].read_text(errors="replace")
                    assert p.poll() is None, (
                        f"replica {rid} exited with {p.returncode}:\n{text[-3000:]}"
                    )
                assert time.monotonic() < deadline, "the replicas never waited for the broker"
                time.sleep(0.05)
            time.sleep(1.0)
            broker.start()
            wait_serving(procs, logs, lives)
            # And they monitor: a run started now is scored.
            with MonitorClient(broker.url) as client:
                run = client.start_run("after-restart", task="t")
                run.step("x")
                deadline = time.monotonic() + 60
                while run.progress is None:
                    assert time.monotonic() < deadline, "the run was never scored after the restart"
                    time.sleep(0.1)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs.values():
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()


async def test_a_live_replicas_id_is_still_refused_after_a_lease(
    broker: Mosquitto, redis: RedisServer
) -> None:
    """The wait is for a dead incarnation only: a live replica renews its heartbeat, so its id
    stays refused."""
    from tests.daemon.cluster.test_cluster import LEASE as SHORT
    from tests.daemon.cluster.test_cluster import replica

    async with replica(broker, redis, "x"):
        began = time.monotonic()
        with pytest.raises(ClusterUnavailable, match="replica id 'x' is in use by a live replica"):
            async with replica(broker, redis, "x"):
                pass
        assert time.monotonic() - began >= SHORT  # it waited a lease for the id to lapse first

"""The web board over HTTP: /metrics, the page, /events (server-sent events) and /api/runs, and
their limits.

A real Monitor (scripted judge, fed with `handle()`) with the board sink, served by the real
HttpServer on a free port; the tests speak HTTP over plain sockets, so every byte on the wire is
what they check.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import hashlib
import json
import math
import re
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from agent_monitor.daemon import (
    Board,
    BoardSettings,
    HttpServer,
    MemoryStore,
    Monitor,
    MonitorConfig,
)
from agent_monitor.daemon.http import BOARD_PORT, HttpSettings
from agent_monitor.daemon.sinks import BoardSite
from agent_monitor.daemon.sinks._board import TASK_CHARS
from agent_monitor.policy import Policy
from agent_monitor.progress import Usage
from agent_monitor.testing import FakeJudge

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def j(**kw: Any) -> bytes:
    return json.dumps(kw).encode()


@dataclass
class Served:
    monitor: Monitor
    board: Board
    web: HttpServer
    registry: CollectorRegistry
    clock: Clock = field(default_factory=Clock)

    async def start(self, run_id: str, task: str = "a task", **extra: Any) -> None:
        await self.monitor.handle(f"agents/{run_id}/start", j(task=task, **extra))

    async def step(self, run_id: str, index: int) -> None:
        await self.monitor.handle(
            f"agents/{run_id}/step", j(index=index, text=f"{run_id} step {index}")
        )
        await asyncio.wait_for(self.monitor.drain(), 10)

    def dropped(self, reason: str) -> float:
        return (
            self.registry.get_sample_value(
                "agent_monitor_board_clients_dropped_total", {"reason": reason}
            )
            or 0.0
        )


@asynccontextmanager
async def served(
    settings: BoardSettings | None = None,
    *,
    policy: Policy | None = None,
    judge: FakeJudge | None = None,
    config: MonitorConfig | None = None,
    **kw: Any,
) -> AsyncIterator[Served]:
    clock = Clock()
    registry = CollectorRegistry()
    board = Board(settings, registry=registry, clock=clock)
    config = config or MonitorConfig(policy=policy or Policy())
    monitor = Monitor(
        config, judge=judge or FakeJudge(), registry=registry, sinks=[board], clock=clock
    )
    async with (
        HttpServer(registry, port=0, settings=HttpSettings(**kw), site=BoardSite(board)) as web,
        monitor,
    ):
        yield Served(monitor, board, web, registry, clock)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


async def exchange(port: int, raw: bytes) -> Reply:
    """Send raw bytes, read the whole reply (the server closes every connection after its
    response)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return Reply(int(lines[0].split()[1]), headers, body)


async def get(port: int, path: str, method: str = "GET", **headers: str) -> Reply:
    extra = "".join(f"{k.replace('_', '-')}: {v}\r\n" for k, v in headers.items())
    return await exchange(port, f"{method} {path} HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode())


class EventStream:
    """A browser's /events connection, read by hand: each event's type and JSON data, comments
    kept."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.headers: dict[str, str] = {}
        self.comments: list[str] = []
        self.retry: int | None = None

    @classmethod
    async def open(cls, port: int) -> EventStream:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /events HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n")
        stream = cls(reader, writer)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        lines = head.decode("latin-1").split("\r\n")
        assert lines[0] == "HTTP/1.1 200 OK", lines[0]
        stream.headers = {
            k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)
        }
        return stream

    async def next(self, *, comments: bool = False) -> tuple[str, dict[str, Any]]:
        """The next event (or, with comments=True, a comment as ("comment", {"text": ...}))."""
        kind, data = "message", None
        while True:
            line = (await asyncio.wait_for(self.reader.readline(), 10)).decode()
            if not line:
                raise EOFError("the server closed the stream")
            line = line.rstrip("\n")
            if line == "":
                if data is not None:
                    return kind, json.loads(data)
                continue
            if line.startswith(":"):
                self.comments.append(line[1:].strip())
                if comments:
                    return "comment", {"text": line[1:].strip()}
            elif line.startswith("retry: "):
                self.retry = int(line[7:])
            elif line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                assert data is None, "one data line per event"
                data = line[6:]
            else:
                raise AssertionError(f"not an SSE line: {line!r}")

    async def until(self, kind: str, run_id: str | None = None) -> dict[str, Any]:
        """Skip events up to the next one of `kind` (about `run_id`, if given)."""
        while True:
            k, data = await self.next()
            if k == kind and (run_id is None or (data.get("run") or data).get("run_id") == run_id):
                return data

    def close(self) -> None:
        self.writer.close()


# -- /metrics --


async def test_metrics_is_the_registry_exposition_as_the_scraper_asks() -> None:
    async with served() as s:
        await s.start("r1", labels={"group": "g"})
        await s.step("r1", 1)
        plain = await get(s.web.port, "/metrics")
        assert plain.status == 200
        assert plain.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        families = {f.name: f for f in text_string_to_metric_families(plain.body.decode())}
        assert families["agent_monitor_runs_active"].samples[0].value == 1
        progress = families["agent_monitor_run_progress"].samples[0]
        assert progress.labels["run_id"] == "r1" and progress.value == pytest.approx(1 / 19)
        assert (
            "agent_monitor_board_clients" in families
            and "agent_monitor_board_clients_dropped" in families
        )

        om = await get(s.web.port, "/metrics", accept="application/openmetrics-text; version=1.0.0")
        assert om.headers["content-type"].startswith("application/openmetrics-text")
        assert om.body.endswith(b"# EOF\n")

        zipped = await get(s.web.port, "/metrics", accept_encoding="gzip")
        assert zipped.headers["content-encoding"] == "gzip"
        assert b"agent_monitor_runs_active 1.0" in gzip.decompress(zipped.body)

        head = await get(s.web.port, "/metrics", method="HEAD")
        assert (
            head.status == 200 and head.body == b"" and int(head.headers["content-length"]) > 1000
        )


async def test_without_the_board_only_metrics_are_served() -> None:
    registry = CollectorRegistry()
    Monitor(MonitorConfig(), judge=FakeJudge(), registry=registry)
    async with HttpServer(registry, port=0) as web:
        assert (await get(web.port, "/metrics")).status == 200
        for path in ("/", "/events", "/api/runs"):
            r = await get(web.port, path)
            assert r.status == 404 and b"the board is off (serve --no-board)" in r.body, path


# -- the page --


async def test_the_page_is_one_self_contained_file_under_a_strict_content_security_policy() -> None:
    async with served() as s:
        r = await get(s.web.port, "/")
    assert r.status == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
    html = r.body.decode()
    csp = r.headers["content-security-policy"]
    scripts = re.findall(r"<script>(.*?)</script>", html, flags=re.S)
    styles = re.findall(r"<style>(.*?)</style>", html, flags=re.S)
    assert len(scripts) == 1 and len(styles) == 1

    def digest(text: str) -> str:
        return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"

    # Exactly the page's own script and style may run; nothing may load from anywhere.
    assert f"script-src {digest(scripts[0])};" in csp and f"style-src {digest(styles[0])};" in csp
    assert "default-src 'none'" in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert (
        r.headers["x-frame-options"] == "DENY" and r.headers["x-content-type-options"] == "nosniff"
    )
    # No external resources (air-gapped machines): every src/href is a data: URL, and no @import or
    # url().
    assert re.findall(r"""(?:src|<link[^>]*href)=["']([^"']*)""", html) == ["data:,"]
    # Its one static link goes to the history of ended runs, on the same server.
    assert re.findall(r"""<a[^>]*href=["']([^"']*)""", html) == ["runs"]
    assert "@import" not in html and "url(" not in html
    # Text from events goes in as text: the script never parses markup.
    for sink in (
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "eval(",
        "new Function",
    ):
        assert sink not in scripts[0], sink
    assert "textContent" in scripts[0]


# -- /api/runs and the board's state --


async def test_snapshot_keeps_the_newest_points_task_cut_labels_signal_and_reason() -> None:
    policy = Policy(abort_below=0.2, min_steps=1, patience=1)
    # B = 1/19: abort; K = 10/19
    judge = FakeJudge(lambda p: "B" if "doomed" in p.prefix_text() else "K")
    async with served(BoardSettings(points=3), policy=policy, judge=judge) as s:
        await s.start("fine", task="x" * 1000, labels={"group": "alpha", "model": "m1"})
        await s.start("doomed-1", task="a doomed task")
        for i in range(1, 6):
            await s.step("fine", i)
        await s.step("doomed-1", 1)
        r = await get(s.web.port, "/api/runs")
        assert r.status == 200 and r.headers["content-type"] == "application/json"
        snap = json.loads(r.body)
    # most recently active first
    assert [run["run_id"] for run in snap["runs"]] == ["doomed-1", "fine"]
    assert snap["live"] == 2 and snap["hidden"] == 0 and snap["points"] == 3
    fine, doomed = snap["runs"][1], snap["runs"][0]
    assert [p[0] for p in fine["curve"]] == [3, 4, 5]  # the newest 3 points
    assert fine["curve"][-1][1] == pytest.approx(10 / 19) and fine["score"] == pytest.approx(
        10 / 19
    )
    assert len(fine["task"]) == TASK_CHARS and fine["task"].endswith("…")
    assert fine["labels"] == {"group": "alpha", "model": "m1"} and fine["group"] == "alpha"
    assert fine["step"] == 5 and fine["signal"] == "continue" and fine["outcome"] is None
    assert doomed["signal"] == "abort" and doomed["signal_step"] == 1
    assert doomed["signal_reason"] == "score below 0.2 for 1 scored steps"


async def test_each_run_shows_its_running_judge_tokens_and_cost() -> None:
    judge = FakeJudge(usage=Usage(1000, 400, 1))
    config = MonitorConfig(price_input=2.5, price_output=10.0, price_cached_input=1.25)
    async with served(judge=judge, config=config) as s:
        await s.start("r")
        for i in (1, 2, 3):
            await s.step("r", i)
        (run,) = s.board.snapshot()["runs"]
        sse = await EventStream.open(s.web.port)
        try:
            (snap_run,) = (await sse.until("snapshot"))["runs"]
        finally:
            sse.close()
    assert run["tokens"] == {"input": 3000, "cached_input": 1200, "output": 3}
    # 1,800 fresh input at 2.5, 1,200 cached at 1.25, 3 output at 10 per million tokens.
    assert run["cost"] == (1800 * 2.5 + 1200 * 1.25 + 3 * 10.0) / 1e6
    assert snap_run["tokens"] == run["tokens"] and snap_run["cost"] == run["cost"]


async def test_a_failed_scoring_keeps_the_last_score_and_says_why() -> None:
    judge = FakeJudge(["K", FakeJudge.failure("timeout", "the judge did not answer")])
    async with served(judge=judge) as s:
        await s.start("r")
        await s.step("r", 1)
        await s.step("r", 2)
        (run,) = s.board.snapshot()["runs"]
    assert run["ok"] is False and run["failure"] == "timeout" and "did not answer" in run["error"]
    assert run["score"] == pytest.approx(10 / 19) and run["step"] == 2
    assert run["curve"] == [(1, pytest.approx(10 / 19), 0.0), (2, None, None)]  # a gap in the curve


async def test_only_the_most_recently_active_runs_are_kept_and_the_rest_counted() -> None:
    async with served(BoardSettings(max_runs=2)) as s:
        for run in ("a", "b", "c"):
            await s.start(run, task=f"task {run}")
        snap = s.board.snapshot()
        assert (
            [r["run_id"] for r in snap["runs"]] == ["c", "b"]
            and snap["hidden"] == 1
            and snap["live"] == 3
        )
        # back on the board (with its task), pushing out the least recently active
        await s.step("a", 1)
        snap = s.board.snapshot()
        assert [r["run_id"] for r in snap["runs"]] == ["a", "c"] and snap["hidden"] == 1
        assert snap["runs"][0]["task"] == "task a" and len(snap["runs"][0]["curve"]) == 1


async def test_an_ended_run_stays_for_the_grace_period_then_leaves() -> None:
    async with served(BoardSettings(grace_s=30)) as s:
        await s.start("r")
        await s.step("r", 1)
        await s.monitor.handle("agents/r/end", j(outcome="success"))
        await asyncio.wait_for(s.monitor.drain(), 10)
        (run,) = s.board.snapshot()["runs"]
        assert run["outcome"] == "success" and run["ended_at"] == s.clock.t
        assert s.board.snapshot()["live"] == 0
        s.clock.t += 29
        assert len(s.board.snapshot()["runs"]) == 1
        s.clock.t += 1
        assert s.board.snapshot()["runs"] == []


async def test_runs_restored_after_a_restart_are_back_on_the_board() -> None:
    store = MemoryStore()
    registry = CollectorRegistry()
    first = Monitor(MonitorConfig(), judge=FakeJudge(), store=store, registry=registry)
    async with first:
        await first.handle("agents/r/start", j(task="survives", labels={"group": "g"}))
        for i in (1, 2, 3):
            await first.handle("agents/r/step", j(index=i, text=f"step {i}"))
            await asyncio.wait_for(first.drain(), 10)
    registry = CollectorRegistry()
    board = Board(registry=registry)
    second = Monitor(
        MonitorConfig(), judge=FakeJudge(), store=store, registry=registry, sinks=[board]
    )
    async with second:
        board.restore((second.run(r) for r in second.restored), live=len(second.restored))
        (run,) = board.snapshot()["runs"]
    assert run["run_id"] == "r" and run["task"] == "survives" and run["group"] == "g"
    assert (
        [p[0] for p in run["curve"]] == [1, 2, 3]
        and run["step"] == 3
        and run["score"] == pytest.approx(3 / 19)
    )


# -- /events --


async def test_events_send_a_snapshot_then_one_event_per_change_and_keep_alive_comments() -> None:
    async with served(BoardSettings(keepalive_s=0.05, grace_s=10)) as s:
        await s.start("r1", labels={"group": "g"})
        await s.step("r1", 1)
        stream = await EventStream.open(s.web.port)
        try:
            assert stream.headers["content-type"] == "text/event-stream; charset=utf-8"
            assert stream.headers["cache-control"] == "no-store"
            kind, snap = await stream.next()
            assert kind == "snapshot" and stream.retry == 2000
            assert [r["run_id"] for r in snap["runs"]] == ["r1"] and snap["runs"][0]["curve"][0][
                0
            ] == 1

            await s.step("r1", 2)
            update = await stream.until("run", "r1")
            assert update["point"] == [2, pytest.approx(2 / 19), 0.0] and update["run"]["step"] == 2
            assert "curve" not in update["run"] and update["live"] == 1 and update["hidden"] == 0

            await s.start("r2", task="second")
            opened = await stream.until("run", "r2")
            assert (
                opened["run"]["curve"] == []
                and opened["run"]["task"] == "second"
                and opened["live"] == 2
            )

            await s.monitor.handle("agents/r2/end", j(outcome="failure"))
            closed = await stream.until("run", "r2")
            assert closed["run"]["outcome"] == "failure" and closed["live"] == 1

            s.clock.t += 10
            s.board.prune()
            assert await stream.until("gone") == {"run_id": "r2", "live": 1, "hidden": 0}

            # Idle: keep-alive comments (proxies and browsers keep the stream open).
            while (await stream.next(comments=True))[0] != "comment":
                pass
            assert "keep-alive" in stream.comments
        finally:
            stream.close()


async def test_event_text_cannot_break_out_of_its_event() -> None:
    """A task with newlines and SSE field names stays data of one event (JSON escapes the
    newlines)."""
    hostile = 'line 1\n\nevent: gone\ndata: {"run_id": "r"}\n\r\n<script>alert(1)</script>'
    async with served() as s:
        stream = await EventStream.open(s.web.port)
        try:
            await stream.until("snapshot")
            await s.start("r", task=hostile)
            kind, data = await stream.next()
            assert kind == "run" and data["run"]["task"] == hostile
            await s.step("r", 1)
            kind, data = await stream.next()
            assert kind == "run" and data["point"][0] == 1
        finally:
            stream.close()


async def test_a_slow_browser_is_dropped_and_counted_while_scoring_and_the_others_go_on() -> None:
    """A browser that reads nothing: its queue fills, it is dropped; a reading browser gets every
    update."""
    runs = 400
    # big updates fill the buffers sooner
    labels = {f"k{i}": "v" * 250 for i in range(15)} | {"group": "g"}
    async with served(BoardSettings(client_queue=20, max_runs=runs + 1)) as s:
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.setblocking(False)
        await asyncio.get_running_loop().sock_connect(slow, ("127.0.0.1", s.web.port))
        await asyncio.get_running_loop().sock_sendall(
            slow, b"GET /events HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        fast = await EventStream.open(s.web.port)
        seen: set[str] = set()

        async def read_all() -> None:
            await fast.until("snapshot")
            while len(seen) < runs:
                data = await fast.until("run")
                if data.get("point"):
                    seen.add(data["run"]["run_id"])

        try:
            async with asyncio.TaskGroup() as tg:
                reader = tg.create_task(read_all())
                for i in range(runs):
                    await s.start(f"run-{i:03}", labels=labels)
                    await s.step(f"run-{i:03}", 1)
                await asyncio.wait_for(reader, 30)
            assert s.dropped("slow") == 1, "the browser that reads nothing was not dropped"
            assert s.board.clients == 1
            # scoring and the reading browser went on
            assert s.monitor.scorings == runs and len(seen) == runs
            # The slow browser's connection was closed: after what the buffers held, it reads the
            # end.
            with contextlib.suppress(ConnectionResetError):
                while await asyncio.wait_for(
                    asyncio.get_running_loop().sock_recv(slow, 1 << 20), 10
                ):
                    pass
        finally:
            fast.close()
            slow.close()


async def test_more_browsers_than_allowed_are_answered_503_and_counted() -> None:
    async with served(BoardSettings(max_clients=2)) as s:
        streams = [await EventStream.open(s.web.port) for _ in range(2)]
        try:
            r = await get(s.web.port, "/events")
            assert (
                r.status == 503
                and r.headers["retry-after"] == "10"
                and b"--board-clients" in r.body
            )
            assert s.dropped("full") == 1 and s.board.clients == 2
            streams.pop().close()
            # noticed at once, not at a keep-alive
            await asyncio.wait_for(_until(lambda: s.board.clients == 1), 10)
            streams.append(await EventStream.open(s.web.port))
            assert s.board.clients == 2
        finally:
            for stream in streams:
                stream.close()


async def test_leaving_the_server_closes_the_browsers_connections() -> None:
    async with served() as s:
        stream = await EventStream.open(s.web.port)
        await stream.until("snapshot")
        await s.web.__aexit__(None, None, None)
        with pytest.raises(EOFError):
            await stream.next()
        assert s.board.clients == 0
        stream.close()


async def _until(check: Any) -> None:
    """Poll a condition on the server's state (bound it with asyncio.wait_for)."""
    while True:
        if check():
            return
        await asyncio.sleep(0.01)


# -- what is refused --


async def test_unknown_paths_other_methods_bodies_and_oversized_or_slow_requests_are_refused() -> (
    None
):
    async with served(head_timeout_s=0.2) as s:
        port = s.web.port
        r = await get(port, "/nope")
        assert r.status == 404 and b"the board is at /, metrics at /metrics" in r.body
        for method in ("POST", "PUT", "DELETE", "OPTIONS"):
            r = await get(port, "/", method=method)
            assert r.status == 405 and r.headers["allow"] == "GET, HEAD", method
        r = await exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        assert r.status == 413
        r = await exchange(
            port,
            b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: "
            + b"a" * BOARD_PORT.max_head_bytes
            + b"\r\n\r\n",
        )
        assert r.status == 431
        r = await exchange(port, b"HELLO\r\n\r\n")
        assert r.status == 400
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # says nothing: timed out
        writer.write(b"GET / HT")
        assert (await asyncio.wait_for(reader.read(), 10)).startswith(b"HTTP/1.1 408 ")
        writer.close()
        # Every refusal carries the same hardening headers, and the server still answers afterwards.
        assert r.headers["content-security-policy"].startswith("default-src 'none'")
        assert (await get(port, "/api/runs")).status == 200


async def test_connections_beyond_the_cap_shed_the_slowest_head_and_are_refused_when_all_work() -> (
    None
):
    async with served(max_connections=2) as s:
        gate = s.web.gate
        held = [await asyncio.open_connection("127.0.0.1", s.web.port) for _ in range(2)]
        await asyncio.wait_for(_until(lambda: gate.connections == 2), 10)
        # Two connections that never send their head: a third, with a request, sheds the older and
        # is answered.
        reader, writer = await asyncio.open_connection("127.0.0.1", s.web.port)
        writer.write(b"GET /api/runs HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), 10)).startswith(b"HTTP/1.1 200")
        assert gate.shed == 1 and s.web.refused == 0
        assert await asyncio.wait_for(held[0][0].read(), 10) == b""
        writer.close()
        for _, w in held:
            w.close()
        await asyncio.wait_for(_until(lambda: gate.connections == 0), 15)
        # Two board clients streaming /events (both working): a third connection is closed
        # unanswered.
        streams = []
        for _ in range(2):
            r, w = await asyncio.open_connection("127.0.0.1", s.web.port)
            w.write(b"GET /events HTTP/1.1\r\nhost: x\r\n\r\n")
            streams.append((r, w))
        await asyncio.wait_for(
            _until(lambda: gate.connections == 2 and gate.waiting_count == 0), 10
        )
        reader, writer = await asyncio.open_connection("127.0.0.1", s.web.port)
        with contextlib.suppress(ConnectionResetError):
            assert await asyncio.wait_for(reader.read(), 10) == b""
        assert s.web.refused == 1
        writer.close()
        for _, w in streams:
            w.close()
        await asyncio.wait_for(_until(lambda: gate.connections == 0), 15)
        assert (await get(s.web.port, "/api/runs")).status == 200


async def test_a_client_that_does_not_read_its_response_is_let_go() -> None:
    """A response bigger than the socket buffers, never read: the connection is closed after
    write_timeout_s."""
    from prometheus_client.core import GaugeMetricFamily

    class Big:
        def collect(self) -> Any:
            g = GaugeMetricFamily("big", "a big exposition", labels=["i"])
            for i in range(60_000):
                g.add_metric([f"{i:0>60}"], i)
            yield g

    registry = CollectorRegistry()
    registry.register(Big())  # type: ignore[arg-type]
    async with HttpServer(registry, port=0, settings=HttpSettings(write_timeout_s=0.5)) as web:
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ("127.0.0.1", web.port))
            await loop.sock_sendall(sock, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.wait_for(_until(lambda: web.gate.connections == 1), 10)
            # let go, though nothing was read
            await asyncio.wait_for(_until(lambda: web.gate.connections == 0), 30)
        finally:
            sock.close()


def test_numbers_json_cannot_carry_become_null() -> None:
    """A score's NaN or infinite figure must not make the board's event unencodable (the sink
    would fail)."""
    from agent_monitor.daemon import Scored
    from agent_monitor.progress import Progress

    board = Board()
    p = Progress(
        step=1,
        score=0.5,
        uncertainty=math.nan,
        criteria={},
        ok=True,
        mass=math.inf,
        spread=math.nan,
    )
    board(Scored("r", p, p.to_json(), (), 0.0))
    (run,) = json.loads(json.dumps(board.snapshot(), allow_nan=False))["runs"]
    assert (
        run["score"] == 0.5
        and run["uncertainty"] is None
        and run["mass"] is None
        and run["spread"] is None
    )
    assert run["curve"] == [[1, 0.5, None]]

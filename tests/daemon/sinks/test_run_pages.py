"""A page per run and the history of ended runs: /runs/<id>, /api/runs/<id>, /runs and /api/runs?...
over HTTP.

A real Monitor (scripted judge, fed with `handle()`) with a SQLite run store, the board and the real
HttpServer; the run pages read the store, so a run is there while it runs, after it ended and after
the daemon restarted on the same store.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from prometheus_client import CollectorRegistry

from agent_monitor.daemon import Board, HttpServer, Monitor, MonitorConfig, RunPages, SqliteStore
from agent_monitor.daemon.sinks import BoardSite
from agent_monitor.daemon.sinks._runpages import QueryError, parse_history
from agent_monitor.policy import Policy
from agent_monitor.testing import FakeJudge
from tests.daemon.sinks.test_board import get

pytestmark = pytest.mark.timeout(60)

HOSTILE = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">'
POLICY = Policy(abort_below=0.2, min_steps=1, patience=1)


def judge() -> FakeJudge:
    """Doomed runs score 1/19 (B: abort below 0.2); others 10/19 (K)."""
    return FakeJudge(lambda p: "B" if "doomed" in p.prefix_text() else "K")


@asynccontextmanager
async def daemon(
    path: Path, *, pages: bool = True
) -> AsyncIterator[tuple[Monitor, HttpServer, SqliteStore]]:
    registry = CollectorRegistry()
    board = Board(registry=registry)
    store = SqliteStore(path)
    monitor = Monitor(
        MonitorConfig(policy=POLICY), judge=judge(), store=store, registry=registry, sinks=[board]
    )
    try:
        site = BoardSite(board, RunPages(monitor.store, board) if pages else None)
        async with HttpServer(registry, port=0, site=site) as web, monitor:
            yield monitor, web, store
    finally:
        await store.aclose()


async def feed(
    monitor: Monitor, run_id: str, steps: list[str], *, end: str | None = None, **start: Any
) -> None:
    await monitor.handle(
        f"agents/{run_id}/start", json.dumps({"task": "a doomed task", **start}).encode()
    )
    for i, text in enumerate(steps, 1):
        await monitor.handle(
            f"agents/{run_id}/step", json.dumps({"index": i, "text": text}).encode()
        )
        await asyncio.wait_for(monitor.drain(), 10)
    if end is not None:
        await monitor.handle(f"agents/{run_id}/end", json.dumps({"outcome": end}).encode())
        await asyncio.wait_for(monitor.drain(), 10)


async def api(port: int, path: str) -> tuple[int, Any]:
    r = await get(port, path)
    return r.status, (
        json.loads(r.body)
        if r.headers.get("content-type") == "application/json"
        else r.body.decode()
    )


async def settled(port: int, run_id: str, check: Any) -> dict[str, Any]:
    """The run's JSON once `check(run)` holds (scores are written to the store in the
    background)."""
    run: dict[str, Any] = {}
    for _ in range(100):
        status, run = await api(port, f"/api/runs/{quote(run_id, safe='')}")
        if status == 200 and check(run):
            return run
        await asyncio.sleep(0.05)
    raise AssertionError(f"the run never settled: {run}")


async def test_a_runs_page_gives_every_step_its_score_and_the_abort_live_ended_and_after_a_restart(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.sqlite3"
    long = "a long step\n" + "x" * 30_000
    async with daemon(path) as (monitor, web, _):
        await feed(
            monitor,
            "doomed-1",
            ["ran pytest: 3 failed", long],
            labels={"team": "search"},
            group="g1",
        )
        live = await settled(web.port, "doomed-1", lambda r: len(r["curve"]) == 1)
        # nobody knows the outcome while it runs
        assert live["live"] is True and live["outcome"] is None
        assert live["signal"] == "abort" and live["steps_total"] == 2
        await monitor.handle("agents/doomed-1/end", json.dumps({"outcome": "failure"}).encode())
        await asyncio.wait_for(monitor.drain(), 10)
        await settled(web.port, "doomed-1", lambda r: r["outcome"] == "failure")

    async with daemon(path) as (monitor, web, _):  # a restart on the same store
        run = await settled(web.port, "doomed-1", lambda r: True)
    assert run["live"] is False and run["outcome"] == "failure" and run["ended_at"] is not None
    assert (
        run["task"] == "a doomed task"
        and run["labels"] == {"team": "search"}
        and run["group"] == "g1"
    )
    steps = run["steps"]
    assert [s["index"] for s in steps] == [1, 2]
    assert steps[0]["text"] == "ran pytest: 3 failed"
    assert (
        steps[1]["chars"] == len(long)
        and len(steps[1]["text"]) == 20_000
        and steps[1]["text"].endswith("…")
    )
    # The abort is final: step 1 was scored, step 2 was not (nothing is judged after an abort).
    scored = {c["step"]: c["score"] for c in run["curve"]}
    assert scored[1] == pytest.approx(1 / 19)
    assert run["curve"][0]["abort_below"] == pytest.approx(0.2)
    (abort,) = run["decisions"]
    assert abort["signal"] == "abort" and abort["step"] == 1
    assert abort["reason"] == "score below 0.2 for 1 scored steps"
    assert abort["score"] == pytest.approx(1 / 19) and abort["abort_below"] == pytest.approx(0.2)
    assert abort["criteria"]["task_progress"]["score"] == pytest.approx(1 / 19)
    assert abort["criteria"]["task_progress"]["source"] == "llm"
    # its group's ranking, kept by the store
    assert [m["run_id"] for m in run["ranking"]["runs"]] == ["doomed-1"]
    assert run["totals"]["input"] > 0 and run["source"] == "store"


async def test_the_page_itself_is_static_and_escapes_nothing_into_markup(tmp_path: Path) -> None:
    async with daemon(tmp_path / "runs.sqlite3") as (monitor, web, _):
        await feed(monitor, "h1", [HOSTILE], end="failure", labels={"note": HOSTILE})
        # Front doors refuse such run ids, but a URL is anyone's: the page is the same static file
        # for any path.
        for run_id in ("h1", HOSTILE):
            r = await get(web.port, "/runs/" + quote(run_id, safe=""))
            assert r.status == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
            # Nothing from the run or the URL reaches the HTML: the script fetches the JSON and sets
            # textContent.
            assert b"pwned" not in r.body and b"onerror" not in r.body
            assert "script-src 'sha256-" in r.headers["content-security-policy"]
            assert "'unsafe-inline'" not in r.headers["content-security-policy"]
        status, run = await api(web.port, "/api/runs/h1")
        assert status == 200 and run["steps"][0]["text"] == HOSTILE  # JSON carries it as data
        r = await get(web.port, "/api/runs/" + quote(HOSTILE, safe=""))
        assert r.status == 404 and r.headers["content-type"].startswith("text/plain")
        assert r.headers["x-content-type-options"] == "nosniff"


async def test_unknown_runs_and_bad_paths_are_404_with_what_to_do(tmp_path: Path) -> None:
    async with daemon(tmp_path / "runs.sqlite3") as (_, web, _):
        status, body = await api(web.port, "/api/runs/nobody")
        assert status == 404 and "no run 'nobody' here" in body
        status, body = await api(web.port, "/api/runs/" + "x" * 2000)
        assert status == 404
        # A POST to a path nobody serves is a wrong path (404), not a wrong method.
        r = await get(web.port, "/get_reward_typo", method="POST", content_length="0")
        assert r.status == 404 and b"no /get_reward_typo here" in r.body


async def test_history_filters_by_outcome_signal_family_label_and_time_and_pages_with_a_cursor(
    tmp_path: Path,
) -> None:
    async with daemon(tmp_path / "runs.sqlite3") as (monitor, web, store):
        await feed(monitor, "d1", ["x"], end="failure", family="swe", labels={"team": "a"})
        await feed(monitor, "d2", ["x"], end="failure", family="swe", labels={"team": "b"})
        await monitor.handle(
            "agents/ok1/start", json.dumps({"task": "fine", "family": "robot"}).encode()
        )
        await monitor.handle("agents/ok1/step", json.dumps({"index": 1, "text": "fine"}).encode())
        await asyncio.wait_for(monitor.drain(), 10)
        await monitor.handle("agents/ok1/end", json.dumps({"outcome": "success"}).encode())
        await feed(monitor, "live", ["x"])  # never ended: not in the history
        await asyncio.wait_for(monitor.drain(), 10)
        await store.count_runs()  # every queued write is committed

        async def ids(query: str) -> list[str]:
            status, page = await api(web.port, "/api/runs?" + query)
            assert status == 200, page
            return [r["run_id"] for r in page["runs"]]

        assert sorted(await ids("limit=50")) == ["d1", "d2", "ok1"]
        assert await ids("outcome=success") == ["ok1"]
        assert sorted(await ids("signal=abort")) == ["d1", "d2"]
        assert sorted(await ids("family=swe")) == ["d1", "d2"]
        assert await ids("label=team=b") == ["d2"]
        assert await ids("since=4102444800") == []  # 2100-01-01
        assert sorted(await ids("until=2100-01-01T00:00")) == ["d1", "d2", "ok1"]

        seen: list[str] = []
        cursor = ""
        for _ in range(5):
            status, page = await api(
                web.port, "/api/runs?limit=1" + (f"&cursor={cursor}" if cursor else "")
            )
            seen += [r["run_id"] for r in page["runs"]]
            if page["next"] is None:
                break
            cursor = page["next"]
        assert sorted(seen) == ["d1", "d2", "ok1"] and len(seen) == 3

        status, body = await api(web.port, "/api/runs?outcom=failure")
        assert status == 400 and "unknown query key 'outcom'; did you mean outcome?" in body
        status, body = await api(web.port, "/api/runs?limit=100000")
        assert status == 400 and "from 1 to 200" in body
        status, body = await api(web.port, "/api/runs?cursor=garbage")
        assert status == 400 and "cursor" in body
        # Without a query /api/runs is still the board's snapshot (the live runs).
        status, snap = await api(web.port, "/api/runs")
        assert status == 200 and "max_runs" in snap
        assert (await get(web.port, "/runs")).status == 200


def test_a_query_string_is_parsed_and_bounded() -> None:
    q = parse_history("outcome=failure&label=team=a&label=model:m1&since=2026-01-01T00:00&limit=10")
    assert q.outcome == "failure" and q.labels == (("team", "a"), ("model", "m1")) and q.limit == 10
    assert q.since == 1767225600.0
    with pytest.raises(QueryError, match="give it once"):
        parse_history("outcome=a&outcome=b")
    with pytest.raises(QueryError, match="give key=value"):
        parse_history("label=nothing")
    with pytest.raises(QueryError, match="ISO 8601"):
        parse_history("since=yesterday")


async def test_an_older_store_gains_the_history_index_when_opened(tmp_path: Path) -> None:
    path = tmp_path / "runs.sqlite3"
    async with daemon(path) as (monitor, _, _):
        await feed(monitor, "d1", ["x"], end="failure")
    db = sqlite3.connect(path)
    db.execute("DROP INDEX runs_by_end")  # as a store written before the run pages
    db.close()
    async with daemon(path) as (_, web, _):
        status, page = await api(web.port, "/api/runs?outcome=failure")
        assert status == 200 and [r["run_id"] for r in page["runs"]] == ["d1"]
    db = sqlite3.connect(path)
    assert db.execute("SELECT 1 FROM sqlite_master WHERE name = 'runs_by_end'").fetchone()
    db.close()


async def test_without_a_store_the_page_falls_back_to_the_board_and_history_says_why() -> None:
    registry = CollectorRegistry()
    board = Board(registry=registry)
    monitor = Monitor(MonitorConfig(policy=POLICY), judge=judge(), registry=registry, sinks=[board])
    async with (
        HttpServer(registry, port=0, site=BoardSite(board, RunPages(monitor.store, board))) as web,
        monitor,
    ):
        await feed(monitor, "doomed-1", ["x"])
        status, run = await api(web.port, "/api/runs/doomed-1")
        assert status == 200 and run["source"] == "board" and run["signal"] == "abort"
        assert run["decisions"][0]["reason"] == "score below 0.2 for 1 scored steps"
        status, body = await api(web.port, "/api/runs?outcome=failure")
        assert status == 404 and "keeps no run store" in body


async def test_a_steps_frames_are_served_as_thumbnails_by_digest(tmp_path: Path) -> None:
    import base64
    import hashlib

    from agent_monitor.daemon.stores._store import PLACEHOLDER_PNG

    async with daemon(tmp_path / "runs.sqlite3") as (monitor, web, _):
        await monitor.handle("agents/robot/start", json.dumps({"task": "pick the cube"}).encode())
        image = {"data": base64.b64encode(PLACEHOLDER_PNG).decode(), "mime": "image/png"}
        step = {"index": 1, "text": "gripper closed", "images": [image]}
        await monitor.handle("agents/robot/step", json.dumps(step).encode())
        await asyncio.wait_for(monitor.drain(), 10)
        run = await settled(web.port, "robot", lambda r: len(r["curve"]) == 1)
        digest = hashlib.sha256(PLACEHOLDER_PNG).hexdigest()
        assert run["steps"][0]["frames"] == 1 and run["steps"][0]["frame_digests"] == [digest]
        r = await get(web.port, f"/api/frames/{digest}")
        assert (
            r.status == 200
            and r.headers["content-type"] == "image/png"
            and r.body == PLACEHOLDER_PNG
        )
        assert r.headers["x-content-type-options"] == "nosniff"
        for bad in ("0" * 64, "../../etc/passwd", digest.upper(), digest + "0"):
            assert (await get(web.port, f"/api/frames/{bad}")).status == 404, bad
        page = await get(web.port, "/runs/robot")
        assert "img-src 'self' data:" in page.headers["content-security-policy"]

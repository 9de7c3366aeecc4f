"""The web board in a real browser: headless Chromium on a Monitor fed over a private Mosquitto.

The harness side is the public MonitorClient; the monitor is a real Monitor (scripted judge) with
the board sink and the web server; Chromium (tests/chromium.py, DevTools protocol) opens the board.
The page must load under its Content-Security-Policy, show the live runs, show a new step's score
without a reload, and show hostile text as text.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry

from agent_monitor.daemon import Board, HttpServer, Monitor, MonitorConfig
from agent_monitor.daemon.sinks import BoardSite
from agent_monitor.prompts import Prompt
from agent_monitor.testing import Answer, FakeJudge, letter_at
from agent_monitor.wire import BrokerSettings, MonitorClient
from tests.brokers import Mosquitto
from tests.chromium import CHROMIUM, Browser

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        CHROMIUM is None, reason="chromium is not installed (Debian: `apt-get install chromium`)"
    ),
]

HOSTILE = '<img src=x onerror="window.pwned = 1"><script>window.pwned = 2</script>'


def judge(prompt: Prompt) -> Answer:
    """Doomed runs score 0 (A); the others grow one letter per step (B, C, D: 1/19, 2/19, 3/19)."""
    return "A" if "doomed" in prompt.prefix_text() else letter_at(prompt.step)


def card(run_id: str, part: str) -> str:
    """JavaScript for the text of one part of a run's card (null when the card is not there)."""
    find = (
        f"[...document.querySelectorAll('.card')].find(c => c.dataset.run === {json.dumps(run_id)})"
    )
    return (
        f"(() => {{ const c = {find}; return c ? c.querySelector('.{part}').textContent : "
        "null; })()"
    )


async def test_the_board_shows_live_runs_and_a_new_score_without_a_reload(
    broker: Mosquitto,
) -> None:
    registry = CollectorRegistry()
    board = Board(registry=registry)
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url), client_id="board-browser-test"
    )
    async with (
        HttpServer(registry, port=0, site=BoardSite(board)) as web,
        Monitor(config, judge=FakeJudge(judge), registry=registry, sinks=[board]) as monitor,
    ):
        client = await asyncio.to_thread(MonitorClient, broker.url, connect_timeout=5)
        try:
            climbing = client.start_run(
                "climbing", task="Make the test pass", labels={"group": "swe"}
            )
            doomed = client.start_run(
                "doomed",
                task="a doomed task",
                labels={"group": "robot"},
                policy={"abort_below": 0.2, "min_steps": 1, "patience": 1},
            )
            hostile = client.start_run(
                "hostile", task=HOSTILE, labels={"group": "swe", "note": HOSTILE}
            )
            for run in (climbing, hostile):
                for i in (1, 2):
                    run.step(f"step {i}")
                    await asyncio.to_thread(run.wait_progress, i)
            doomed.step("step 1")  # scored 0: abort (final: its later steps would not be scored)
            await asyncio.to_thread(doomed.wait_signal, "abort")

            async with Browser() as browser:
                await browser.navigate(web.url)
                try:
                    # The page's script ran (under its CSP) and drew the three live runs from the
                    # snapshot.
                    await browser.wait_for("document.querySelectorAll('.card').length === 3")
                    assert await browser.evaluate(card("climbing", "score")) == f"{2 / 19:.3f}"
                    assert await browser.evaluate(card("climbing", "step")) == "step 2"
                    assert await browser.evaluate(card("doomed", "signal")) == "abort"
                    assert "abort at step" in await browser.evaluate(card("doomed", "reason"))
                    assert (
                        await browser.evaluate("document.getElementById('status-text').textContent")
                        == "live"
                    )
                    assert (
                        await browser.evaluate(
                            "document.querySelectorAll('.card svg polyline').length"
                        )
                        >= 3
                    )

                    # A new step's score appears in the same document (no reload: the marker stays).
                    await browser.evaluate("window.sameDocument = true")
                    climbing.step("step 3")
                    await asyncio.to_thread(climbing.wait_progress, 3)
                    await browser.wait_for(
                        f"{card('climbing', 'score')} === {json.dumps(f'{3 / 19:.3f}')}"
                    )
                    assert await browser.evaluate(card("climbing", "step")) == "step 3"
                    assert await browser.evaluate("window.sameDocument") is True
                    first = "[...document.querySelectorAll('.card')][0].dataset.run"
                    await browser.wait_for(f"{first} === 'climbing'")  # most recently active first

                    # A new run appears, and an ended run says so, both live.
                    late = client.start_run("late", task="joined later")
                    late.step("step 1")
                    await asyncio.to_thread(late.wait_progress, 1)
                    await browser.wait_for("document.querySelectorAll('.card').length === 4")
                    climbing.end("success")
                    await browser.wait_for(f"{card('climbing', 'outcome')} === 'ended: success'")

                    # Hostile text is shown as text: no element made from it, no script run.
                    assert await browser.evaluate(card("hostile", "task")) == HOSTILE
                    assert HOSTILE in await browser.evaluate(card("hostile", "labels"))
                    assert (
                        await browser.evaluate(
                            "document.querySelectorAll('main img, main script').length"
                        )
                        == 0
                    )
                    assert await browser.evaluate("typeof window.pwned") == "undefined"
                    assert not [m for m in browser.console if "Content Security Policy" in m], (
                        browser.console
                    )
                except BaseException:
                    print(browser.console, browser.logs())
                    raise
        finally:
            await asyncio.to_thread(client.close)
        assert monitor.scorings >= 7


async def test_a_browser_turned_away_at_the_cap_connects_once_a_place_is_free() -> None:
    """EventSource gives up on a 503; the page tries again by itself and shows the runs once it
    gets in."""
    from agent_monitor.daemon import BoardSettings
    from tests.daemon.sinks.test_board import EventStream

    registry = CollectorRegistry()
    board = Board(BoardSettings(max_clients=1), registry=registry)
    async with (
        HttpServer(registry, port=0, site=BoardSite(board)) as web,
        Monitor(MonitorConfig(), judge=FakeJudge(), registry=registry, sinks=[board]) as monitor,
    ):
        await monitor.handle("agents/r1/start", json.dumps({"task": "t"}).encode())
        await monitor.handle("agents/r1/step", json.dumps({"index": 1, "text": "one"}).encode())
        await asyncio.wait_for(monitor.drain(), 10)
        taken = await EventStream.open(web.port)  # the one place
        async with Browser() as browser:
            await browser.navigate(web.url)
            await browser.wait_for(
                "document.getElementById('status-text').textContent === 'reconnecting'"
            )
            assert await browser.evaluate("document.querySelectorAll('.card').length") == 0
            taken.close()
            await browser.wait_for("document.getElementById('status-text').textContent === 'live'")
            await browser.wait_for("document.querySelectorAll('.card').length === 1")
        rejected = registry.get_sample_value(
            "agent_monitor_board_clients_dropped_total", {"reason": "full"}
        )
        assert rejected is not None and rejected >= 1

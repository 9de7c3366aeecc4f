"""A run's page in a real browser: headless Chromium on a Monitor fed over a private Mosquitto,
restarted between.

The harness side is the public MonitorClient; the monitor is a real Monitor (scripted judge) with a
SQLite run store, the board and the web server. A run is aborted and ended, the daemon restarted on
the same store, and Chromium (tests/chromium.py, DevTools protocol) opens /runs/<id>: the steps'
texts and the abort must show, hostile text as text; a live run's page shows a new step without a
reload; the history at /runs lists the run and links to its page.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent_monitor.daemon import Board, HttpServer, Monitor, MonitorConfig, RunPages, SqliteStore
from agent_monitor.daemon.sinks import BoardSite
from agent_monitor.daemon.stores._store import PLACEHOLDER_PNG
from agent_monitor.policy import Policy
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
    """Doomed runs score 0 (A); the others start at 6/19 (above the abort threshold) and grow one
    letter a step."""
    return "A" if "doomed" in prompt.prefix_text() else letter_at(prompt.step + 5)


@asynccontextmanager
async def daemon(broker: Mosquitto, path: Path, name: str) -> AsyncIterator[HttpServer]:
    registry = CollectorRegistry()
    board = Board(registry=registry)
    site = BoardSite(board)
    store = SqliteStore(path)
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url),
        client_id=name,
        policy=Policy(abort_below=0.2, min_steps=1, patience=1),
    )
    try:
        async with (
            HttpServer(registry, port=0, site=site) as web,
            Monitor(
                config, judge=FakeJudge(judge), store=store, registry=registry, sinks=[board]
            ) as monitor,
        ):
            site.pages = RunPages(monitor.store, board)
            yield web
    finally:
        await store.aclose()


def text_of(selector: str) -> str:
    return f"[...document.querySelectorAll({json.dumps(selector)})].map(e => e.textContent)"


async def test_an_aborted_run_s_page_after_a_restart_shows_its_steps_and_the_abort(
    broker: Mosquitto, tmp_path: Path
) -> None:
    path = tmp_path / "runs.sqlite3"
    async with daemon(broker, path, "pages-1") as web:
        client = await asyncio.to_thread(MonitorClient, broker.url, connect_timeout=5)
        try:
            run = client.start_run("doomed-1", task="a doomed task", labels={"note": HOSTILE})
            run.step("ran pytest: 3 failed")
            await asyncio.to_thread(run.wait_signal, "abort")
            run.step(HOSTILE + "\n" + "long output line\n" * 100)
            run.end("failure")
            async with Browser() as browser:  # the board's card links to the run's page
                await browser.navigate(web.url)
                await browser.wait_for("document.querySelectorAll('.card a.id').length === 1")
                href = await browser.evaluate(
                    "document.querySelector('.card a.id').getAttribute('href')"
                )
                assert href == "runs/doomed-1"
        finally:
            await asyncio.to_thread(client.close)
        await asyncio.sleep(0.5)  # the end reaches the store

    async with daemon(broker, path, "pages-2") as web, Browser() as browser:
        try:
            await browser.navigate(f"{web.url}runs/doomed-1")
            await browser.wait_for("document.querySelectorAll('.step').length === 2")
            assert (
                await browser.evaluate("document.getElementById('title').textContent")
                == "run doomed-1"
            )
            assert (
                await browser.evaluate("document.getElementById('outcome').textContent")
                == "outcome: failure"
            )
            assert await browser.evaluate("document.getElementById('live').textContent") == "ended"
            texts = await browser.evaluate(text_of(".step pre.text"))
            assert texts[0] == "ran pytest: 3 failed" and texts[1].startswith(HOSTILE)
            # The long step is collapsed: a summary, the whole text inside.
            assert (
                await browser.evaluate(
                    "document.querySelectorAll('.step details:not([open])').length"
                )
                == 1
            )
            heads = await browser.evaluate(text_of(".step .head"))
            assert "score 0.000" in heads[0] and "abort" in heads[0] and "not scored" in heads[1]
            (decision,) = await browser.evaluate(text_of(".decision"))
            assert (
                "abort at step 1" in decision and "score below 0.2 for 1 scored steps" in decision
            )
            assert "task_progress" in decision and "threshold 0.200" in decision
            assert (
                await browser.evaluate("document.querySelectorAll('#curve polyline.thr').length")
                == 1
            )
            assert HOSTILE in await browser.evaluate("document.getElementById('facts').textContent")
            assert (
                await browser.evaluate("document.querySelectorAll('main img, main script').length")
                == 0
            )
            assert await browser.evaluate("typeof window.pwned") == "undefined"
            assert not [m for m in browser.console if "Content Security Policy" in m], (
                browser.console
            )

            # The history lists the ended run and links to its page.
            await browser.navigate(f"{web.url}runs?outcome=failure")
            await browser.wait_for("document.querySelectorAll('#list tbody a').length === 1")
            assert (
                await browser.evaluate("document.querySelector('#list tbody a').textContent")
                == "doomed-1"
            )
            await browser.evaluate("document.querySelector('#list tbody a').click()")
            await browser.wait_for("document.querySelectorAll('.step').length === 2")

            # A hostile run id in the URL is shown as text, and the page says the run is not known.
            await browser.navigate(
                f"{web.url}runs/%3Cimg%20src%3Dx%20onerror%3D%22window.pwned%3D1%22%3E"
            )
            await browser.wait_for(
                "document.getElementById('error').textContent.includes('no run')"
            )
            assert await browser.evaluate("typeof window.pwned") == "undefined"
        except BaseException:
            print(browser.console, browser.logs())
            raise


async def test_a_live_run_s_page_shows_a_new_step_without_a_reload(
    broker: Mosquitto, tmp_path: Path
) -> None:
    async with daemon(broker, tmp_path / "runs.sqlite3", "pages-live") as web, Browser() as browser:
        client = await asyncio.to_thread(MonitorClient, broker.url, connect_timeout=5)
        try:
            run = client.start_run("climbing", task="Make the test pass")
            run.step("step one")
            await asyncio.to_thread(run.wait_progress, 1)
            await browser.navigate(f"{web.url}runs/climbing")
            await browser.wait_for("document.querySelectorAll('.step').length === 1")
            assert await browser.evaluate("document.getElementById('live').textContent") == "live"
            assert await browser.evaluate("document.getElementById('outcome').textContent") == ""
            await browser.evaluate("window.sameDocument = true")
            run.step("step two", images=[PLACEHOLDER_PNG])  # a camera frame: shown as a thumbnail
            await asyncio.to_thread(run.wait_progress, 2)
            await browser.wait_for("document.querySelectorAll('.step').length === 2")
            await browser.wait_for(
                "[...document.querySelectorAll('.step img.thumb')].some(i => i.naturalWidth > 0)"
            )
            await browser.wait_for(f"{text_of('.step .head')}[1].includes('score {7 / 19:.3f}')")
            run.end("success")
            await browser.wait_for(
                "document.getElementById('outcome').textContent === 'outcome: success'"
            )
            assert await browser.evaluate("window.sameDocument") is True
        except BaseException:
            print(browser.console, browser.logs())
            raise
        finally:
            await asyncio.to_thread(client.close)

"""Make the screenshot of the web board in docs/metrics.md: `python -m tests.board_screenshot
docs/board.png`.

A real Monitor (scripted judge: tests/board_scenario.py) with the board sink and the web server, fed
with `handle()`; headless Chromium (tests/chromium.py) opens the board and takes the picture.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry

from agent_monitor.daemon import Board, HttpServer, Monitor, MonitorConfig
from agent_monitor.daemon.sinks import BoardSite
from agent_monitor.policy import Policy
from agent_monitor.progress import Usage
from agent_monitor.testing import FakeJudge
from tests.board_scenario import RUNS, answer
from tests.chromium import Browser


async def feed(
    monitor: Monitor, runs: list[dict[str, object]] = RUNS, *, end: tuple[str, ...] = ()
) -> None:
    """Start the runs and send their steps round-robin (so their last activity differs), then end
    `end`."""
    for r in runs:
        start = {k: r[k] for k in ("task", "labels", "policy") if k in r}
        await monitor.handle(f"agents/{r['run_id']}/start", json.dumps(start).encode())
    longest = max(int(str(r["steps"])) for r in runs)
    for i in range(1, longest + 1):
        for r in runs:
            if i <= int(str(r["steps"])):
                await monitor.handle(
                    f"agents/{r['run_id']}/step",
                    json.dumps({"index": i, "text": f"step {i}"}).encode(),
                )
        await asyncio.wait_for(monitor.drain(), 30)
    for run_id in end:
        await monitor.handle(f"agents/{run_id}/end", b'{"outcome": "success"}')
    await asyncio.wait_for(monitor.drain(), 30)


async def main(out: Path) -> None:
    registry = CollectorRegistry()
    board = Board(registry=registry)
    # Prices and scripted token counts: each card shows what judging its run has cost so far.
    config = MonitorConfig(
        policy=Policy(abort_below=0.2, min_steps=3, patience=2),
        price_input=0.15,
        price_output=0.6,
        price_cached_input=0.075,
    )
    async with (
        HttpServer(registry, port=0, site=BoardSite(board)) as web,
        Monitor(
            config,
            judge=FakeJudge(answer, usage=Usage(2400, 2000, 1)),
            registry=registry,
            sinks=[board],
        ) as monitor,
    ):
        await feed(monitor, end=("robot-pick-place-3",))
        async with Browser(1280, 660) as browser:
            await browser.navigate(web.url)
            await browser.wait_for(f"document.querySelectorAll('.card').length === {len(RUNS)}")
            await asyncio.sleep(0.5)  # the score bars' width transition
            await browser.screenshot(out)
    print(out)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/board.png")))

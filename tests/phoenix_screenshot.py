"""Make the screenshot in docs/phoenix.md: `python -m tests.phoenix_screenshot docs/phoenix.png`.

A real Phoenix (tests/phoenix_server.py, from .venv-phoenix) and a real Monitor with the OTLP
receiver and the Phoenix sink (scripted judge: the agent goes off track at its third tool call and
the policy aborts); the agent's SDK exports its trace to both. Headless Chromium (tests/chromium.py)
opens the trace in Phoenix's UI, the aborting tool call selected, its annotations showing.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from agent_monitor.daemon import (
    MemoryStore,
    Monitor,
    MonitorConfig,
    MonitorEvent,
    OtlpReceiver,
    OtlpReceiverSettings,
    PhoenixSettings,
    RunClosed,
)
from agent_monitor.policy import Policy
from agent_monitor.testing import FakeJudge
from tests.chromium import Browser
from tests.daemon.sinks.test_phoenix import TOOLS, Agent, agent_sdk, scores, until
from tests.phoenix_server import phoenix_server

# Planning is fine, the search on track; then the agent holds and pays for the dearer flight.
LETTERS = {1: "L", 2: "O", 3: "J", 4: "C"}


def answer(prompt: Any) -> str:
    return LETTERS.get(prompt.step, "K")


async def main(out: Path) -> None:
    tools = [
        TOOLS[0],
        ("hold_seat", '{"flight": "AF1404"}', TOOLS[1][2]),
        ("pay", '{"flight": "AF1404", "eur": 121}', TOOLS[2][2]),
    ]
    with (
        tempfile.TemporaryDirectory(prefix="phoenix-shot-") as tmp,
        phoenix_server(Path(tmp)) as phoenix,
    ):
        registry = CollectorRegistry()
        receiver = OtlpReceiver(OtlpReceiverSettings(address="127.0.0.1:0"), registry=registry)
        policy = Policy(abort_below=0.4, min_steps=3, patience=1)
        config = MonitorConfig(policy=policy, phoenix=PhoenixSettings(url=phoenix.url))
        events: list[MonitorEvent] = []
        judge, store = FakeJudge(answer), MemoryStore()
        monitor = Monitor(
            config,
            judge=judge,
            store=store,
            registry=registry,
            sources=[receiver],
            sinks=[events.append],
        )
        async with monitor:
            await receiver.ready.wait()
            with agent_sdk(phoenix.traces_url, receiver.url) as tracer:
                agent = await asyncio.to_thread(Agent, tracer)
                run_id = agent.trace_id
                await asyncio.to_thread(agent.plan)
                for n, call in enumerate(tools, 2):
                    await asyncio.to_thread(agent.tool, *call)
                    await until(lambda n=n: len(scores(events, run_id)) >= n)
                await asyncio.to_thread(agent.end)
                await until(
                    lambda: any(isinstance(e, RunClosed) and e.run_id == run_id for e in events)
                )
            await until(
                lambda: monitor.phoenix is not None and monitor.phoenix.statistics().queued == 0
            )
        # Phoenix applies annotations that arrived before their span on its next pass
        await asyncio.sleep(12)
        project = phoenix.get("/v1/projects")["data"][0]["id"]
        url = f"{phoenix.url}/projects/{project}/traces/{run_id}?selectedSpanNodeId="
        async with Browser(1400, 860) as browser:
            await browser.navigate(f"{phoenix.url}/projects/{project}")
            await asyncio.sleep(3)
            await browser.navigate(url)
            await browser.wait_for("document.body.innerText.includes('execute_tool pay')", 60)
            await asyncio.sleep(2)
            # Select the tool call the policy aborted at, and show its annotations.
            await browser.evaluate(
                "[...document.querySelectorAll('*')].filter(e => e.textContent === "
                "'execute_tool pay')"
                ".slice(-1)[0].click()"
            )
            await browser.wait_for("document.body.innerText.includes('Tool: pay')", 60)
            await asyncio.sleep(1)
            await browser.evaluate(
                "[...document.querySelectorAll('button')].filter(e => /View "
                "annotation/.test(e.textContent))"
                ".slice(-1).forEach(e => e.click())"
            )
            await browser.wait_for("document.body.innerText.includes('decision abort')", 30)
            await asyncio.sleep(1)
            await browser.screenshot(out, full_page=False)
    print(out)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/phoenix.png")))

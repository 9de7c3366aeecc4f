"""The source protocol: a front door besides MQTT hands events to ingest and reads back signals
and results."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from agent_monitor.daemon import (
    Inbound,
    Ingest,
    MemoryStore,
    Monitor,
    MonitorConfig,
    MonitorEvent,
    Refused,
    RunsView,
    Scored,
    Source,
)
from agent_monitor.policy import Policy
from agent_monitor.testing import FakeJudge

pytestmark = pytest.mark.timeout(60)


@dataclass(frozen=True, slots=True)
class ScriptedStatistics:
    batches: int


class ScriptedSource:
    """A source that hands a scripted list of events to ingest, then waits; it collects every
    monitor event."""

    name = "scripted"

    def __init__(self, batches: list[list[Inbound]]) -> None:
        self.batches = batches
        self.results: list[list[BaseException | None]] = []
        self.seen: list[MonitorEvent] = []
        self.runs: RunsView | None = None
        self.done = asyncio.Event()

    def sink(self, event: MonitorEvent) -> None:
        self.seen.append(event)

    async def run(self, ingest: Ingest, runs: RunsView) -> None:
        self.runs = runs
        for batch in self.batches:
            self.results.append(await ingest.events(batch))
        self.done.set()
        await asyncio.Event().wait()

    def statistics(self) -> ScriptedStatistics:
        return ScriptedStatistics(batches=len(self.results))


async def test_a_source_feeds_runs_that_are_scored_and_signalled_like_mqtt_ones() -> None:
    steps = [
        Inbound("otlp-1", "step", {"index": i, "text": f"step {i}"}, key=f"span-{i}")
        for i in (1, 2, 3)
    ]
    source = ScriptedSource(
        [
            [
                Inbound(
                    "otlp-1",
                    "start",
                    {
                        "task": "Do the thing",
                        "policy": {"abort_below": 0.5, "min_steps": 1, "patience": 1},
                    },
                )
            ],
            steps,
            steps[:1],  # the same span again: a duplicate, not a fourth step
            [Inbound("bad id!", "step", {"index": 1, "text": "x"})],
            [Inbound("otlp-2", "step", {"index": "one"})],
        ]
    )
    assert isinstance(source, Source)
    judge = FakeJudge(lambda prompt: "B")  # a low score: the run aborts
    async with Monitor(
        MonitorConfig(policy=Policy()), judge=judge, store=MemoryStore(), sources=[source]
    ) as monitor:
        await asyncio.wait_for(source.done.wait(), 10)
        await asyncio.wait_for(monitor.drain(), 10)
        assert "source-scripted" in {t.get_name() for t in monitor._tasks}
        assert monitor.status()["sources"] == {"scripted": {"batches": 5}}
        assert source.runs is not None and source.runs.is_live("otlp-1")
        assert source.runs.signal("otlp-1") == "abort"
        latest = source.runs.latest("otlp-1")
        assert latest is not None and latest.step == 3 and latest.ok
        view = monitor.run("otlp-1")
        assert view is not None and [s.index for s in view.steps] == [1, 2, 3]
        assert source.runs.signal("nope") is None and source.runs.latest("nope") is None
    assert all(e is None for batch in source.results for e in batch)
    scored = [e for e in source.seen if isinstance(e, Scored) and e.run_id == "otlp-1"]
    assert scored and scored[-1].progress.step == 3
    refused = [e for e in source.seen if isinstance(e, Refused)]
    assert {r.reason for r in refused} >= {"bad_topic", "invalid"}, refused


async def test_sources_need_distinct_names() -> None:
    with pytest.raises(ValueError, match="distinct names"):
        Monitor(
            MonitorConfig(), judge=FakeJudge(), sources=[ScriptedSource([]), ScriptedSource([])]
        )

"""Groups through the daemon on a real Mosquitto: laggards pruned, keep_top kept, fail-open,
retained ranking."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiomqtt
import jsonschema
import pytest
from prometheus_client import CollectorRegistry

from agent_monitor.daemon import Monitor, MonitorConfig, RunLimits, SqliteStore
from agent_monitor.policy import Policy
from agent_monitor.prompts import Prompt
from agent_monitor.testing import FakeJudge
from agent_monitor.wire import BrokerSettings, MonitorClient, RankingOut, schemas
from tests.brokers import Mosquitto

pytestmark = pytest.mark.timeout(120)

# Each run's task names it; the judge answers by run: two leaders, two laggards.
LETTERS = {"lead-a": "P", "lead-b": "O", "lag-c": "D", "lag-d": "C"}
RANKING_SCHEMA = json.loads(schemas()["ranking.schema.json"])


def by_run(p: Prompt) -> str:
    text = p.prefix_text()
    return next(letter for run, letter in LETTERS.items() if f"task of {run}" in text)


class Harness:
    """Publishes inputs and collects every output under agents/ by topic (an empty payload is
    None)."""

    def __init__(self, client: aiomqtt.Client) -> None:
        self.client = client
        self.seen: dict[str, list[Any]] = defaultdict(list)
        self.changed = asyncio.Event()

    async def publish(self, run_id: str, kind: str, payload: Any = None) -> None:
        await self.client.publish(
            f"agents/{run_id}/{kind}", json.dumps(payload or {}).encode(), qos=1
        )

    async def collect(self) -> None:
        async for m in self.client.messages:
            body = bytes(m.payload) if isinstance(m.payload, (bytes, bytearray)) else b""
            self.seen[m.topic.value].append(json.loads(body) if body else None)
            self.changed.set()

    async def until(self, check: Callable[[], bool], wait_s: float = 30.0) -> None:
        async def loop() -> None:
            while not check():
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(loop(), wait_s)

    def signals(self, run_id: str) -> list[dict[str, Any]]:
        return [s for s in self.seen[f"agents/{run_id}/signal"] if s]

    def last_step(self, run_id: str) -> int:
        p = [q for q in self.seen[f"agents/{run_id}/progress"] if q]
        return p[-1]["step"] if p else 0

    def ranking(self, group: str) -> Any:
        r = self.seen[f"agents/_groups/{group}/ranking"]
        return r[-1] if r else None


@asynccontextmanager
async def harness(port: int, client_id: str) -> AsyncIterator[Harness]:
    async with aiomqtt.Client(
        "127.0.0.1", port, identifier=client_id, protocol=aiomqtt.ProtocolVersion.V5
    ) as c:
        await c.subscribe("agents/#", qos=1)
        h = Harness(c)
        task = asyncio.create_task(h.collect())
        try:
            yield h
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task


def monitor(
    broker: Mosquitto,
    judge: FakeJudge,
    policy: Policy,
    registry: CollectorRegistry | None = None,
    **kw: Any,
) -> Monitor:
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url),
        client_id=f"mon-{broker.port}",
        policy=policy,
        # failures in these tests are scripted answers, not an outage to back off from
        circuit_threshold=1000,
        **kw,
    )
    return Monitor(config, judge=judge, registry=registry or CollectorRegistry())


def shape(ranking: dict[str, Any]) -> list[tuple[str, int, str]]:
    return [(r["run_id"], r["rank"], r["state"]) for r in ranking["runs"]]


GROUP_POLICY = Policy(min_steps=2, patience=2, keep_top=2, prune_margin=0.2)


async def _steps(h: Harness, runs: list[str], upto: int, start: int = 1) -> None:
    """Steps in lockstep: each one scored (or its run told to abort) before the next, so none are
    coalesced."""
    for i in range(start, upto + 1):
        for r in runs:
            await h.publish(r, "step", {"index": i, "text": f"{r} did step {i}"})
        await h.until(lambda i=i: all(h.last_step(r) >= i or h.signals(r) for r in runs))


async def test_two_laggards_of_four_are_pruned_while_the_leaders_continue(
    broker: Mosquitto,
) -> None:
    registry = CollectorRegistry()
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url),
        client_id=f"mon-{broker.port}",
        policy=GROUP_POLICY,
    )
    runs = list(LETTERS)
    async with (
        Monitor(config, judge=FakeJudge(by_run), registry=registry),
        harness(broker.port, "h") as h,
    ):
        for r in runs:
            await h.publish(
                r, "start", {"task": f"task of {r}", "family": "siblings", "group": "best-of-4"}
            )
        await _steps(h, runs, 6)
        await h.until(lambda: all(h.last_step(r) == 6 for r in ("lead-a", "lead-b")))
        await h.until(lambda: all(h.signals(r) for r in ("lag-c", "lag-d")))
        for r in ("lag-c", "lag-d"):
            (s,) = h.signals(r)
            assert s["signal"] == "abort" and s["pruned"] is True and s["leader"] == "lead-a"
            assert "below the 2nd best live sibling" in s["reason"] and s["policy"]["keep_top"] == 2
            # Pruned at step 3 (min_steps 2, then patience 2 behind): abort is final, nothing scored
            # after it.
            assert s["step"] == 3 and h.last_step(r) == 3
        assert not h.signals("lead-a") and not h.signals("lead-b")  # the leaders continue

        ranking = h.ranking("best-of-4")
        jsonschema.validate(ranking, RANKING_SCHEMA)
        RankingOut.model_validate(ranking)
        assert ranking["leader"] == "lead-a"
        assert [(r["run_id"], r["rank"], r["state"]) for r in ranking["runs"]] == [
            ("lead-a", 1, "live"),
            ("lead-b", 2, "live"),
            ("lag-c", 3, "pruned"),
            ("lag-d", 4, "pruned"),
        ]
        # keep_top is never violated: no ranking ever had fewer than 2 live runs once all four were
        # in.
        for seen in h.seen["agents/_groups/best-of-4/ranking"]:
            if len(seen["runs"]) == 4:
                assert sum(r["state"] == "live" for r in seen["runs"]) >= 2
        # Dense reward: each progress message carries its change since the previous scored step.
        progress = [p for p in h.seen["agents/lead-a/progress"] if p]
        assert progress[0]["delta"] is None and all(
            p["delta"] == pytest.approx(0.0) for p in progress[1:]
        )

        # A late subscriber gets the ranking as it stands (retained).
        async with harness(broker.port, "late") as late:
            await late.until(lambda: late.ranking("best-of-4") is not None)
            assert late.ranking("best-of-4") == ranking

        assert registry.get_sample_value("agent_monitor_pruned_total") == 2
        assert (
            registry.get_sample_value("agent_monitor_group_live_runs", {"group": "best-of-4"}) == 2
        )
        assert registry.get_sample_value(
            "agent_monitor_group_leader_score", {"group": "best-of-4"}
        ) == pytest.approx(15 / 19)


async def test_keep_top_three_prunes_only_one_of_four(broker: Mosquitto) -> None:
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url),
        client_id=f"mon-{broker.port}",
        policy=Policy(min_steps=1, patience=1, keep_top=3, prune_margin=0.04),
    )
    runs = list(LETTERS)
    async with (
        Monitor(config, judge=FakeJudge(by_run), registry=CollectorRegistry()),
        harness(broker.port, "h") as h,
    ):
        for r in runs:
            await h.publish(
                r, "start", {"task": f"task of {r}", "family": "siblings", "group": "g"}
            )
        await _steps(h, runs, 5)
        await h.until(lambda: all(h.last_step(r) == 5 for r in ("lead-a", "lead-b", "lag-c")))
        await h.until(lambda: bool(h.signals("lag-d")))
        assert h.signals("lag-d")[0]["pruned"] is True
        assert not any(h.signals(r) for r in ("lead-a", "lead-b", "lag-c"))
        states = [r["state"] for r in h.ranking("g")["runs"]]
        assert states == ["live", "live", "live", "pruned"]


async def test_a_judge_outage_prunes_nothing(broker: Mosquitto) -> None:
    def answer(p: Prompt) -> Any:
        # Step 1 puts the laggards behind; from step 2 the judge fails for everyone.
        return by_run(p) if p.step == 1 else FakeJudge.failure("timeout")

    policy = Policy(min_steps=1, patience=2, keep_top=1, prune_margin=0.1)
    runs = list(LETTERS)
    async with monitor(broker, FakeJudge(answer), policy), harness(broker.port, "h") as h:
        for r in runs:
            await h.publish(
                r, "start", {"task": f"task of {r}", "family": "siblings", "group": "g"}
            )
        await _steps(h, runs, 5)
        await h.until(lambda: all(h.last_step(r) == 5 for r in runs))
        assert not any(h.signals(r) for r in runs)
        assert [r["state"] for r in h.ranking("g")["runs"]] == ["live"] * 4
        last = [q for q in h.seen["agents/lag-d/progress"] if q][-1]
        assert last["ok"] is False and last["delta"] is None


async def test_the_ranking_is_right_after_a_restart_and_cleared_after_the_last_run_ends(
    broker: Mosquitto, tmp_path: Path
) -> None:
    db = tmp_path / "runs.db"
    runs = list(LETTERS)

    def make(store: SqliteStore, grace_s: float = 3600.0) -> Monitor:
        config = MonitorConfig(
            broker=BrokerSettings.from_url(broker.url),
            client_id=f"mon-{broker.port}",
            policy=GROUP_POLICY,
            limits=RunLimits(group_grace_s=grace_s),
            sweep_interval_s=0.05,
        )
        return Monitor(config, judge=FakeJudge(by_run), registry=CollectorRegistry(), store=store)

    async with harness(broker.port, "h") as h:
        store = SqliteStore(db)
        async with make(store):
            for r in runs:
                await h.publish(
                    r, "start", {"task": f"task of {r}", "family": "siblings", "group": "g"}
                )
            await _steps(h, runs, 4)
            await h.until(lambda: all(h.last_step(r) == 4 for r in ("lead-a", "lead-b")))
            await h.until(lambda: all(h.signals(r) for r in ("lag-c", "lag-d")))
            # The harness stops one pruned run: it ends before the restart, so the journal replay
            # does not bring it back; the stored ranking does. A whole group ends before the restart
            # too.
            await h.publish("lag-d", "end", {"outcome": "failure"})
            await h.until(lambda: h.ranking("g")["runs"][3].get("outcome") == "failure")
            await h.publish("solo", "start", {"task": "task of lead-a", "group": "done"})
            await _steps(h, ["solo"], 1)
            await h.publish("solo", "end", {"outcome": "success"})
            await h.until(
                lambda: (
                    h.ranking("done") is not None
                    and h.ranking("done")["runs"][0]["state"] == "ended"
                )
            )
            before = h.ranking("g")
        await store.aclose()
        # The retained ranking is lost while the monitor is down (a broker restart without
        # persistence).
        await h.client.publish("agents/_groups/g/ranking", b"", qos=1, retain=True)
        await h.until(lambda: h.ranking("g") is None)
        done_seen = len(h.seen["agents/_groups/done/ranking"])
        store = SqliteStore(db)
        async with make(store, grace_s=0.0) as mon:
            await h.until(lambda: h.ranking("g") is not None)
            # Published on a change of order or state, so scores in it may be older than the newest:
            # compare those.
            assert (
                shape(h.ranking("g"))
                == shape(before)
                == [
                    ("lead-a", 1, "live"),
                    ("lead-b", 2, "live"),
                    ("lag-c", 3, "pruned"),
                    ("lag-d", 4, "pruned"),
                ]
            )
            assert h.ranking("g")["runs"][3]["outcome"] == "failure"
            assert [r["step"] for r in h.ranking("g")["runs"]] == [4, 4, 3, 3]
            g = mon.groups.groups["g"]
            assert g.live == ["lead-a", "lead-b"]
            # The group that had ended is published again, then cleared after its grace period (0
            # here).
            await h.until(lambda: len(h.seen["agents/_groups/done/ranking"]) > done_seen + 1)
            assert h.seen["agents/_groups/done/ranking"][-2]["runs"][0]["outcome"] == "success"
            assert h.ranking("done") is None
            # The leaders go on; a pruned run's late steps are not scored.
            await _steps(h, ["lead-a", "lead-b", "lag-c"], 5, start=5)
            await h.until(lambda: all(h.last_step(r) == 5 for r in ("lead-a", "lead-b")))
            await mon.drain()
            assert h.last_step("lag-c") == 3
            async with harness(broker.port, "late") as late:
                await late.until(lambda: late.ranking("g") is not None)
                assert shape(late.ranking("g")) == shape(before)
            for r in ("lead-a", "lead-b", "lag-c"):
                await h.publish(r, "end", {"outcome": "success" if r == "lead-a" else "failure"})
            await h.until(lambda: h.ranking("g") is None)  # cleared after the grace period
            assert "g" not in mon.groups.groups
        await store.aclose()
        reopened = SqliteStore(db)
        assert await reopened.rankings() == {}  # a cleared group leaves nothing behind
        await reopened.aclose()


async def test_group_names_and_limits_are_checked(broker: Mosquitto) -> None:
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url),
        client_id=f"mon-{broker.port}",
        limits=RunLimits(max_group_runs=2, max_groups=1),
    )
    registry = CollectorRegistry()
    async with (
        Monitor(config, judge=FakeJudge(), registry=registry),
        harness(broker.port, "h") as h,
    ):
        await h.publish("a", "start", {"task": "t", "group": "g"})
        await h.publish("b", "start", {"task": "t", "group": "g"})
        await h.publish("c", "start", {"task": "t", "group": "g"})
        await h.publish("d", "start", {"task": "t", "group": "other"})
        await h.publish("e", "start", {"task": "t", "group": "bad/name"})
        await h.publish("f", "start", {"task": "t", "group": "_reserved"})
        await h.until(lambda: all(h.seen[f"agents/{r}/error"] for r in "cdef"))
        assert "already has 2 runs" in h.seen["agents/c/error"][0]["error"]
        assert "at most 1 groups" in h.seen["agents/d/error"][0]["error"]
        assert h.seen["agents/e/error"][0]["reason"] == "invalid"
        assert h.seen["agents/f/error"][0]["reason"] == "invalid"
        assert registry.get_sample_value("agent_monitor_groups_refused_total") == 2
        await h.until(lambda: h.ranking("g") is not None and len(h.ranking("g")["runs"]) == 2)


async def test_compare_orders_leaders_pointwise_scores_cannot_separate(broker: Mosquitto) -> None:
    # Pointwise, lead-a is slightly ahead of lead-b but both answers are spread wide: within their
    # uncertainty. Pairwise, the judge always prefers lead-b, in whichever slot it is shown.
    pointwise = {
        "lead-a": {"L": 0.5, "T": 0.5},
        "lead-b": {"K": 0.5, "S": 0.5},
        "lag-c": "D",
        "lag-d": "C",
    }

    def answer(p: Prompt) -> Any:
        text = p.prefix_text()
        if "## Trajectory 2" in text:
            first_is_b = text.index("lead-b did") < text.index("lead-a did")
            return "A" if first_is_b else "T"  # A: trajectory 1 is far ahead
        return next(v for run, v in pointwise.items() if f"task of {run}" in text)

    registry = CollectorRegistry()
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url),
        client_id=f"mon-{broker.port}",
        policy=Policy(compare=True),
        max_concurrency=1,
    )
    runs = list(pointwise)
    async with (
        Monitor(config, judge=FakeJudge(answer), registry=registry),
        harness(broker.port, "h") as h,
    ):
        for r in runs:
            await h.publish(
                r, "start", {"task": f"task of {r}", "family": "siblings", "group": "g"}
            )
        await _steps(h, runs, 1)
        await h.until(lambda: h.ranking("g") is not None and h.ranking("g")["leader"] == "lead-b")
        assert shape(h.ranking("g")) == [
            ("lead-b", 1, "live"),
            ("lead-a", 2, "live"),
            ("lag-c", 3, "live"),
            ("lag-d", 4, "live"),
        ]
        a, b = (
            next(x for x in h.ranking("g")["runs"] if x["run_id"] == r)
            for r in ("lead-a", "lead-b")
        )
        assert a["score"] > b["score"]  # the pointwise order said otherwise
        # Two leaders: one comparison, both orders: two judge calls.
        assert (
            registry.get_sample_value("agent_monitor_compare_calls_total", {"outcome": "ok"}) == 2
        )


async def test_compare_is_off_by_default(broker: Mosquitto) -> None:
    registry = CollectorRegistry()
    judge = FakeJudge(lambda p: {"L": 0.5, "T": 0.5})
    async with monitor(broker, judge, Policy(), registry=registry), harness(broker.port, "h") as h:
        for r in ("x", "y"):
            await h.publish(
                r, "start", {"task": f"task of {r}", "family": "siblings", "group": "g"}
            )
            await h.publish(r, "step", {"index": 1, "text": "s"})
        await h.until(lambda: all(h.last_step(r) == 1 for r in ("x", "y")))
        assert not any("## Trajectory 2" in p.prefix_text() for p in judge.prompts)
        assert (
            registry.get_sample_value("agent_monitor_compare_calls_total", {"outcome": "ok"}) == 0
        )


async def test_a_harness_on_monitor_client_is_told_it_was_pruned(broker: Mosquitto) -> None:
    def harness_side() -> tuple[bool, bool, str | None]:
        with MonitorClient(broker.url, client_id="harness-client") as client:
            lead = client.start_run(
                "lead-a", task="task of lead-a", family="pair", group="pair", policy={"keep_top": 1}
            )
            lag = client.start_run("lag-c", task="task of lag-c", family="pair", group="pair")
            lead.step("lead-a did step 1")
            lead.wait_progress(1)
            for i in (1, 2):
                lag.step(f"lag-c did step {i}")
                lag.wait_progress(i)  # each step scored on its own: two scored steps behind
            signal = lag.wait_signal("abort")
            lead.end("success")
            lag.end("failure")
            return lag.pruned, lead.pruned, signal.leader

    async with monitor(
        broker, FakeJudge(by_run), Policy(min_steps=1, patience=2, prune_margin=0.2)
    ):
        lag_pruned, lead_pruned, leader = await asyncio.to_thread(harness_side)
    assert lag_pruned and not lead_pruned and leader == "lead-a"


async def test_a_failed_comparison_leaves_the_pointwise_order(broker: Mosquitto) -> None:
    pointwise = {"lead-a": {"L": 0.5, "T": 0.5}, "lead-b": {"K": 0.5, "S": 0.5}}

    def answer(p: Prompt) -> Any:
        text = p.prefix_text()
        if "## Trajectory 2" in text:
            return FakeJudge.failure("bad_response")  # every pairwise call fails
        return next(v for run, v in pointwise.items() if f"task of {run}" in text)

    registry = CollectorRegistry()
    mon = monitor(broker, FakeJudge(answer), Policy(compare=True), registry=registry)
    async with mon, harness(broker.port, "h") as h:
        for r in pointwise:
            await h.publish(
                r, "start", {"task": f"task of {r}", "family": "siblings", "group": "g"}
            )
        await _steps(h, list(pointwise), 1)

        def failed() -> float:
            return (
                registry.get_sample_value(
                    "agent_monitor_compare_calls_total", {"outcome": "failed"}
                )
                or 0.0
            )

        await h.until(lambda: h.ranking("g") is not None and len(h.ranking("g")["runs"]) == 2)
        # The tournament was started by the scoring of the second leader, before its progress went
        # out.
        await asyncio.gather(*mon._comparing.values())
        assert failed() == 2
        assert h.ranking("g")["leader"] == "lead-a"  # pointwise, as if no comparison had been asked
        assert mon.groups.groups["g"].leader == "lead-a"
        assert not any(h.signals(r) for r in pointwise)


async def test_tied_leaders_most_of_whom_give_the_same_answer_are_ordered_without_a_tournament(
    broker: Mosquitto,
) -> None:
    # Leaders pointwise cannot separate; two of three end with the same answer (case, spaces, a full
    # stop aside). Pairwise, the judge prefers whichever trajectory is shown first: a tie it would
    # settle for x at first.
    answers = {"x": "Answer: 7", "y": "answer:  42", "z": "Answer: 42."}

    def answer(p: Prompt) -> Any:
        return "A" if "## Trajectory 2" in p.prefix_text() else {"L": 0.5, "T": 0.5}

    def calls(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    registry = CollectorRegistry()
    policy = Policy(compare=True)
    async with (
        monitor(broker, FakeJudge(answer), policy, registry, max_concurrency=1),
        harness(broker.port, "h") as h,
    ):
        for r in answers:
            await h.publish(
                r, "start", {"task": "the same task", "family": "siblings", "group": "g"}
            )
        for r in ("x", "y"):
            await h.publish(r, "step", {"index": 1, "text": answers[r]})
        # Two leaders: no majority to find (it needs three or more), so they are compared: both
        # orders, 2 calls.
        await h.until(lambda: calls("agent_monitor_compare_calls_total", outcome="ok") == 2)
        await h.publish("z", "step", {"index": 1, "text": answers["z"]})
        await h.until(lambda: calls("agent_monitor_compare_calls_saved_total") == 14)
        await h.until(
            lambda: (
                (g := h.ranking("g")) is not None
                and {x["run_id"] for x in g["runs"][:2]} == {"y", "z"}
            )
        )
        assert h.ranking("g")["runs"][2]["run_id"] == "x"  # type: ignore[index]
    # The three were not compared: the skipped tournament of 3 (ring + 2 pivots, both orders) is
    # what was saved.
    assert calls("agent_monitor_compare_calls_total", outcome="ok") == 2

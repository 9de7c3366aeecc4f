"""Groups belong to their harness: runs rank only with runs of their task (or family), rubric and
group policy.

Issue 27 (3) refused a start unlike the group's first run; issue 48 scores it, ranked apart.
"""

from __future__ import annotations

import json
import time
from typing import Any

from prometheus_client import CollectorRegistry

from agent_monitor.daemon import MemoryStore, Monitor, MonitorConfig
from agent_monitor.daemon.sinks import Message
from agent_monitor.groups import group_mac
from agent_monitor.policy import Policy
from agent_monitor.prompts import Prompt
from agent_monitor.testing import FakeJudge

SECRET = "group-secret-long-enough"
POLICY = Policy(min_steps=1, patience=2, prune_margin=0.2)


def j(**kw: Any) -> bytes:
    return json.dumps(kw).encode()


def answer(p: Prompt) -> str:
    return "T" if "trivially done" in p.text() else "K"


def outputs(mon: Monitor) -> list[tuple[str, dict[str, Any]]]:
    msgs: list[Message] = []
    while (m := mon.outbox.get_nowait()) is not None:
        msgs.append(m)
    return [(m.topic, json.loads(m.payload)) for m in msgs if m.payload]


def errors_of(out: list[tuple[str, dict[str, Any]]], run_id: str) -> list[dict[str, Any]]:
    return [b for t, b in out if t == f"agents/{run_id}/error"]


async def _steps(mon: Monitor, runs: list[str], n: int) -> None:
    for i in range(1, n + 1):
        for r in runs:
            await mon.handle(f"agents/{r}/step", j(index=i, text=f"{r} step {i}"))
        await mon.drain()


async def test_a_run_with_another_task_or_rubric_ranks_apart_and_cannot_prune_the_siblings() -> (
    None
):
    # Issue 27 refused such a start (run_rejected: no monitoring at all); issue 48: it is scored, in
    # a group of its own key, and told so on its error topic.
    reg = CollectorRegistry()
    async with Monitor(
        MonitorConfig(policy=POLICY), judge=FakeJudge(answer), registry=reg, store=MemoryStore()
    ) as mon:
        honest = ["h1", "h2", "h3"]
        for r in honest:
            await mon.handle(f"agents/{r}/start", j(task="fix the bug", group="g"))
        # Another task and a trivial rubric that scores 1.0: before issue 27, it joined and pruned
        # all three.
        await mon.handle(
            "agents/evil/start", j(task="say hi", criteria={"done": "trivially done"}, group="g")
        )
        # The same task with another rubric: its scores do not rank against theirs either.
        await mon.handle(
            "agents/evil2/start",
            j(task="fix the bug", criteria={"done": "trivially done"}, group="g"),
        )
        out = outputs(mon)
        (e1,) = errors_of(out, "evil")
        (e2,) = errors_of(out, "evil2")
        for e in (e1, e2):
            assert (
                e["reason"] == "group_split"
                and "in use by runs of another task, rubric" in e["error"]
            ), e
        g1, g2 = mon.groups.of_run["evil"], mon.groups.of_run["evil2"]
        # one group per task and rubric
        assert g1.startswith("g~") and g2.startswith("g~") and g1 != g2
        assert not any(errors_of(out, r) for r in honest)
        await _steps(mon, [*honest, "evil", "evil2"], 4)
        for r in honest:
            view = mon.run(r)
            assert view is not None and view.signal == "continue" and view.latest is not None
        for r in ("evil", "evil2"):  # monitored: scored like any run
            view = mon.run(r)
            assert view is not None and view.latest is not None and view.latest.ok
        assert sorted(mon.groups.groups["g"].members) == honest
        assert reg.get_sample_value("agent_monitor_groups_split_total") == 2
        assert reg.get_sample_value("agent_monitor_groups_refused_total") == 0


async def test_another_group_policy_ranks_apart_and_a_fixed_one_is_not_the_first_runs_choice() -> (
    None
):
    async with Monitor(
        MonitorConfig(policy=POLICY), judge=FakeJudge(answer), store=MemoryStore()
    ) as mon:
        await mon.handle(
            "agents/a/start", j(task="t", group="g", policy={"prune_margin": 0.0, "patience": 1})
        )
        await mon.handle("agents/b/start", j(task="t", group="g"))
        await mon.handle(
            "agents/c/start", j(task="t", group="g", policy={"prune_margin": 0.0, "patience": 1})
        )
        out = outputs(mon)
        (e,) = errors_of(out, "b")
        assert e["reason"] == "group_split"
        assert mon.groups.of_run["a"] == mon.groups.of_run["c"] == "g" and mon.groups.of_run[
            "b"
        ].startswith("g~")
        # b's own settings
        assert mon.groups.groups[mon.groups.of_run["b"]].policy.prune_margin == 0.2
        assert all(mon.run(r) is not None for r in "abc")
    # Fixed by the monitor: the first run cannot choose; a start asking for other settings is scored
    # in no group.
    config = MonitorConfig(policy=POLICY, group_policy_fixed=True)
    async with Monitor(config, judge=FakeJudge(answer), store=MemoryStore()) as mon:
        await mon.handle(
            "agents/a/start", j(task="t", group="g", policy={"prune_margin": 0.0, "patience": 1})
        )
        await mon.handle("agents/b/start", j(task="t", group="g"))
        out = outputs(mon)
        (e,) = errors_of(out, "a")
        assert e["reason"] == "group_refused" and "uses the monitor's group settings" in e["error"]
        assert "scored on its own" in e["error"]
        assert mon.run("a") is not None and "a" not in mon.groups.of_run
        assert mon.groups.of_run["b"] == "g"


async def test_with_a_group_secret_only_signed_starts_join() -> None:
    reg = CollectorRegistry()
    config = MonitorConfig(policy=POLICY, group_secret=SECRET)
    async with Monitor(config, judge=FakeJudge(answer), store=MemoryStore(), registry=reg) as mon:
        started = round(time.time(), 3)  # fresh: within --signature-max-age
        mac = group_mac(SECRET, "a", started, "g")
        await mon.handle("agents/a/start", j(task="t", group="g", started_at=started, auth=mac))
        await mon.handle("agents/b/start", j(task="t", group="g"))
        # a's MAC, replayed
        await mon.handle("agents/c/start", j(task="t", group="g", started_at=started, auth=mac))
        await mon.handle("agents/d/start", j(task="t"))  # ungrouped runs need nothing
        out = outputs(mon)
        for r in ("b", "c"):
            (e,) = errors_of(out, r)
            assert e["reason"] == "group_refused" and "needs start.auth" in e["error"]
            assert mon.run(r) is not None and r not in mon.groups.of_run  # monitored, in no group
        assert mon.groups.of_run == {"a": "g"} and mon.run("d") is not None
        assert reg.get_sample_value("agent_monitor_groups_refused_total") == 2


async def test_the_retained_ranking_carries_the_scores_when_only_scores_change() -> None:
    judge = FakeJudge(lambda p: "P" if "a step" in p.text() else "K")
    async with Monitor(
        MonitorConfig(policy=Policy(min_steps=1)), judge=judge, store=MemoryStore()
    ) as mon:
        for r in ("a", "b"):
            await mon.handle(f"agents/{r}/start", j(task="t", group="g"))
        # one run at a time: the order a, b (join order, then a ahead) never changes
        for i in (1, 2):
            for r in ("a", "b"):
                await mon.handle(f"agents/{r}/step", j(index=i, text=f"{r} step {i}"))
                await mon.drain()
        rankings = [b for t, b in outputs(mon) if t == "agents/_groups/g/ranking"]
        last = rankings[-1]
        assert [r["run_id"] for r in last["runs"]] == ["a", "b"]
        # before: null, published at the join
        assert all(r["score"] is not None for r in last["runs"]), last


def test_labels_group_is_validated_like_start_group() -> None:
    from agent_monitor.wire import EventError, decode_event

    for bad in ("_hidden", "a/b", "x" * 129, "", "a b"):
        try:
            decode_event("agents/r/start", j(task="t", labels={"group": bad}))
        except EventError as e:
            assert "label group" in e.message
        else:
            raise AssertionError(f"labels.group {bad!r} was accepted")
    decode_event("agents/r/start", j(task="t", labels={"group": "swe-bench.v2:1"}))


async def test_a_restart_places_each_run_where_it_was_and_tells_nobody_again() -> None:
    store = MemoryStore()
    async with Monitor(MonitorConfig(policy=POLICY), judge=FakeJudge(answer), store=store) as mon:
        await mon.handle(
            "agents/evil/start", j(task="say hi", criteria={"done": "trivially done"}, group="g")
        )
        for r in ("h1", "h2"):
            await mon.handle(f"agents/{r}/start", j(task="fix the bug", group="g"))
        placed = dict(mon.groups.of_run)
        assert placed["evil"] == "g" and placed["h1"] == placed["h2"] != "g"
    reg = CollectorRegistry()
    async with Monitor(
        MonitorConfig(policy=POLICY), judge=FakeJudge(answer), store=store, registry=reg
    ) as again:
        assert again.groups.of_run == placed
        assert not [t for t, _ in outputs(again) if t.endswith("/error")]
        assert reg.get_sample_value("agent_monitor_groups_split_total") == 0
        # joins its siblings, not evil
        await again.handle("agents/h3/start", j(task="fix the bug", group="g"))
        assert again.groups.of_run["h3"] == placed["h1"]

"""Cost per run: running totals of judge tokens on every result, priced exactly, over MQTT, across
restarts, in `runs` / `export` and in the per-run gauges."""

from __future__ import annotations

import asyncio
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent_monitor import (
    AsyncProgressTracker,
    Prices,
    Progress,
    ProgressTracker,
    Usage,
    atrack,
    track,
)
from agent_monitor.cli import main
from agent_monitor.daemon import MemoryStore, MetricsSettings, Monitor, MonitorConfig, SqliteStore
from agent_monitor.daemon.runs._views import RunSeries
from agent_monitor.daemon.sinks._metrics import RunCollector
from agent_monitor.progress import run_totals
from agent_monitor.prompts import Prompt
from agent_monitor.testing import FakeJudge
from agent_monitor.wire import BrokerSettings, ProgressOut
from tests.brokers import Mosquitto
from tests.daemon.test_daemon_mqtt import harness

pytestmark = pytest.mark.timeout(120)

PRICES = Prices(input=2.5, output=10.0, cached_input=1.25)


def per_step(prompt: Prompt) -> Usage:
    """A judge with a prefix cache: step n's prompt is 1000 n tokens, all but the newest 1000
    read from the cache."""
    return Usage(
        input_tokens=1000 * prompt.step,
        cached_input_tokens=1000 * (prompt.step - 1),
        output_tokens=1,
    )


def usage_of(steps: range) -> Usage:
    total = Usage()
    for n in steps:
        total += Usage(1000 * n, 1000 * (n - 1), 1)
    return total


# -- prices --


def test_cost_is_exact_from_integer_totals() -> None:
    # 1234 tokens at 0.15 per million is 0.0001851 exactly; summing float per-token costs is not.
    assert Prices(input=0.15, output=0.6).cost(Usage(1234, 0, 0)) == 0.0001851
    assert sum([0.15 / 1e6] * 1234) != 0.0001851
    # Cached tokens are part of input and billed at their own price: 1e6 fresh, 1e6 cached, 1000
    # out.
    assert PRICES.cost(Usage(2_000_000, 1_000_000, 1000)) == 2.5 + 1.25 + 0.01
    # 4 fresh at 0.1, 3 cached at 0.025, 2 out at 0.4: 1.275 per million.
    assert Prices(input=0.1, output=0.4, cached_input=0.025).cost(Usage(7, 3, 2)) == 1.275e-6


def test_cached_input_without_its_own_price_is_billed_as_input() -> None:
    assert Prices(input=3.0, output=15.0).cost(Usage(1_000_000, 800_000, 0)) == 3.0
    assert (
        Prices(input=3.0, output=15.0, cached_input=0.3).cost(Usage(1_000_000, 800_000, 0))
        == 0.6 + 0.24
    )


@pytest.mark.parametrize(
    "kw",
    [
        {"input": -1.0, "output": 1.0},
        {"input": 1.0, "output": math.inf},
        {"input": math.nan, "output": 1.0},
        {"input": 1.0, "output": 1.0, "cached_input": -0.5},
        {"input": True, "output": 1.0},
    ],
)
def test_unusable_prices_are_refused_with_what_to_do(kw: dict[str, Any]) -> None:
    with pytest.raises(
        ValueError, match="use a finite number of USD per million tokens, 0 or more"
    ):
        Prices(**kw)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"price_input": -1.0, "price_output": 1.0}, r"price_input=-1.0 \(--price-input\)"),
        (
            {"price_input": 1.0, "price_output": 1.0, "price_cached_input": math.inf},
            r"--price-cached-input",
        ),
        ({"price_input": 1.0}, "price_output not given"),
        ({"price_cached_input": 1.0}, "price_input and price_output not given"),
    ],
)
def test_monitor_config_refuses_prices_it_cannot_use(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MonitorConfig(**kw)


def test_serve_flags_and_environment_give_the_prices(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "serve",
            "--judge",
            "openai",
            "--judge-url",
            "http://127.0.0.1:9/v1",
            "--no-store",
            "--price-input",
            "-2",
        ],
        environ={"AGENT_MONITOR_PRICE_OUTPUT": "1"},
    )
    assert code == 2 and "price_input=-2.0 (--price-input)" in capsys.readouterr().err
    assert MonitorConfig().prices is None
    assert MonitorConfig(price_input=2.5, price_output=10.0).prices == Prices(2.5, 10.0)


# -- the hook --


def test_totals_are_the_sum_of_every_scorings_usage_failures_included() -> None:
    # Step 2: the letters hold 10% of the mass (low_mass; its tokens were spent). Step 3: the call
    # failed (none were).
    answers = ["C", {"The": 0.9, "C": 0.1}, FakeJudge.failure("bad_request"), "E"]
    judge = FakeJudge(answers, usage=per_step)
    with ProgressTracker("count", judge=judge, prices=PRICES) as tracker:
        curve = [tracker.update(f"step {i}") for i in range(1, 5)]
        assert [p.reason for p in curve] == [None, "low_mass", "bad_request", None]
        assert curve[2].usage == Usage()
        running = Usage()
        for p in curve:
            running += p.usage
            assert p.totals == running
            assert p.cost == PRICES.cost(running)
        # Steps 1, 2 and 4: 7000 input, 4000 of it cached, 3 output; every token the judge reported.
        assert (
            tracker.usage
            == usage_of(range(1, 3)) + usage_of(range(4, 5))
            == Usage(7000, 4000, 3)
            == judge.usage
        )
        assert (
            tracker.cost == curve[-1].cost == (3000 * 2.5 + 4000 * 1.25 + 3 * 10.0) / 1e6 == 0.01253
        )


def test_a_scorings_usage_sums_its_criteria_calls_and_the_judge_counts_its_own() -> None:
    from agent_monitor.criteria import Criterion

    judge = FakeJudge(["C"], usage=Usage(100, 40, 1))
    rubric = [
        Criterion("progress", "How far along is the task?"),
        Criterion("safety", "Is it safe?", weight=0.5),
    ]
    with ProgressTracker("count", judge=judge, criteria=rubric) as tracker:
        p = tracker.update("step 1")
        assert p.calls == 2 and p.usage == Usage(200, 80, 2) == p.totals == judge.usage
        judge.usage = Usage()  # a reset, as when `usage` was a plain attribute
        q = tracker.update("step 2")
    assert q.usage == Usage(200, 80, 2) == judge.usage and q.totals == Usage(400, 160, 4)


async def test_coalesced_steps_count_once_per_scoring_and_every_token_spent() -> None:
    judge = FakeJudge(usage=per_step, latency_s=0.01)
    async with AsyncProgressTracker("count", judge=judge) as tracker:
        tracker.submit("step 1")
        await tracker.drain()
        for i in range(2, 8):
            tracker.submit(f"step {i}")
        latest = await tracker.drain()
    assert latest is not None and latest.step == 7 and latest.coalesced == 6
    assert (
        tracker.usage
        == latest.totals
        == judge.usage
        == usage_of(range(1, 2)) + usage_of(range(7, 8))
    )
    assert (
        tracker.cost is None and latest.cost is None and latest.to_json()["totals"]["cost"] is None
    )


async def test_track_and_atrack_price_the_run() -> None:
    steps = ["a", "b", "c"]
    for curve in (
        track("count", steps, judge=FakeJudge(usage=per_step), prices=PRICES),
        await atrack("count", steps, judge=FakeJudge(usage=per_step), prices=PRICES),
    ):
        assert curve[-1].totals == usage_of(range(1, 4)) == Usage(6000, 3000, 3)
        assert curve[-1].cost == 0.01128


def test_restored_totals_continue_and_old_results_count_their_own_tokens() -> None:
    old = [
        Progress(step=i, score=0.5, uncertainty=0.1, criteria={}, ok=True, usage=Usage(10, 0, 1))
        for i in (1, 2)
    ]
    assert run_totals(old) == Usage(20, 0, 2)  # stored before totals existed
    new = [
        *old,
        Progress(
            step=3, score=0.5, uncertainty=0.1, criteria={}, ok=True, totals=Usage(100, 40, 5)
        ),
    ]
    assert run_totals(new) == Usage(100, 40, 5)
    tracker = AsyncProgressTracker("count", judge=FakeJudge(usage=per_step), prices=PRICES)
    tracker.restore(new)
    assert tracker.usage == Usage(100, 40, 5)


# -- the daemon --


def config(broker: Mosquitto, **kw: Any) -> MonitorConfig:
    return MonitorConfig(
        broker=BrokerSettings.from_url(broker.url),
        client_id=f"cost-{broker.port}",
        max_concurrency=1,
        price_input=2.5,
        price_cached_input=1.25,
        price_output=10.0,
        **kw,
    )


def run_sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    """A per-run gauge's value (the default --metric-labels, group and model, are empty here)."""
    return registry.get_sample_value(name, {"run_id": "r", "group": "", "model": "", **labels})


async def test_progress_messages_carry_totals_that_survive_a_restart(
    broker: Mosquitto, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    judge = FakeJudge(usage=per_step)
    store = SqliteStore(state / "runs.sqlite3")
    async with Monitor(config(broker), judge=judge, store=store) as mon, harness(broker.port) as h:
        await h.publish("r", "start", {"task": "count"})
        for i in range(1, 4):
            # One at a time: each step is its own scoring, so the figures are known in advance.
            await h.publish("r", "step", {"index": i, "text": f"step {i}"})
            await h.until(lambda i=i: h.last_step("r") == i)
        messages = h.progress("r")
        for i, m in enumerate(messages, start=1):
            out = ProgressOut.model_validate(m)
            assert out.totals.model_dump() == m["totals"]
            totals = usage_of(range(1, i + 1))
            assert m["totals"] == {
                "input": totals.input_tokens,
                "cached_input": totals.cached_input_tokens,
                "output": totals.output_tokens,
                "cost": PRICES.cost(totals),
            }
        assert messages[-1]["totals"]["cost"] == 0.01128
        reg = mon.registry
        assert run_sample(reg, "agent_monitor_run_tokens", kind="input") == 6000
        assert run_sample(reg, "agent_monitor_run_tokens", kind="cached_input") == 3000
        assert run_sample(reg, "agent_monitor_run_tokens", kind="output") == 3
        assert run_sample(reg, "agent_monitor_run_cost_usd") == 0.01128
        assert reg.get_sample_value("agent_monitor_judge_cost_usd_total") == 0.01128
    await store.aclose()

    # A new life on the same store: step 4's totals go on from step 3's, not from 0.
    store = SqliteStore(state / "runs.sqlite3")
    async with (
        Monitor(config(broker), judge=FakeJudge(usage=per_step), store=store) as mon,
        harness(broker.port) as h,
    ):
        assert mon.restored == ("r",)
        tracker = mon.tracker("r")
        assert tracker is not None and tracker.usage == usage_of(range(1, 4))
        await h.publish("r", "step", {"index": 4, "text": "step 4"})
        await h.until(lambda: h.last_step("r") == 4)
        last = h.progress("r")[-1]
        assert last["tokens"] == {"input": 4000, "cached_input": 3000, "output": 1}
        assert last["totals"] == {
            "input": 10000,
            "cached_input": 6000,
            "output": 4,
            "cost": 0.01754,
        }
        await h.publish("r", "end", {"outcome": "success"})
        await asyncio.wait_for(mon.drain(), 10)
    await store.aclose()

    # The commands run their own event loop: off this test's.
    assert await asyncio.to_thread(main, ["runs", "--state-dir", str(state), "--json"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["run_id"] == "r" and row["totals"] == last["totals"]
    assert await asyncio.to_thread(main, ["runs", "--state-dir", str(state)]) == 0
    header, line = capsys.readouterr().out.splitlines()
    assert re.search(r" tokens in +cached +out +cost USD task$", header)
    assert re.search(r" 10000 +6000 +4 +0\.017540 count$", line)
    assert await asyncio.to_thread(main, ["export", "r", "--state-dir", str(state)]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert exported["totals"] == last["totals"]
    assert [p["totals"]["input"] for p in exported["curve"]] == [1000, 3000, 6000, 10000]


async def test_rescored_runs_keep_their_totals() -> None:
    store = MemoryStore()
    async with Monitor(
        MonitorConfig(max_concurrency=1), judge=FakeJudge(usage=per_step), store=store
    ) as mon:
        await mon.handle("agents/r/start", b'{"task": "count"}')
        for i in (1, 2):
            await mon.handle(
                "agents/r/step", json.dumps({"index": i, "text": f"step {i}"}).encode()
            )
            await asyncio.wait_for(mon.drain(), 10)
    # Rescoring judges the newest prefix again (a new judge), and those tokens add to what was spent
    # before.
    async with Monitor(
        MonitorConfig(rescore=True), judge=FakeJudge(usage=per_step), store=store
    ) as mon:
        await asyncio.wait_for(mon.drain(), 10)
        tracker = mon.tracker("r")
        assert tracker is not None and tracker.latest is not None
        assert (
            tracker.usage == tracker.latest.totals == usage_of(range(1, 3)) + usage_of(range(2, 3))
        )


async def test_a_monitors_run_gauges_respect_its_series_cap() -> None:
    clock = iter(range(1000, 10_000)).__next__
    settings = MetricsSettings(max_series=1)
    cfg = MonitorConfig(
        metrics=settings, price_input=2.5, price_output=10.0, price_cached_input=1.25
    )
    async with Monitor(cfg, judge=FakeJudge(usage=per_step), clock=lambda: float(clock())) as mon:
        for run in ("old", "new"):
            await mon.handle(f"agents/{run}/start", b'{"task": "count"}')
            await mon.handle(f"agents/{run}/step", b'{"index": 1, "text": "step 1"}')
            await asyncio.wait_for(mon.drain(), 10)
        families = {
            f.name: f
            for f in text_string_to_metric_families(generate_latest(mon.registry).decode())
        }
    assert {s.labels["run_id"] for s in families["agent_monitor_run_tokens"].samples} == {"new"}
    assert [
        (s.labels["run_id"], s.value) for s in families["agent_monitor_run_cost_usd"].samples
    ] == [("new", 0.00251)]
    assert families["agent_monitor_run_series_capped"].samples[0].value == 1
    # Both runs are in the global counter, priced once from its totals: 2 x 1000 input at 2.5, 2
    # outputs at 10.
    assert families["agent_monitor_judge_cost_usd"].samples[0].value == 0.00502


def test_run_gauges_respect_the_series_cap() -> None:
    runs = [
        RunSeries(f"r{i}", step=1, last_event=float(i), tokens=Usage(i, 0, 1), cost=i / 1e6)
        for i in range(5)
    ]
    registry = CollectorRegistry()
    registry.register(RunCollector(lambda: runs, max_series=2))
    families = {
        f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())
    }
    tokens = families["agent_monitor_run_tokens"].samples
    assert {(s.labels["run_id"], s.labels["kind"]) for s in tokens} == {
        (r, k) for r in ("r4", "r3") for k in ("input", "cached_input", "output")
    }
    assert {
        s.labels["run_id"]: s.value for s in families["agent_monitor_run_cost_usd"].samples
    } == {
        "r4": 4e-6,
        "r3": 3e-6,
    }
    assert families["agent_monitor_run_series_capped"].samples[0].value == 3
    # Without prices a run has token series and no cost series.
    registry = CollectorRegistry()
    registry.register(RunCollector(lambda: [RunSeries("r", tokens=Usage(5, 1, 1))]))
    assert run_sample(registry, "agent_monitor_run_tokens", kind="input") == 5
    assert run_sample(registry, "agent_monitor_run_cost_usd") is None

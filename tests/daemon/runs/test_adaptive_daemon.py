"""The adaptive schedule in the daemon, against a real Mosquitto: skipped steps fold into the next
scoring, the progress topic says which steps were scored and why, heartbeats keep one message per
step, aborts stay exact."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent_monitor.policy import FAR, Policy
from agent_monitor.testing import FakeJudge
from tests.brokers import Mosquitto
from tests.daemon.test_daemon_mqtt import Harness, harness, monitor

pytestmark = pytest.mark.timeout(120)


def _answer(p: Any) -> Any:
    text = p.prefix_text()
    if "falling task" in text:
        return "R" if p.step <= 3 else "B"  # 0.89, then 0.05 from step 4
    if "flaky task" in text and p.step == 1:
        return FakeJudge.failure("timeout")
    return "R"


async def _step(h: Harness, run: str, i: int) -> None:
    await h.publish(run, "step", {"index": i, "text": f"{run} step {i}"})
    await h.until(
        lambda: any(
            p["step"] == i or (p.get("age_steps") is not None and p["step"] + p["age_steps"] == i)
            for p in h.progress(run)
        )
    )


async def test_adaptive_schedule_over_mqtt(broker: Mosquitto) -> None:
    judge = FakeJudge(_answer)
    registry = CollectorRegistry()
    pol = Policy(abort_below=0.3, min_steps=2, patience=2, schedule="adaptive", max_gap=3)
    async with (
        monitor(broker, judge, registry, policy=pol, heartbeat=True) as mon,
        harness(broker.port) as h,
    ):
        for run, task in (
            ("good", "steady task"),
            ("bad", "falling task"),
            ("flaky", "flaky task"),
        ):
            await h.publish(run, "start", {"task": task})
        for i in range(1, 8):
            for run in ("good", "bad", "flaky"):
                if not (run == "bad" and i > 5):  # told to abort at step 5
                    await _step(h, run, i)

        good = h.progress("good")
        scored = [p for p in good if not p.get("heartbeat")]
        # bad's abort
        assert registry.get_sample_value("agent_monitor_decision_judge_tokens_count") == 1
        beats = [p for p in good if p.get("heartbeat")]
        # Far above the only threshold: step 1 (first), then every max_gap steps; the rest fold in.
        assert [(p["step"], p["scheduled"], p["coalesced"]) for p in scored] == [
            (1, "first", 1),
            (4, "max_gap 3", 3),
            (7, "max_gap 3", 3),
        ]
        assert [p.get("skipped") for p in scored] == [None, FAR, FAR]
        # One message per step: a skipped step republishes the last score with its age (not a new
        # scoring).
        assert [(p["step"], p["age_steps"]) for p in beats] == [(1, 1), (1, 2), (4, 1), (4, 2)]
        assert all(p["score"] == scored[0]["score"] and p["age_s"] >= 0 for p in beats[:2])
        # delta is per scoring: step 4's is the change since step 1, the previous scored step.
        assert scored[1]["delta"] == pytest.approx(0.0)

        bad = [p for p in h.progress("bad") if not p.get("heartbeat")]
        # Step 4 (max_gap) finds it below the abort threshold: every step counts from there, abort
        # at 5 as "every".
        assert [(p["step"], p["scheduled"]) for p in bad] == [
            (1, "first"),
            (4, "max_gap 3"),
            (5, "near abort_below 0.3"),
        ]
        sig = h.seen[("bad", "signal")]
        assert [s["signal"] for s in sig] == ["abort"] and sig[0]["step"] == 5

        flaky = [p for p in h.progress("flaky") if not p.get("heartbeat")]
        # A failed judge call never aborts, and is never a reason to wait: the next step is scored.
        assert (
            flaky[0]["ok"] is False
            and flaky[1]["step"] == 2
            and flaky[1]["scheduled"] == "after a failure"
        )
        assert not h.seen[("flaky", "signal")]

        # The end is scored, whatever the schedule: the last step folds into the final score.
        await h.publish("good", "step", {"index": 8, "text": "good step 8"})
        await h.until(
            lambda: any(p.get("age_steps") == 1 and p["step"] == 7 for p in h.progress("good"))
        )
        await h.publish("good", "end", {"outcome": "success"})
        await h.until(
            lambda: any(p["step"] == 8 and not p.get("heartbeat") for p in h.progress("good"))
        )
        last = next(p for p in h.progress("good") if p["step"] == 8 and not p.get("heartbeat"))
        assert last["scheduled"] == "end" and last["coalesced"] == 1 and last["skipped"] is None
        # What the run cost, observed when it closed: its totals as its last score carries them.
        assert registry.get_sample_value("agent_monitor_run_judge_tokens_count") == 1
        spent = last["totals"]["input"] + last["totals"]["output"]
        assert registry.get_sample_value("agent_monitor_run_judge_tokens_sum") == spent

        skipped = registry.get_sample_value("agent_monitor_scorings_skipped_total", {"reason": FAR})
        # Counted when the step arrived (step 8 was then scored at the end). good: 2, 3, 5, 6, 8;
        # bad: 2, 3; flaky: 3, 4, 6, 7 (after its failure at 1, step 2 was scored).
        assert skipped == mon._scoring.statistics().skipped[FAR] == 11

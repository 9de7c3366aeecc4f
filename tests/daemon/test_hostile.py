"""Hostile and broken input through the daemon: each gets an error event and a count; nothing
else is disturbed."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from typing import Any

import pytest
from PIL import Image
from prometheus_client import CollectorRegistry

from agent_monitor.daemon import MemoryStore, Monitor, MonitorConfig, RunLimits
from agent_monitor.daemon.sinks import Message
from agent_monitor.testing import FakeJudge


def j(**kw: Any) -> bytes:
    return json.dumps(kw).encode()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def png_bomb(side: int = 100_000) -> bytes:
    """A tiny PNG whose header claims side x side pixels (a decompression bomb by its header)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


def real_png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, format="PNG")
    return buf.getvalue()


HOSTILE: list[tuple[str, str, bytes, str]] = [
    ("not json", "agents/victim/step", b"{oops", "bad_json"),
    ("not utf-8", "agents/victim/step", b"\xff\xfe\x00", "bad_json"),
    ("NaN", "agents/victim/step", b'{"text": NaN}', "bad_json"),
    (
        "deep nesting",
        "agents/victim/step",
        b'{"text": "x", "meta": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        "bad_json",
    ),
    ("wrong type", "agents/victim/step", j(index="1", text="x"), "invalid"),
    ("missing field", "agents/victim/start", j(criteria="progress"), "invalid"),
    ("huge text", "agents/victim/step", j(text="x" * 300_000), "invalid"),
    ("bad base64", "agents/victim/step", j(text="x", images=["%%%not base64%%%"]), "bad_image"),
    (
        "not an image",
        "agents/victim/step",
        j(text="x", images=[b64(b"MZ\x90\x00 an executable")]),
        "bad_image",
    ),
    ("a file path", "agents/victim/step", j(text="x", images=["/etc/shadow"]), "bad_image"),
    (
        "a URL",
        "agents/victim/step",
        j(text="x", images=[{"data": "http://169.254.169.254/latest/meta-data"}]),
        "bad_image",
    ),
    ("bad run id", "agents/_sneaky/step", j(text="x"), "bad_topic"),
    ("misspelt kind", "agents/victim/steps", j(index=2, text="typo"), "unknown_topic"),
    (
        "unknown policy key",
        "agents/other/start",
        j(task="t", policy={"abort_belw": 0.2}),
        "invalid",
    ),
    ("criteria file", "agents/other/start", j(task="t", criteria="../../etc/passwd.md"), "invalid"),
    ("end of unknown run", "agents/nobody/end", j(outcome="success"), "unknown_run"),
    ("duplicate start", "agents/victim/start", j(task="a different task"), "duplicate_start"),
    (
        "conflicting re-send",
        "agents/victim/step",
        j(index=1, text="not fine: rewritten"),
        "conflict",
    ),
    # The same step again is a re-delivery, not a conflict: the next case shows the difference.
]


@pytest.mark.parametrize(
    ("what", "topic", "payload", "reason"), HOSTILE, ids=[h[0] for h in HOSTILE]
)
async def test_hostile_event_is_reported_counted_and_harmless(
    what: str, topic: str, payload: bytes, reason: str
) -> None:
    reg = CollectorRegistry()
    judge = FakeJudge()
    async with Monitor(judge=judge, registry=reg, store=MemoryStore()) as mon:
        await mon.handle("agents/victim/start", j(task="the victim's task"))
        await mon.handle("agents/victim/step", j(index=1, text="fine"))
        await mon.drain()
        before = len(judge.prompts)
        await mon.handle(topic, payload)
        await mon.handle("agents/victim/step", j(index=2, text="still fine"))
        await mon.drain()
        msgs: list[Message] = []
        while (m := mon.outbox.get_nowait()) is not None:
            msgs.append(m)
        errors = [json.loads(m.payload) for m in msgs if "error" in m.topic.rsplit("/", 1)[-1]]
        assert [e["reason"] for e in errors] == [reason], what
        assert errors[0]["error"] and len(errors[0]["error"]) < 700
        assert reg.get_sample_value("agent_monitor_invalid_events_total", {"reason": reason}) == 1
        victim = mon.tracker("victim")
        assert victim is not None
        assert [s.text for s in victim.steps] == ["fine", "still fine"]  # undisturbed
        assert victim.latest is not None and victim.latest.step == 2
        assert len(judge.prompts) == before + 1
        assert all("shadow" not in p.text() for p in judge.prompts)  # never reaches the judge


async def test_a_misspelt_topic_is_reported_on_errors_naming_the_topic_and_the_kinds() -> None:
    reg = CollectorRegistry()
    async with Monitor(judge=FakeJudge(), registry=reg) as mon:
        await mon.handle("agents/run-3/start", j(task="t"))
        await mon.handle("agents/run-3/steps", j(index=1, text="x"))
        msgs = [
            m
            for m in iter(mon.outbox.get_nowait, None)
            if m.topic.endswith("error") or "_errors" in m.topic
        ]
        assert [m.topic for m in msgs] == ["agents/_errors"]
        body = json.loads(msgs[0].payload)
        assert body == {
            "run_id": None,
            "topic": "agents/run-3/steps",
            "reason": "unknown_topic",
            "error": "unknown topic 'agents/run-3/steps': the monitor reads only "
            "agents/<run_id>/start, step and end, "
            "not 'steps'; publish to agents/run-3/step",
        }
        assert (
            reg.get_sample_value("agent_monitor_invalid_events_total", {"reason": "unknown_topic"})
            == 1
        )


async def test_the_monitors_own_outputs_are_ignored_not_reported() -> None:
    # The daemon subscribes to agents/+/+, so its own progress, signals and errors (and other
    # monitors') come back on MQTT 3.1.1: they are dropped without an error message or a count.
    reg = CollectorRegistry()
    async with Monitor(judge=FakeJudge(), registry=reg) as mon:
        assert (
            reg.get_sample_value("agent_monitor_invalid_events_total", {"reason": "unknown_topic"})
            == 0
        )
        for topic in (
            "agents/r/progress",
            "agents/r/signal",
            "agents/r/error",
            "agents/_errors",
            "agents/_groups/g",
        ):
            await mon.handle(topic, j(run_id="r", step=1, score=0.5))
        assert mon.outbox.get_nowait() is None
        assert not mon.book.live and not mon.book.orphans
        for reason in ("unknown_topic", "bad_topic", "bad_json", "invalid"):
            assert (
                reg.get_sample_value("agent_monitor_invalid_events_total", {"reason": reason}) == 0
            )


async def test_a_resend_of_the_same_step_is_a_duplicate_not_a_conflict() -> None:
    reg = CollectorRegistry()
    async with Monitor(judge=FakeJudge(), registry=reg) as mon:
        await mon.handle("agents/r/start", j(task="t"))
        for _ in range(3):
            await mon.handle("agents/r/step", j(index=1, text="same"))
        await mon.drain()
        assert reg.get_sample_value("agent_monitor_duplicate_steps_total") == 2
        assert (
            reg.get_sample_value("agent_monitor_invalid_events_total", {"reason": "conflict"}) == 0
        )


async def test_images_that_pass_the_sniff_but_not_the_decoder_keep_the_step() -> None:
    reg = CollectorRegistry()
    async with Monitor(judge=FakeJudge(), registry=reg) as mon:
        await mon.handle("agents/r/start", j(task="t"))
        corrupt = b"\x89PNG\r\n\x1a\n" + b"garbage" * 20
        await mon.handle("agents/r/step", j(index=1, text="corrupt frame", images=[b64(corrupt)]))
        await mon.handle("agents/r/step", j(index=2, text="bomb frame", images=[b64(png_bomb())]))
        await mon.handle("agents/r/step", j(index=3, text="good frame", images=[b64(real_png())]))
        await mon.drain()
        tracker = mon.tracker("r")
        assert tracker is not None
        steps = tracker.steps
        assert [s.text for s in steps] == ["corrupt frame", "bomb frame", "good frame"]
        assert [len(s.frames) for s in steps] == [0, 0, 1]
        assert (
            reg.get_sample_value("agent_monitor_invalid_events_total", {"reason": "bad_image"}) == 2
        )


async def test_a_flood_of_run_ids_evicts_the_idlest_and_counts_them() -> None:
    reg = CollectorRegistry()
    async with Monitor(
        MonitorConfig(limits=RunLimits(max_runs=50)), judge=FakeJudge(), registry=reg
    ) as mon:
        for i in range(500):
            await mon.handle(f"agents/flood-{i}/start", j(task="spam"))
        assert len(mon.book.live) == 50
        assert set(mon.book.live) == {f"flood-{i}" for i in range(450, 500)}  # the newest stay
        assert reg.get_sample_value("agent_monitor_runs_total", {"outcome": "evicted"}) == 450
        # Orphan steps for never-started runs are bounded too.
        for i in range(2000):
            await mon.handle(f"agents/ghost-{i}/step", j(text="x"))
        assert len(mon.book.orphans) == mon.config.limits.max_orphan_runs
        assert (
            reg.get_sample_value("agent_monitor_invalid_events_total", {"reason": "too_many_held"})
            == 1000
        )


async def test_rescore_asks_for_fresh_scores_after_a_restart() -> None:
    store = MemoryStore()
    judge = FakeJudge()
    async with Monitor(judge=judge, store=store) as mon:
        await mon.handle("agents/r/start", j(task="t"))
        for i in range(1, 4):
            await mon.handle("agents/r/step", j(index=i, text=f"s{i}"))
            await mon.drain()
    calls = len(judge.prompts)
    async with Monitor(judge=judge, store=store) as mon:
        await mon.drain()
        assert len(judge.prompts) == calls
    async with Monitor(MonitorConfig(rescore=True), judge=judge, store=store) as mon:
        await mon.drain()
        assert len(judge.prompts) == calls + 1 and judge.prompts[-1].step == 3
        run = mon.run("r")
        assert run is not None and run.latest is not None and run.latest.coalesced == 3

"""The sync harness client against a private Mosquitto, with the test playing the monitor's part
over plain paho."""

from __future__ import annotations

import base64
import io
import json
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from PIL import Image

from agent_monitor.wire import (
    ErrorOut,
    ImageIn,
    MonitorClient,
    ProgressOut,
    Run,
    RunEnd,
    RunStart,
    SignalOut,
    StepIn,
    TopicError,
)
from tests.brokers import Mosquitto, free_port

WAIT = 10.0


def png(w: int = 4, h: int = 3) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (10, 200, 10)).save(buf, format="PNG")
    return buf.getvalue()


def eventually(pred: Callable[[], bool], timeout: float = WAIT, what: str = "condition") -> None:
    """Poll `pred` until it holds (for state the client exposes without a wait_* method)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout}s")
        time.sleep(0.01)


@dataclass(frozen=True)
class Msg:
    topic: str
    payload: bytes
    qos: int
    retain: bool

    def json(self) -> Any:
        return json.loads(self.payload)


class Peer:
    """A plain paho client playing the monitor: records what it receives, publishes outputs."""

    def __init__(
        self,
        port: int,
        filters: tuple[str, ...] = ("agents/#",),
        *,
        client_id: str | None = None,
        clean: bool = True,
    ) -> None:
        self.messages: list[Msg] = []
        self.cond = threading.Condition()
        self.filters = filters
        self.c = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id or f"peer-{uuid.uuid4().hex[:8]}",
            protocol=MQTTProtocolVersion.MQTTv311,
            clean_session=clean,
        )
        self.c.reconnect_delay_set(1, 1)
        self.subscribed = threading.Event()
        self.c.on_connect = self._on_connect
        self.c.on_subscribe = lambda *a: self.subscribed.set()
        self.c.on_message = self._on_message
        self.c.connect("127.0.0.1", port, keepalive=10)
        self.c.loop_start()
        assert self.subscribed.wait(WAIT), "peer did not subscribe"

    def _on_connect(
        self, c: mqtt.Client, _u: Any, flags: mqtt.ConnectFlags, rc: Any, _p: Any
    ) -> None:
        if not flags.session_present:
            c.subscribe([(f, 1) for f in self.filters])

    def _on_message(self, _c: mqtt.Client, _u: Any, m: mqtt.MQTTMessage) -> None:
        with self.cond:
            self.messages.append(Msg(m.topic, bytes(m.payload), m.qos, bool(m.retain)))
            self.cond.notify_all()

    def wait(self, pred: Callable[[list[Msg]], bool], timeout: float = WAIT) -> list[Msg]:
        with self.cond:
            assert self.cond.wait_for(lambda: pred(self.messages), timeout), (
                f"peer saw only {self.messages}"
            )
            return list(self.messages)

    def on(self, topic: str) -> list[Msg]:
        with self.cond:
            return [m for m in self.messages if m.topic == topic]

    def publish(self, topic: str, payload: bytes | str | Any, *, retain: bool = False) -> None:
        data = payload if isinstance(payload, bytes | str) else json.dumps(payload)
        self.c.publish(topic, data, qos=1, retain=retain).wait_for_publish(WAIT)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


@pytest.fixture
def peer(broker: Mosquitto) -> Iterator[Peer]:
    p = Peer(broker.port)
    yield p
    p.close()


@pytest.fixture
def mon(broker: Mosquitto) -> Iterator[MonitorClient]:
    with MonitorClient(broker.url, connect_timeout=5, ack_timeout=5) as m:
        yield m


def signal(
    run_id: str, sig: str = "abort", *, step: int = 3, best_step: int | None = 2
) -> dict[str, Any]:
    return SignalOut(
        run_id=run_id, signal=sig, reason="test", step=step, score=0.1, best_step=best_step
    ).model_dump()  # type: ignore[arg-type]


def progress(run_id: str, step: int, score: float = 0.5) -> dict[str, Any]:
    return ProgressOut(run_id=run_id, step=step, score=score, ok=True).model_dump()


# -- what the client publishes --


def test_publishes_start_steps_and_end_as_the_protocol_says(mon: MonitorClient, peer: Peer) -> None:
    image = png()
    run = mon.start_run(
        "run-1",
        task="Fix the failing test",
        criteria="coding",
        policy={"abort_below": 0.2},
        labels={"env": "ci"},
    )
    assert [
        run.step(f"action {i}\nobservation {i}", images=[image] if i == 2 else ())
        for i in (1, 2, 3)
    ] == [1, 2, 3]
    assert run.step("with meta", meta={"tests_passed": 3}) == 4
    run.end("success")
    msgs = peer.wait(lambda ms: any(m.topic == "agents/run-1/end" for m in ms))

    inputs = [m for m in msgs if m.topic.rsplit("/", 1)[1] in ("start", "step", "end")]
    assert [m.topic for m in inputs] == ["agents/run-1/start"] + ["agents/run-1/step"] * 4 + [
        "agents/run-1/end"
    ]
    assert all(m.qos == 1 and not m.retain for m in inputs)
    start = RunStart.model_validate(inputs[0].json())
    assert (start.task, start.criteria, start.policy, start.labels) == (
        "Fix the failing test",
        "coding",
        {"abort_below": 0.2},
        {"env": "ci"},
    )
    steps = [StepIn.model_validate(m.json()) for m in inputs[1:5]]
    assert [s.index for s in steps] == [1, 2, 3, 4]
    assert steps[0].text == "action 1\nobservation 1" and steps[0].images == []
    assert inputs[2].json()["images"] == [
        {"data": base64.b64encode(image).decode(), "mime": "image/png"}
    ]
    assert steps[1].images[0].decoded() == image
    assert steps[3].meta == {"tests_passed": 3}
    assert all(s.ts is not None and abs(s.ts - time.time()) < 60 for s in steps)
    assert RunEnd.model_validate(inputs[5].json()).outcome == "success"
    assert inputs[5].json() == {"outcome": "success"}


def test_explicit_index_restarts_numbering_and_images_may_be_imagein_or_base64(
    mon: MonitorClient, peer: Peer
) -> None:
    run = mon.start_run("run-2", task="t")
    image = png()
    assert run.step("a", images=[ImageIn.from_bytes(image)]) == 1
    assert run.step("b", images=[base64.b64encode(image).decode()]) == 2
    assert run.step("c (after rollback to 1)", index=2) == 2
    assert run.step("d") == 3
    run.end(0.75)
    msgs = peer.wait(lambda ms: any(m.topic == "agents/run-2/end" for m in ms))
    assert [json.loads(m.payload)["index"] for m in msgs if m.topic == "agents/run-2/step"] == [
        1,
        2,
        2,
        3,
    ]
    assert json.loads(peer.on("agents/run-2/end")[0].payload) == {"outcome": 0.75}


def test_end_without_outcome_is_empty_object_and_is_idempotent(
    mon: MonitorClient, peer: Peer
) -> None:
    run = mon.start_run("run-3", task="t")
    run.end()
    run.end("failure")  # no-op
    assert run.ended
    with pytest.raises(RuntimeError, match="has ended"):
        run.step("late")
    # same connection, so anything sent before it arrives before it
    mon.start_run("marker", task="t")
    peer.wait(lambda ms: any(m.topic == "agents/marker/start" for m in ms))
    assert [m.payload for m in peer.on("agents/run-3/end")] == [b"{}"]
    assert peer.on("agents/run-3/step") == []


def test_invalid_input_raises_before_anything_is_sent(mon: MonitorClient, peer: Peer) -> None:
    bad_starts: list[tuple[dict[str, Any], str]] = [
        ({"task": "  "}, "task"),
        ({"task": "t", "policy": {"abort_belw": 0.2}}, "abort_belw"),
        ({"task": "t", "criteria": "criteria/coding.md"}, "file path"),
        ({"task": "t", "labels": {"1bad": "x"}}, "labels"),
        ({"task": "t", "images": [b"not an image"]}, "PNG, JPEG"),
        ({"task": "t", "images": ["/tmp/shot.png"]}, "file path"),
    ]
    for kwargs, message in bad_starts:
        with pytest.raises(ValueError, match=message):
            mon.start_run("bad", **kwargs)
    with pytest.raises(TopicError, match="one topic level"):
        mon.start_run("a/b", task="t")
    with pytest.raises(ValueError, match="reserved"):
        mon.start_run("_errors", task="t")

    run = mon.start_run("good", task="t")
    bad_steps: list[tuple[tuple[str], dict[str, Any], str]] = [
        (("",), {}, "no text and no images"),
        (("x",), {"index": 0}, "index"),
        (("x",), {"meta": {"v": float("nan")}}, "finite"),
        (("x",), {"images": [b"GIF8 nope"]}, "PNG, JPEG"),
    ]
    for args, kw, message in bad_steps:
        with pytest.raises(ValueError, match=message):
            run.step(*args, **kw)
    with pytest.raises(ValueError, match="outcome"):
        run.end("done")  # type: ignore[arg-type]
    assert not run.ended
    assert run.step("valid") == 1  # failed steps did not use up an index
    run.end()

    msgs = peer.wait(lambda ms: any(m.topic == "agents/good/end" for m in ms))
    assert [m.topic for m in msgs] == ["agents/good/start", "agents/good/step", "agents/good/end"]


def test_run_id_active_twice_is_refused_until_ended(mon: MonitorClient, peer: Peer) -> None:
    run = mon.start_run("dup", task="t")
    with pytest.raises(ValueError, match="already active"):
        mon.start_run("dup", task="t")
    run.end()
    mon.start_run("dup", task="again").end()


# -- what the client reads back --


def test_signal_abort_then_cleared(mon: MonitorClient, peer: Peer) -> None:
    seen: list[SignalOut] = []
    run = mon.start_run("sig", task="t", on_signal=seen.append)
    assert run.signal is None and not run.should_abort and run.best_step is None
    run.step("s1")
    peer.publish("agents/sig/signal", signal("sig", "abort", best_step=1), retain=True)
    got = run.wait_signal("abort", timeout=WAIT)
    assert (
        got.signal == "abort"
        and run.should_abort
        and not run.should_resample
        and run.best_step == 1
    )
    eventually(lambda: len(seen) == 1, what="on_signal called")
    assert seen[0] == got

    peer.publish("agents/sig/signal", b"", retain=True)  # the monitor clears it at run end
    eventually(lambda: run.signal is None, what="signal cleared")
    assert not run.should_abort and run.best_step is None

    peer.publish("agents/sig/signal", signal("sig", "resample", best_step=1), retain=True)
    assert run.wait_signal(timeout=WAIT).signal == "resample" and run.should_resample
    with pytest.raises(TimeoutError, match="abort"):
        run.wait_signal("abort", timeout=0.1)
    run.end()


def test_retained_signal_published_before_start_is_seen(mon: MonitorClient, peer: Peer) -> None:
    peer.publish("agents/early/signal", signal("early", "abort"), retain=True)
    run = mon.start_run("early", task="t")
    # Mosquitto sends the retained signal right after the SUBACK, so it may arrive just after
    # start_run returns.
    assert run.wait_signal("abort", timeout=WAIT).best_step == 2
    assert run.should_abort


def test_subscribed_before_start_is_published(broker: Mosquitto, mon: MonitorClient) -> None:
    # A monitor that answers `start` at once, not retained: only a subscription made before start
    # sees it.
    responder = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=MQTTProtocolVersion.MQTTv311)
    ready = threading.Event()
    responder.on_subscribe = lambda *a: ready.set()

    def answer(c: mqtt.Client, _u: Any, m: mqtt.MQTTMessage) -> None:
        run_id = m.topic.split("/")[1]
        c.publish(f"agents/{run_id}/progress", json.dumps(progress(run_id, 0, 0.0)), qos=1)
        c.publish(f"agents/{run_id}/signal", json.dumps(signal(run_id, "continue", step=0)), qos=1)

    responder.on_message = answer
    responder.connect("127.0.0.1", broker.port)
    responder.subscribe("agents/+/start", qos=1)
    responder.loop_start()
    try:
        assert ready.wait(WAIT)
        for i in range(5):
            run = mon.start_run(f"fast-{i}", task="t")
            assert run.wait_progress(0, timeout=WAIT).step == 0
            assert run.wait_signal("continue", timeout=WAIT).step == 0
            run.end()
    finally:
        responder.disconnect()
        responder.loop_stop()


def test_progress_and_wait_progress(mon: MonitorClient, peer: Peer) -> None:
    seen: list[ProgressOut] = []
    run = mon.start_run("prog", task="t", on_progress=seen.append)
    assert run.progress is None
    with pytest.raises(TimeoutError, match="step 1"):
        run.wait_progress(1, timeout=0.1)
    for i in (1, 2, 3):
        run.step(f"s{i}")
    peer.publish("agents/prog/progress", progress("prog", 1, 0.2))
    assert run.wait_progress(1, timeout=WAIT).score == 0.2
    peer.publish("agents/prog/progress", progress("prog", 3, 0.6))
    peer.publish("agents/prog/progress", progress("prog", 2, 0.4))  # late, out of order
    assert run.wait_progress(2, timeout=WAIT).step == 3  # the furthest step seen
    eventually(lambda: run.progress is not None and run.progress.step == 2, what="latest progress")
    assert run.wait_progress(3, timeout=WAIT).score == 0.6
    eventually(lambda: [p.step for p in seen] == [1, 3, 2], what="on_progress calls")
    run.end()


def test_errors_are_collected(mon: MonitorClient, peer: Peer) -> None:
    run = mon.start_run("errs", task="t")
    err = ErrorOut(
        run_id="errs", topic="agents/errs/step", reason="invalid", error="step: index is required"
    )
    peer.publish("agents/errs/error", err.model_dump())
    eventually(lambda: run.errors == [err], what="error collected")
    run.end()


def test_malformed_and_foreign_messages_are_ignored(mon: MonitorClient, peer: Peer) -> None:
    calls: list[SignalOut] = []

    def boom(s: SignalOut) -> None:
        calls.append(s)
        raise RuntimeError("harness callback bug")

    run = mon.start_run("robust", task="t", on_signal=boom)
    peer.publish("agents/robust/signal", b"{not json")
    peer.publish(
        "agents/robust/signal", {"run_id": "robust", "signal": "explode", "reason": "", "step": 1}
    )
    peer.publish("agents/robust/signal", signal("someone-else", "abort"))
    peer.publish("agents/robust/progress", b"\xff\xfe")
    peer.publish("agents/robust/error", {"topic": "x", "reason": "Not A Code", "error": "e"})
    peer.publish("agents/robust/whatever", b"{}")
    peer.publish("agents/robust/signal", signal("robust", "abort"))
    # after the callback raised once
    peer.publish("agents/robust/signal", signal("robust", "resample"))
    assert run.wait_signal("resample", timeout=WAIT).signal == "resample"
    assert run.progress is None and run.errors == []
    eventually(lambda: [c.signal for c in calls] == ["abort", "resample"], what="callbacks")
    run.end()


def test_callbacks_may_step_but_not_wait(mon: MonitorClient, peer: Peer) -> None:
    outcomes: list[object] = []

    def on_signal(s: SignalOut) -> None:
        outcomes.append(run.step(f"reacting to {s.signal}"))
        try:
            run.wait_progress(1, timeout=1)
        except RuntimeError as e:
            outcomes.append(str(e))

    run = mon.start_run("cb", task="t", on_signal=on_signal)
    peer.publish("agents/cb/signal", signal("cb", "resample"))
    peer.wait(lambda ms: any(m.topic == "agents/cb/step" for m in ms))
    eventually(lambda: len(outcomes) == 2, what="callback finished")
    assert outcomes[0] == 1 and "deadlock" in str(outcomes[1])
    run.end()


# -- connection trouble --


def test_broker_down_raises_connection_error_naming_the_url() -> None:
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"mqtt://127\.0\.0\.1:{port}"):
        MonitorClient(f"mqtt://127.0.0.1:{port}", connect_timeout=3)
    assert time.monotonic() - t0 < 3.5


def test_stopped_broker_raises_connection_error(broker: Mosquitto) -> None:
    broker.stop()
    with pytest.raises(
        ConnectionError, match=re.escape(f"cannot connect to the MQTT broker at {broker.url}")
    ):
        MonitorClient(broker.url, connect_timeout=2)


def test_refused_connection_says_why(tmp_path: Path) -> None:
    auth = Mosquitto(tmp_path / "auth")
    auth.conf.write_text(
        auth.conf.read_text().replace("allow_anonymous true", "allow_anonymous false")
    )
    auth.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match=r"refused the connection: Not authorized"):
            MonitorClient(auth.url, username="nobody", password="wrong", connect_timeout=5)
        assert time.monotonic() - t0 < 4
    finally:
        auth.stop()


def test_server_that_never_answers_times_out() -> None:
    with socket.socket() as silent:  # the kernel accepts the TCP connection; nothing ever replies
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(
            ConnectionError,
            match=rf"127\.0\.0\.1:{port} did not answer \(no " r"CONNACK\) within 0\.5s",
        ):
            MonitorClient(f"mqtt://127.0.0.1:{port}", connect_timeout=0.5)
        assert time.monotonic() - t0 < 2


def test_bad_url_and_prefix_are_value_errors() -> None:
    with pytest.raises(ValueError, match="scheme"):
        MonitorClient("http://127.0.0.1:1883")
    with pytest.raises(ValueError, match="prefix"):
        MonitorClient("mqtt://127.0.0.1:1", prefix="a/+/b")


def test_custom_prefix(broker: Mosquitto) -> None:
    peer = Peer(broker.port, ("lab/agents/#",))
    try:
        with MonitorClient(broker.url, prefix="lab/agents") as mon:
            run = mon.start_run("p1", task="t")
            run.step("s")
            peer.publish("lab/agents/p1/signal", signal("p1", "abort"), retain=True)
            assert run.wait_signal("abort", timeout=WAIT).run_id == "p1"
            run.end()
        msgs = peer.wait(lambda ms: any(m.topic == "lab/agents/p1/end" for m in ms))
        assert [m.topic for m in msgs if not m.topic.endswith("signal")][:3] == [
            "lab/agents/p1/start",
            "lab/agents/p1/step",
            "lab/agents/p1/end",
        ]
    finally:
        peer.close()


def test_broker_restart_mid_run_delivers_every_step(broker: Mosquitto) -> None:
    # A persistent subscriber (fixed id, clean_session=False, QoS 1), like the monitor daemon.
    sub = Peer(
        broker.port,
        ("agents/+/step", "agents/+/end"),
        client_id="test-persistent-monitor",
        clean=False,
    )
    signaller = None
    try:
        with MonitorClient(broker.url, connect_timeout=5, ack_timeout=15) as mon:
            run = mon.start_run("restart", task="t")
            for i in range(1, 4):
                run.step(f"before {i}")
            sub.wait(lambda ms: len(ms) >= 3)

            broker.stop()
            assert (broker.workdir / "mosquitto.db").is_file(), (
                "the broker did not save its sessions"
            )
            eventually(lambda: not mon.connected, what="client noticed the broker is down")
            for i in range(4, 7):
                assert run.step(f"while down {i}") == i  # queued by paho, no exception
            broker.start()
            for i in range(7, 10):
                run.step(f"after {i}")  # possibly still down: queued too
            eventually(lambda: mon.connected, timeout=20, what="client reconnected")

            # The run's subscriptions were renewed on the new connection.
            signaller = Peer(broker.port, ("unused/none",))
            signaller.publish(
                "agents/restart/signal", signal("restart", "abort", step=9), retain=True
            )
            assert run.wait_signal("abort", timeout=WAIT).step == 9
            run.end("failure")

        msgs = sub.wait(lambda ms: any(m.topic.endswith("/end") for m in ms), timeout=20)
        indices = [json.loads(m.payload)["index"] for m in msgs if m.topic == "agents/restart/step"]
        # QoS 1 is at-least-once: a step in flight at the restart may arrive twice (the index makes
        # it idempotent).
        assert sorted(set(indices)) == list(range(1, 10))
        assert all(m.qos == 1 for m in msgs)
    finally:
        sub.close()
        if signaller is not None:
            signaller.close()


def test_close_waits_for_unacknowledged_steps(mon: MonitorClient, peer: Peer) -> None:
    run = mon.start_run("flush", task="t")
    for i in range(200):
        run.step(f"step {i}", images=[png()] if i % 50 == 0 else ())
    mon.close()
    mon.close()  # idempotent
    msgs = peer.wait(lambda ms: len([m for m in ms if m.topic == "agents/flush/step"]) == 200)
    assert [json.loads(m.payload)["index"] for m in msgs if m.topic == "agents/flush/step"] == list(
        range(1, 201)
    )
    with pytest.raises(RuntimeError, match="closed"):
        mon.start_run("after-close", task="t")
    with pytest.raises(RuntimeError, match="closed"):
        run.step("after close")


def test_run_repr_and_client_state(mon: MonitorClient, peer: Peer) -> None:
    assert mon.connected and "connected=True" in repr(mon)
    run: Run = mon.start_run("r", task="t")
    run.step("x")
    assert "next_index=2" in repr(run)
    run.end()

"""Restart defects, black-box: a real daemon on a private Mosquitto is SIGKILLed and restarted with
the same --state-dir and --client-id, and the test checks what a harness then sees over MQTT and in
`agent-monitor export`.

The daemon runs only as a subprocess through its CLI (`python -m agent_monitor serve|export`), or
through tests/crash_points.py (the one fault-injection wrapper, which patches internals). The
harness is plain paho-mqtt at QoS 1; the judge is a scripted OpenAI-compatible server that records
every prompt it is sent. Nothing here imports agent_monitor.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

from tests.brokers import Mosquitto
from tests.openai_server import ScriptedServer, chat_choice, chat_reply, scripted_server
from tests.paths import REPO, TESTS

pytestmark = pytest.mark.timeout(300)

ROOT = REPO
CRASH_POINTS = TESTS / "crash_points.py"


# -- the pieces: judge, daemon, harness, CLI --


@pytest.fixture
def judge() -> Iterator[ScriptedServer]:
    """A scripted judge that grades every prompt "J" and keeps every request (`judge.requests`)."""
    with scripted_server() as server:
        server.default = chat_reply(chat_choice([("J", {"J": 1.0})]))
        yield server


def prompts(judge: ScriptedServer) -> list[str]:
    """Every request the judge received so far, as JSON text (the step texts appear in it
    verbatim)."""
    return [json.dumps(body) for body in list(judge.requests)]


class Daemon:
    """`agent-monitor serve` as a subprocess: one log file per life, SIGKILL and restart with the
    same state."""

    def __init__(
        self, tmp: Path, broker: Mosquitto, judge: ScriptedServer, flags: Iterable[str]
    ) -> None:
        self.tmp = tmp
        self.state = tmp / "state"
        self.args = [
            "serve",
            "--broker",
            broker.url,
            "--judge",
            "openai",
            "--judge-url",
            judge.url,
            "--judge-model",
            "m",
            "--metrics-port",
            "0",
            "--state-dir",
            str(self.state),
            "--client-id",
            "restart-monitor",
            *flags,
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.lives = 0

    def start(self, *, crash: tuple[str, str] | None = None) -> None:
        """Start a life and wait until it serves; `crash=(point, text)` runs it under
        tests/crash_points.py."""
        self.lives += 1
        log = self.tmp / f"daemon-{self.lives}.log"
        cmd = (
            [sys.executable, str(CRASH_POINTS), *crash]
            if crash
            else [sys.executable, "-m", "agent_monitor"]
        )
        with log.open("wb") as err:
            self.proc = subprocess.Popen(
                [*cmd, *self.args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err
            )
        deadline = time.monotonic() + 60
        while "agent-monitor: serving" not in log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the daemon did not start: {log.read_text(errors='replace')}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: no shutdown, and nothing it has not acknowledged yet is acknowledged."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(15)

    def wait_exit(self, timeout: float) -> int | None:
        """The exit code once the process has ended, or None if it is still running after
        `timeout`."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """SIGTERM (a clean shutdown) if still running."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture
def make_daemon(
    tmp_path: Path, broker: Mosquitto, judge: ScriptedServer
) -> Iterator[Callable[..., Daemon]]:
    """Build a Daemon with extra serve flags; every one is stopped at the end of the test."""
    made: list[Daemon] = []

    def make(*flags: str) -> Daemon:
        made.append(Daemon(tmp_path, broker, judge, flags))
        return made[-1]

    yield make
    for d in made:
        d.stop()


@dataclass(frozen=True)
class Out:
    """One message the monitor published: run id, kind (`progress`, `error`, `signal`), JSON body
    (None if empty)."""

    run_id: str | None
    kind: str
    body: Any


class Harness:
    """The harness side, plain paho-mqtt: publishes inputs at QoS 1 and records every monitor
    output in order."""

    def __init__(self, port: int) -> None:
        self.outs: list[Out] = []
        self._cond = threading.Condition()
        subscribed = threading.Event()
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"harness-{uuid.uuid4().hex[:8]}",
            protocol=MQTTProtocolVersion.MQTTv311,
        )
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *a: subscribed.set()
        self.client.connect("127.0.0.1", port)
        self.client.subscribe([(f"agents/+/{kind}", 1) for kind in ("progress", "error", "signal")])
        self.client.loop_start()
        if not subscribed.wait(10):
            raise TimeoutError("no SUBACK from the broker")

    def _on_message(self, client: Any, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        _, run_id, kind = msg.topic.split("/")
        out = Out(
            None if run_id == "_errors" else run_id,
            kind,
            json.loads(msg.payload) if msg.payload else None,
        )
        with self._cond:
            self.outs.append(out)
            self._cond.notify_all()

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()

    def send(self, run_id: str, kind: str, body: dict[str, Any]) -> None:
        """Publish one input and wait for the broker's PUBACK."""
        self.send_many(run_id, kind, [body])

    def send_many(self, run_id: str, kind: str, bodies: Iterable[dict[str, Any]]) -> None:
        """Publish inputs in order (paho keeps at most 20 in flight) and wait until the broker
        has them all."""
        infos = [
            self.client.publish(f"agents/{run_id}/{kind}", json.dumps(b), qos=1) for b in bodies
        ]
        for info in infos:
            info.wait_for_publish(30)
            assert info.is_published(), f"the broker did not take agents/{run_id}/{kind}"

    def mark(self) -> int:
        """A position in the record: `since=` for the waits and queries below."""
        with self._cond:
            return len(self.outs)

    def wait(self, pred: Callable[[Out], bool], timeout: float = 30, since: int = 0) -> Out | None:
        """The first output from `since` on that satisfies `pred`, waiting up to `timeout` s;
        None if none came."""
        deadline, i = time.monotonic() + timeout, since
        with self._cond:
            while True:
                for out in self.outs[i:]:
                    if pred(out):
                        return out
                i = len(self.outs)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def wait_progress(
        self, run_id: str, step: int, timeout: float = 30, since: int = 0
    ) -> Out | None:
        """Progress for `run_id` covering step `step` (or a later one: scores coalesce)."""
        return self.wait(
            lambda o: o.run_id == run_id and o.kind == "progress" and o.body["step"] >= step,
            timeout,
            since,
        )

    def wait_error(
        self, run_id: str, reason: str, timeout: float = 30, since: int = 0
    ) -> Out | None:
        """An error with `reason` for `run_id`."""
        return self.wait(
            lambda o: o.run_id == run_id and o.kind == "error" and o.body["reason"] == reason,
            timeout,
            since,
        )

    def progress(self, run_id: str, since: int = 0) -> list[int]:
        """The step numbers of the progress published for `run_id`, in order."""
        with self._cond:
            outs = self.outs[since:]
        return [o.body["step"] for o in outs if o.run_id == run_id and o.kind == "progress"]

    def errors(self, run_id: str, since: int = 0) -> list[str]:
        """The errors published for `run_id`, as "reason: message"."""
        with self._cond:
            outs = self.outs[since:]
        return [
            f"{o.body['reason']}: {o.body['error']}"
            for o in outs
            if o.run_id == run_id and o.kind == "error"
        ]


@pytest.fixture
def harness(broker: Mosquitto) -> Iterator[Harness]:
    """A harness connected to the test's broker, subscribed to every run's progress, error and
    signal."""
    h = Harness(broker.port)
    yield h
    h.close()


def export(state: Path, run_id: str) -> dict[str, Any] | None:
    """`agent-monitor export RUN_ID --state-dir STATE` as JSON, or None when the store has no
    such run."""
    out = subprocess.run(
        [sys.executable, "-m", "agent_monitor", "export", run_id, "--state-dir", str(state)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return json.loads(out.stdout) if out.returncode == 0 else None


def wait_until(check: Callable[[], bool], timeout: float = 30, what: str = "condition") -> None:
    """Poll `check` (a CLI read of the store) until it holds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def spans(numbers: Iterable[int]) -> str:
    """1,2,3,7,9,10 -> "1..3, 7, 9..10" (for readable failure messages)."""
    out: list[list[int]] = []
    for n in sorted(numbers):
        if out and n == out[-1][1] + 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in out) or "none"


# -- 1. gap fills --


def said(i: int) -> str:
    """Step i's text: unique, and never a substring of another step's."""
    return f"[s{i}] said {i}"


def test_gap_fill_survives_restart(
    make_daemon: Callable[..., Daemon], harness: Harness, judge: ScriptedServer
) -> None:
    """Defect 1: gap fills are not journaled, so after a restart every step behind the filled gap
    is held again."""
    d, h, run = make_daemon("--hold", "1"), harness, "gap"
    d.start()
    h.send(run, "start", {"task": "Count to 1102, one step at a time."})
    h.send(run, "step", {"index": 1, "text": said(1)})
    assert h.wait_progress(run, 1)
    # Step 2 never comes: 3..500 wait for it for --hold, then step 2 becomes a placeholder (and an
    # error says so).
    h.send_many(run, "step", ({"index": i, "text": said(i)} for i in range(3, 501)))
    assert h.wait_error(run, "step_gap"), "no step_gap error for the missing step 2"
    assert h.wait_progress(run, 500, timeout=60)
    # Paced: each batch of 100 is scored before the next goes out, so no queue anywhere overflows.
    for first in range(501, 1101, 100):
        h.send_many(run, "step", ({"index": i, "text": said(i)} for i in range(first, first + 100)))
        assert h.wait_progress(run, first + 99, timeout=60)
    # The store has the score of step 1100 too (so a restart has nothing left to score).
    wait_until(
        lambda: (export(d.state, run) or {}).get("curve", [{}])[-1].get("step") == 1100,
        what="stored score",
    )

    d.kill()
    restart = h.mark()
    d.start()
    h.send(run, "step", {"index": 1101, "text": said(1101)})
    got_1101 = h.wait_progress(run, 1101, timeout=10, since=restart)
    h.send(run, "step", {"index": 1102, "text": said(1102)})
    got_1102 = h.wait_progress(run, 1102, timeout=20, since=restart)
    d.stop()

    after, errors = h.progress(run, since=restart), h.errors(run, since=restart)
    seen = f"after the restart: progress for steps {after}, errors {errors}"
    assert not errors, seen
    assert after == sorted(after) and all(s >= 1100 for s in after), (
        f"progress went backwards; {seen}"
    )
    assert got_1101 is not None and got_1102 is not None, seen
    # The judge saw every step the harness sent (1, 3..1102), not placeholders, in the prompt scored
    # for 1102.
    last = [p for p in prompts(judge) if said(1102) in p][-1]
    missing = [i for i in (1, *range(3, 1103)) if said(i) not in last]
    assert not missing, (
        f"the prompt scored for step 1102 lacks the harness's steps {spans(missing)}"
    )
    steps = export(d.state, run)["steps"]  # type: ignore[index]
    indexes = [s["index"] for s in steps]
    assert indexes == list(range(1, 1103)), (
        f"export has {len(steps)} steps, indexes {spans(indexes)}"
    )
    gap = steps[1]
    assert gap.get("placeholder") is True or "not received" in gap["text"], (
        f"step 2 exported as a real step: {gap}"
    )
    wrong = [
        s["index"]
        for s in steps
        if s["index"] != 2 and (s["text"] != said(s["index"]) or s.get("placeholder"))
    ]
    assert not wrong, f"exported steps {spans(wrong)} are not the harness's"


# -- 2. eviction after a restart --


def answered(run_id: str, step: int) -> Callable[[Out], bool]:
    """Progress covering `step` of `run_id`, or any error for it: the monitor has dealt with the
    step."""
    return lambda o: (
        o.run_id == run_id
        and (o.kind == "error" or (o.kind == "progress" and o.body["step"] >= step))
    )


def test_restart_keeps_last_activity_for_eviction(
    make_daemon: Callable[..., Daemon], harness: Harness
) -> None:
    """Defect 2: restore stamps each run's last activity with its replay time, so the busiest run
    can be evicted."""
    d, h = make_daemon("--hold", "2", "--max-runs", "3"), harness
    d.start()
    for run in ("busy", "idle1", "idle2"):  # busy starts first
        h.send(run, "start", {"task": f"The task of {run}."})
    for run in ("idle1", "idle2"):  # one step each, then quiet
        h.send(run, "step", {"index": 1, "text": f"{run} did one thing"})
        assert h.wait_progress(run, 1)
    n, until = 0, time.monotonic() + 2.0
    while time.monotonic() < until:  # busy steps every ~0.3 s
        n += 1
        h.send("busy", "step", {"index": n, "text": f"busy step {n}"})
        assert h.wait_progress("busy", n)
        time.sleep(0.3)

    d.kill()
    first = h.mark()
    d.start()
    # The first start after the restart comes before busy's next step (busy steps every 0.3 s, a new
    # run at any time).
    h.send("newcomer", "start", {"task": "The task of newcomer."})
    evicted = h.wait(
        lambda o: o.kind == "error" and o.body["reason"] == "evicted", timeout=15, since=first
    )
    n += 1
    sent = h.mark()
    h.send("busy", "step", {"index": n, "text": f"busy step {n}"})
    h.wait(answered("busy", n), timeout=15, since=sent)

    d.kill()  # and once more: busy is still a live run of the store
    second = h.mark()
    d.start()
    n += 1
    h.send("busy", "step", {"index": n, "text": f"busy step {n}"})
    h.wait(answered("busy", n), timeout=15, since=second)
    d.stop()

    who = evicted.run_id if evicted else None
    busy_errors = h.errors("busy", since=first)
    seen = f"busy's errors after the first restart: {busy_errors}"
    assert who in ("idle1", "idle2"), (
        f"the first start after the restart evicted {who!r}, not an idle run; {seen}"
    )
    assert not busy_errors, (
        f"busy (stepping until the crash) got errors after the restart: {busy_errors}"
    )
    assert h.progress("busy", since=first)[-1:] == [n], (
        f"busy's progress after the restarts: {h.progress('busy', first)}"
    )


# -- 3. steps without index, crash between journal and ack --


def count_through_crash(
    d: Daemon, h: Harness, point: str, crash_text: str
) -> tuple[list[tuple[int, str]], int]:
    """Publish unindexed steps s1..s12 one by one; the daemon dies at `point` of `crash_text`, is
    restarted, and the harness goes on. Returns the exported (index, text) pairs and the last
    progress step."""
    run = "count"
    d.start(crash=(point, crash_text))
    h.send(run, "start", {"task": "Say s1 to s12, one step at a time."})
    for i in range(1, 13):
        h.send(run, "step", {"text": f"s{i}"})  # no index: the monitor numbers it
        if f"s{i}" == crash_text:
            assert d.wait_exit(20) == -signal.SIGKILL, (
                f"the daemon did not crash {point} {crash_text}"
            )
            d.start()  # same state dir and client id: the broker delivers what was not acknowledged
        assert h.wait_progress(run, i), f"no progress for step {i}"
    d.stop()
    exported = export(d.state, run)
    assert exported is not None
    return [(s["index"], s["text"]) for s in exported["steps"]], h.progress(run)[-1]


@pytest.mark.parametrize("crash_text", ["s2", "s4", "s5", "s7", "s9"])
def test_unindexed_step_crash_after_journal(
    crash_text: str, make_daemon: Callable[..., Daemon], harness: Harness
) -> None:
    """Defect 3: a step without index journaled but not acknowledged when the daemon dies is
    appended twice."""
    steps, last = count_through_crash(make_daemon(), harness, "after-journal", crash_text)
    listed = " ".join(f"{i}:{text}" for i, text in steps)
    assert steps == [(i, f"s{i}") for i in range(1, 13)], (
        f"crash after journaling {crash_text}; export: {listed}"
    )
    assert last == 12, f"the last progress is for step {last}"


def test_unindexed_step_crash_before_journal_control(
    make_daemon: Callable[..., Daemon], harness: Harness
) -> None:
    """Control for defect 3 (passes today): a crash before journaling an unindexed step loses and
    doubles nothing."""
    steps, last = count_through_crash(make_daemon(), harness, "before-journal", "s5")
    assert steps == [(i, f"s{i}") for i in range(1, 13)]
    assert last == 12


# -- 4. refused events in the journal --


def test_orphan_step_not_reported_again_after_restart(
    make_daemon: Callable[..., Daemon], harness: Harness
) -> None:
    """Defect 4a: a step refused `no_start` stays in the journal and its no_start error comes
    again on every restart."""
    d, h = make_daemon("--hold", "1"), harness
    d.start()
    h.send("ghost", "step", {"index": 1, "text": "a step of a run that never starts"})
    assert h.wait_error("ghost", "no_start"), "no no_start error for ghost"
    d.kill()
    restart = h.mark()
    d.start()
    # A barrier instead of a sleep: a new orphan's no_start comes --hold after it arrived, after
    # ghost's would have.
    h.send("marker", "step", {"index": 1, "text": "another run that never starts"})
    assert h.wait_error("marker", "no_start", since=restart), "no no_start error for marker"
    d.stop()
    again = h.errors("ghost", since=restart)
    assert not again, f"ghost's step was refused before the restart, and after it again: {again}"


def test_step_refused_no_start_not_attached_after_restart(
    make_daemon: Callable[..., Daemon], harness: Harness, judge: ScriptedServer
) -> None:
    """Defect 4b: a step refused `no_start` becomes the run's step after a restart when the start
    came late."""
    d, h, run = make_daemon("--hold", "1", "--max-concurrency", "1"), harness, "late"
    d.start()
    early = "EARLY: sent before the start, refused no_start"
    h.send(run, "step", {"index": 1, "text": early})
    assert h.wait_error(run, "no_start"), "no no_start error for the early step"
    h.send(run, "start", {"task": "A run whose start came late."})
    wait_until(lambda: export(d.state, run) is not None, what="the start in the store")
    d.kill()
    restart = h.mark()
    d.start()
    # A barrier instead of a sleep: with one scorer, whatever the restored run had to score is
    # published before the first score of a run started now.
    h.send("probe", "start", {"task": "A run started after the restart."})
    h.send("probe", "step", {"index": 1, "text": "probe step"})
    assert h.wait_progress("probe", 1, since=restart)
    unasked = h.progress(run, since=restart)
    resent = "step 1, sent again after the start"
    sent = h.mark()
    h.send(run, "step", {"index": 1, "text": resent})
    scored = h.wait_progress(run, 1, timeout=15, since=sent)
    d.stop()

    steps = [(s["index"], s["text"]) for s in export(d.state, run)["steps"]]  # type: ignore[index]
    seen = (
        f"exported steps of {run}: {steps}; progress for {run} before it sent a step after "
        f"the restart: {unasked}"
    )
    assert steps == [(1, resent)], seen
    judged = [p for p in prompts(judge) if early in p]
    assert not judged, f"the judge was asked to grade the refused step {len(judged)} time(s)"
    assert not unasked, f"progress before the harness sent any step after the start: {unasked}"
    assert scored is not None, "no progress for the step sent after the start"


def test_step_refused_index_too_far_not_exported(
    make_daemon: Callable[..., Daemon], harness: Harness
) -> None:
    """Defect 4c: a step refused `index_too_far` is journaled anyway and `export` lists it,
    before and after a restart."""
    d, h, run = make_daemon("--hold", "1"), harness, "far"
    d.start()
    h.send(run, "start", {"task": "A run with one step from far ahead."})
    h.send(run, "step", {"index": 1, "text": "one"})
    assert h.wait_progress(run, 1)
    h.send(run, "step", {"index": 5000, "text": "FAR: refused index_too_far"})
    assert h.wait_error(run, "index_too_far"), "no index_too_far error for index 5000"
    before = [(s["index"], s["text"]) for s in export(d.state, run)["steps"]]  # type: ignore[index]
    d.kill()
    restart = h.mark()
    d.start()
    h.send(run, "step", {"index": 2, "text": "two"})
    assert h.wait_progress(run, 2, since=restart)
    d.stop()
    after = [(s["index"], s["text"]) for s in export(d.state, run)["steps"]]  # type: ignore[index]

    assert (before, after) == ([(1, "one")], [(1, "one"), (2, "two")]), (
        f"export before: {before}; after: {after}"
    )

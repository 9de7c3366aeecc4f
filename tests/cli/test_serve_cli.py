"""`agent-monitor serve` as a user runs it: a subprocess, a real broker, a real OpenAI-compatible
HTTP judge.

The harness side here is only `mosquitto_pub` / `mosquitto_sub`, as in README: no project code.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.brokers import Mosquitto, free_port, wait_port
from tests.openai_server import chat_choice, chat_reply, scripted_server

pytestmark = pytest.mark.timeout(120)


@contextmanager
def serve(*args: str, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[str]]:
    """Run `agent-monitor serve ARGS` until the block ends (SIGTERM, then wait)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent_monitor", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Each daemon gets its own run store unless the test shares one (restart tests).
        env={
            **os.environ,
            "AGENT_MONITOR_LOG_LEVEL": "info",
            "AGENT_MONITOR_STATE_DIR": tempfile.mkdtemp(prefix="agent-monitor-state-"),
            **(env or {}),
        },
    )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_serving(proc: subprocess.Popen[str], timeout: float = 30.0) -> list[str]:
    """Read stderr until the 'serving' line; return the lines read (fail with them if the process
    exits)."""
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise AssertionError(f"serve exited ({proc.wait()}): {''.join(lines)}")
        lines.append(line)
        if line.startswith("agent-monitor: serving"):
            return lines
    raise AssertionError(f"serve did not come up: {''.join(lines)}")


def pub(port: int, topic: str, payload: str, *extra: str) -> None:
    subprocess.run(
        ["mosquitto_pub", "-p", str(port), "-q", "1", "-t", topic, "-m", payload, *extra],
        check=True,
    )


def sub(port: int, topic: str, count: int, timeout: int = 20, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            "mosquitto_sub",
            "-p",
            str(port),
            "-q",
            "1",
            "-t",
            topic,
            "-C",
            str(count),
            "-W",
            str(timeout),
            "-v",
            *extra,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )


def lines_of(proc: subprocess.Popen[str]) -> list[tuple[str, dict[str, object]]]:
    out, _ = proc.communicate(timeout=30)
    result = []
    for line in out.splitlines():
        topic, _, payload = line.partition(" ")
        result.append((topic, json.loads(payload) if payload else {}))
    return result


def test_mosquitto_only_harness_gets_progress_and_abort(broker: Mosquitto) -> None:
    with scripted_server() as judge:
        # The judge thinks the run is barely started, every time: B ~ 5%.
        judge.default = chat_reply(chat_choice([("B", {"B": 0.9, "C": 0.1})]))
        with serve(
            "--broker",
            broker.url,
            "--judge",
            "openai",
            "--judge-url",
            judge.url,
            "--abort-below",
            "0.2",
            "--min-steps",
            "2",
            "--patience",
            "2",
            "--metrics-port",
            "0",
        ) as proc:
            wait_serving(proc)
            # The harness as README shows it: one mosquitto_sub on the run's outputs, mosquitto_pub
            # for inputs.
            with Watch(broker.port, "agents/demo-1/#") as out:
                pub(broker.port, "agents/demo-1/start", '{"task": "Make the failing test pass"}')
                # a harness that waits for each step's score (no coalescing here)
                for i in range(1, 4):
                    pub(
                        broker.port,
                        "agents/demo-1/step",
                        json.dumps({"index": i, "text": f"pytest: 3 failed ({i})"}),
                    )
                    out.until(lambda m, i=i: m[0] == "agents/demo-1/progress" and m[1]["step"] == i)
                _, sig = out.until(lambda m: m[0] == "agents/demo-1/signal")
                pub(broker.port, "agents/demo-1/step", "not json")
                _, err = out.until(lambda m: m[0] == "agents/demo-1/error")
            progress = [p for t, p in out.seen if t.endswith("/progress")]
            assert [p["step"] for p in progress] == [1, 2, 3]
            assert all(
                p["ok"] and abs(p["score"] - (0.9 * 1 + 0.1 * 2) / 19) < 1e-6 for p in progress
            )
            assert (
                progress[0]["model"] == "scripted-model" and progress[0]["tokens"]["input"] == 100
            )
            assert sig["signal"] == "abort" and sig["step"] == 3 and sig["best_step"] == 1
            assert err["reason"] == "bad_json"  # the bad payload is reported; the monitor goes on
            assert proc.poll() is None


class Watch:
    """`mosquitto_sub -v` on a filter, its lines parsed as they come (topic, JSON, raw text or
    None)."""

    def __init__(self, port: int, topic_filter: str) -> None:
        self.proc = subprocess.Popen(
            ["mosquitto_sub", "-p", str(port), "-q", "1", "-t", topic_filter, "-v"],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[tuple[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()
        time.sleep(0.3)  # mosquitto_sub gives no sign that it has subscribed

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def until(
        self, match: Callable[[tuple[str, Any]], bool], timeout: float = 20.0
    ) -> tuple[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"no matching message within {timeout}s; saw {self.seen}"
                ) from None
            topic, _, payload = line.partition(" ")
            try:
                m = (topic, json.loads(payload) if payload else None)
            except ValueError:
                # the filter also shows the harness's own inputs, bad ones included
                m = (topic, payload)
            self.seen.append(m)
            if match(m):
                return m

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait()


def test_serve_without_judge_or_broker_fails_with_one_line(
    tmp_path: Path, broker: Mosquitto
) -> None:
    no_judge = subprocess.run(
        [sys.executable, "-m", "agent_monitor", "serve", "--metrics-port", "0"],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("AGENT_MONITOR")},
    )
    assert no_judge.returncode == 2 and "no judge chosen" in no_judge.stderr
    assert len(no_judge.stderr.strip().splitlines()) == 1
    with scripted_server() as judge:
        port = free_port()
        down = subprocess.run(
            [
                sys.executable,
                "-m",
                "agent_monitor",
                "serve",
                "--no-store",
                "--judge",
                "openai",
                "--judge-url",
                judge.url,
                "--broker",
                f"mqtt://127.0.0.1:{port}",
                "--metrics-port",
                "0",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert down.returncode == 2
    assert f"cannot connect to the MQTT broker at mqtt://127.0.0.1:{port}" in down.stderr
    assert "is the broker running" in down.stderr and len(down.stderr.strip().splitlines()) == 1
    dead_url = f"http://127.0.0.1:{free_port()}/v1"
    dead_judge = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent_monitor",
            "serve",
            "--no-store",
            "--judge",
            "openai",
            "--judge-url",
            dead_url,
            "--broker",
            broker.url,
            "--metrics-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        dead_judge.returncode == 2
        and f"cannot reach the judge server at {dead_url} " in dead_judge.stderr
    )
    assert len(dead_judge.stderr.strip().splitlines()) == 1


def serve_once(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "agent_monitor",
        "serve",
        "--no-store",
        "--metrics-port",
        "0",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_a_missing_broker_is_said_before_the_judge_is_probed_or_loaded() -> None:
    """Both missing: the broker is named (the judge, which may take long to load, was never
    tried)."""
    port, dead_url = free_port(), f"http://127.0.0.1:{free_port()}/v1"
    done = serve_once(
        "--judge", "openai", "--judge-url", dead_url, "--broker", f"mqtt://127.0.0.1:{port}"
    )
    assert done.returncode == 2, done.stderr
    assert f"cannot connect to the MQTT broker at mqtt://127.0.0.1:{port}" in done.stderr
    assert (
        "judge" not in done.stderr.split("--embedded-broker")[0].split(")")[-1]
        and dead_url not in done.stderr
    )
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_dead_judge_url_is_said_at_start_even_with_a_model_given(broker: Mosquitto) -> None:
    dead_url = f"http://127.0.0.1:{free_port()}/v1"
    done = serve_once(
        "--judge", "openai", "--judge-url", dead_url, "--judge-model", "m", "--broker", broker.url
    )
    assert (
        done.returncode == 2 and f"cannot reach the judge server at {dead_url} " in done.stderr
    ), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_embedded_broker_on_a_taken_port_says_how_to_use_that_broker_or_another_port() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        url = f"mqtt://127.0.0.1:{port}"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "agent_monitor",
                "serve",
                "--embedded-broker",
                "--broker",
                url,
                "--judge",
                "openai",
                "--no-store",
                "--metrics-port",
                "0",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(
        f"agent-monitor: cannot start the embedded MQTT broker on mqtt://127.0.0.1:{port}: "
        "the port is already in use "
        f"(another broker running?); to use the broker already there, drop --embedded-broker "
        f"(and keep --broker mqtt://127.0.0.1:{port}); to run the embedded one anyway, move "
        "it to a free port: "
        "--embedded-broker --broker mqtt://127.0.0.1:"
    ), line
    suggested = int(line.rsplit(":", 1)[1].removesuffix(" (free now)"))
    assert suggested != port
    with socket.socket() as s:
        s.bind(("127.0.0.1", suggested))  # it was free


def test_serve_says_where_its_run_store_is_and_what_it_restored(
    broker: Mosquitto, tmp_path: Path
) -> None:
    """A newcomer's `serve` uses the per-user default store: start-up says so, and which runs
    came back from it."""
    xdg = tmp_path / "xdg"
    # no --state-dir: the default store
    env = {"XDG_DATA_HOME": str(xdg), "AGENT_MONITOR_STATE_DIR": ""}
    default = (
        f"agent-monitor: run store {xdg}/agent-monitor/runs.sqlite3 (the default, shared by "
        "every agent-monitor of "
        "this user; --state-dir DIR for another, --no-store for none)"
    )
    with scripted_server() as judge:
        judge.default = chat_reply(chat_choice([("K", {"K": 1.0})]))
        args = (
            "--broker",
            broker.url,
            "--judge",
            "openai",
            "--judge-url",
            judge.url,
            "--metrics-port",
            "0",
        )
        with serve(*args, "--client-id", "store-line", env=env) as proc:
            assert f"{default}: no runs yet\n" in wait_serving(proc)
            progress = sub(broker.port, "agents/+/progress", 2)
            time.sleep(0.3)
            for run in ("run-a", "run-b"):
                pub(broker.port, f"agents/{run}/start", '{"task": "t"}')
                pub(broker.port, f"agents/{run}/step", '{"index": 1, "text": "x"}')
            assert len(lines_of(progress)) == 2
            pub(broker.port, "agents/run-b/end", '{"outcome": "success"}')
            runs: list[dict[str, Any]] = []
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not any(r["ended_at"] for r in runs):
                listed = subprocess.run(
                    [sys.executable, "-m", "agent_monitor", "runs", "--json"],
                    capture_output=True,
                    text=True,
                    env={**os.environ, **env},
                    check=True,
                )
                runs = [json.loads(line) for line in listed.stdout.splitlines()]
            assert {r["run_id"]: bool(r["ended_at"]) for r in runs} == {
                "run-a": False,
                "run-b": True,
            }
        with serve(*args, "--client-id", "store-line", env=env) as proc:
            lines = wait_serving(proc)
            restored = (
                f"{default}: restored 1 live run (run-a), 1 ended (`agent-monitor "
                "runs` lists them)\n"
            )
            assert restored in lines, lines
        state = tmp_path / "own"
        with serve(*args, "--client-id", "store-line-2", "--state-dir", str(state)) as proc:
            own = f"agent-monitor: run store {state}/runs.sqlite3: no runs yet\n"
            assert own in wait_serving(proc)


def test_metrics_served_while_serving(broker: Mosquitto) -> None:
    import urllib.request

    port = free_port()
    with scripted_server() as judge:
        judge.default = chat_reply(chat_choice([("K", {"K": 1.0})]))
        with serve(
            "--broker",
            broker.url,
            "--judge",
            "openai",
            "--judge-url",
            judge.url,
            "--metrics-port",
            str(port),
        ) as proc:
            lines = wait_serving(proc)
            assert lines[-1].rstrip().endswith(f"; board http://127.0.0.1:{port}/"), lines[-1]
            wait_port(port)
            pub(broker.port, "agents/m/start", '{"task": "t"}')
            pub(broker.port, "agents/m/step", '{"text": "x"}')
            deadline = time.monotonic() + 20
            text = ""
            while (
                time.monotonic() < deadline
                and ('agent_monitor_scorings_total{outcome="ok"} 1.0') not in text
            ):
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
                time.sleep(0.1)
            assert 'agent_monitor_scorings_total{outcome="ok"} 1.0' in text
            assert "agent_monitor_runs_active 1.0" in text
            # The same port serves the web board and its snapshot.
            page = urllib.request.urlopen(f"http://127.0.0.1:{port}/").read().decode()
            assert "<title>agent-monitor board</title>" in page
            runs = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/runs").read())
            assert [(r["run_id"], r["step"], r["task"]) for r in runs["runs"]] == [("m", 1, "t")]


def test_no_board_leaves_only_metrics_on_the_port(broker: Mosquitto) -> None:
    import urllib.error
    import urllib.request

    port = free_port()
    with scripted_server() as judge:
        judge.default = chat_reply(chat_choice([("K", {"K": 1.0})]))
        args = (
            "--broker",
            broker.url,
            "--judge",
            "openai",
            "--judge-url",
            judge.url,
            "--metrics-port",
            str(port),
        )
        with serve(*args, "--no-board") as proc:
            lines = wait_serving(proc)
            assert lines[-1].rstrip().endswith(f"; metrics http://127.0.0.1:{port}/metrics"), lines[
                -1
            ]
            wait_port(port)
            assert (
                b"agent_monitor_runs_active"
                in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read()
            )
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/")
            assert e.value.code == 404


def test_embedded_broker_serves_the_client_and_mosquitto_pub() -> None:
    from agent_monitor.wire import MonitorClient

    port = free_port()
    url = f"mqtt://127.0.0.1:{port}"
    with scripted_server() as judge:
        judge.default = chat_reply(chat_choice([("B", {"B": 1.0})]))  # ~5%: hopeless
        with serve(
            "--embedded-broker",
            "--broker",
            url,
            "--judge",
            "openai",
            "--judge-url",
            judge.url,
            "--metrics-port",
            "0",
            "--abort-below",
            "0.2",
            "--min-steps",
            "1",
            "--patience",
            "1",
        ) as proc:
            started = "".join(wait_serving(proc))
            # amqtt refuses v5: the monitor fell back and said so
            assert '"protocol": "3.1.1"' in started
            with MonitorClient(url) as mon:
                run = mon.start_run("emb-1", task="Make the failing test pass")
                run.step("ran pytest: 3 failed")
                assert run.wait_progress(1, timeout=20).score == pytest.approx(1 / 19)
                assert run.wait_signal("abort", timeout=20).step == 1 and run.should_abort
                run.end("failure")
            progress = sub(port, "agents/emb-2/progress", 1)
            time.sleep(0.3)
            pub(port, "agents/emb-2/start", '{"task": "t"}')
            pub(port, "agents/emb-2/step", '{"index": 1, "text": "x"}')
            ((topic, p),) = lines_of(progress)
            assert topic == "agents/emb-2/progress" and p["step"] == 1 and p["ok"] is True
            assert proc.poll() is None
    # Logs are JSON lines on stderr, with the run id bound to everything about a run.
    assert proc.stderr is not None
    logs = [json.loads(line) for line in proc.stderr.read().splitlines() if line.startswith("{")]
    by_event = {(e["event"], e.get("run_id")): e for e in logs}
    assert by_event[("signal", "emb-1")]["signal"] == "abort"
    assert by_event[("run_finished", "emb-1")]["outcome"] == "failure"
    assert ("run_started", "emb-2") in by_event


@pytest.mark.slow
# serve's start (180 s) and the progress waits (120 s): the limit covers the test's own waits
@pytest.mark.timeout(360)
def test_readme_run_it_command_with_the_packaged_local_judge() -> None:
    """README's `agent-monitor serve --embedded-broker --judge local`, with the real Gemma 270M
    and its min_mass."""
    from agent_monitor.wire import MonitorClient

    port = free_port()
    url = f"mqtt://127.0.0.1:{port}"
    with serve(
        "--embedded-broker", "--broker", url, "--judge", "local", "--metrics-port", "0"
    ) as proc:
        started = wait_serving(proc, timeout=180)
        # The tiny judge's own minimum applies, said at start-up with its warning; llama.cpp's log
        # stays out.
        assert "min_mass 0.05" in started[-1]
        assert any(
            '"event": "judge_warning"' in line and "not a real grader" in line for line in started
        )
        assert not any("llama_" in line for line in started), started
        with MonitorClient(url) as mon:
            run = mon.start_run("gemma-1", task="Reverse the string 'abc' in Python and print it.")
            steps = [
                "$ cat rev.py\nprint('abc'[::-1])",
                "$ python rev.py\ncba",
                "Checked: the output is 'cba'. Done.",
            ]
            results = []
            for i, text in enumerate(steps, 1):
                run.step(text)
                results.append(run.wait_progress(i, timeout=120))
            run.end("success")
    assert [p.step for p in results] == [1, 2, 3]
    for p in results:
        # A tiny judge: a score from its letter distribution, or a stated failure; never a silent
        # default.
        assert (p.ok and p.score is not None and 0 <= p.score <= 1) or (
            not p.ok and p.score is None and p.reason
        )
        assert "gemma" in p.model.lower() and p.tokens.input > 0
    assert any(p.ok for p in results)


def test_tune_gc_sets_the_first_generation_threshold_and_zero_keeps_python_s() -> None:
    import gc

    from agent_monitor.daemon import DEFAULT_GC_THRESHOLD, tune_gc

    before = gc.get_threshold()
    try:
        assert tune_gc() == before
        assert gc.get_threshold() == (DEFAULT_GC_THRESHOLD, *before[1:])
        assert tune_gc(0) == (DEFAULT_GC_THRESHOLD, *before[1:])  # 0: left as it is
        assert gc.get_threshold()[0] == DEFAULT_GC_THRESHOLD
        with pytest.raises(ValueError, match="gc threshold -1"):
            tune_gc(-1)
    finally:
        gc.set_threshold(*before)

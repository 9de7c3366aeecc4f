"""Judges that cannot do the job are told at start: no logprobs (refused, or warned), frames not
seen (announced).

The judge is the scripted OpenAI-compatible HTTP server (tests/openai_server.py) set up to answer
without logprobs, as vLLM with --max-logprobs 0 or a proxy that strips them does; `serve` runs as a
user runs it (a subprocess, a private Mosquitto).
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent_monitor.cli._main import announce_frames
from agent_monitor.criteria import load_criteria
from agent_monitor.judges.base import FRAMES_NOT_SEEN, JudgeError, JudgeRequest, sees_frames
from agent_monitor.judges.circuit import CircuitJudge
from agent_monitor.judges.openai import OpenAIJudge
from agent_monitor.prompts import Step, build_prompt
from tests.brokers import Mosquitto, free_port, wait_port
from tests.cli.test_serve_cli import pub, serve, wait_serving
from tests.openai_server import chat_choice, chat_reply, no_logprobs_reply, scripted_server

pytestmark = pytest.mark.timeout(120)

FIX = ("--max-logprobs 20", "n_probs", "--judge-sampled")


def prompt():  # type: ignore[no-untyped-def]
    rubric = load_criteria(None)
    return build_prompt("make the test pass", rubric, [Step(1, "ran pytest")], rubric.criteria[0])


async def test_an_answer_without_logprobs_is_a_failed_call_naming_the_fix() -> None:
    with scripted_server() as server:
        server.default = no_logprobs_reply()
        judge = CircuitJudge(OpenAIJudge(base_url=server.url, model="scripted-model"))
        with pytest.raises(JudgeError) as e:
            await judge.grade(JudgeRequest(prompt()))
        await judge.aclose()
    assert e.value.reason == "no_logprobs" and all(f in str(e.value) for f in FIX)
    stats = judge.statistics()
    # agent_monitor_judge_calls_total{outcome="error"}
    assert stats.calls_ok == 0 and stats.calls_failed == 1
    # the server is up: a setup to fix, not an outage to back off from
    assert judge.state == "closed"


def test_serve_refuses_a_judge_without_logprobs_at_start_naming_the_fix(broker: Mosquitto) -> None:
    with scripted_server() as server:
        server.check = server.default = no_logprobs_reply()
        with serve("--broker", broker.url, "--judge", "openai", "--judge-url", server.url) as proc:
            assert proc.wait(30) == 2
            assert proc.stderr is not None
            err = proc.stderr.read()
        # one scored answer asked for, nothing else
        assert len(server.checks) == 1 and server.requests == []
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"agent-monitor: {server.url} answered without logprobs"), err
    assert all(f in last for f in FIX) and "--judge-check warn" in last


def test_with_judge_check_warn_it_starts_and_counts_each_call_failed(broker: Mosquitto) -> None:
    port = free_port()
    with scripted_server() as server:
        server.check = server.default = no_logprobs_reply()
        args = (
            "--broker",
            broker.url,
            "--judge",
            "openai",
            "--judge-url",
            server.url,
            "--metrics-port",
            str(port),
        )
        with serve(*args, "--judge-check", "warn") as proc:
            lines = wait_serving(proc)
            assert any(
                "warning:" in line and "answered without logprobs" in line for line in lines
            ), lines
            wait_port(port)
            pub(broker.port, "agents/nolp/start", '{"task": "t"}')
            pub(broker.port, "agents/nolp/step", '{"text": "x"}')
            text, deadline = "", time.monotonic() + 20
            while time.monotonic() < deadline and 'reason="no_logprobs"} 1.0' not in text:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
                time.sleep(0.1)
    assert 'agent_monitor_scoring_failures_total{reason="no_logprobs"} 1.0' in text
    assert 'agent_monitor_judge_calls_total{judge="openai",outcome="ok"} 0.0' in text
    assert 'agent_monitor_judge_calls_total{judge="openai",outcome="error"} 1.0' in text


def test_judge_sampled_scores_a_server_without_logprobs(broker: Mosquitto) -> None:
    port = free_port()
    with scripted_server() as server:
        server.check = server.default = no_logprobs_reply("K")
        args = (
            "--broker",
            broker.url,
            "--judge",
            "openai",
            "--judge-url",
            server.url,
            "--metrics-port",
            str(port),
        )
        with serve(*args, "--judge-sampled") as proc:
            wait_serving(proc)
            wait_port(port)
            pub(broker.port, "agents/smp/start", '{"task": "t"}')
            pub(broker.port, "agents/smp/step", '{"text": "x"}')
            text, deadline = "", time.monotonic() + 20
            while (
                time.monotonic() < deadline
                and ('agent_monitor_scorings_total{outcome="ok"} 1.0') not in text
            ):
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
                time.sleep(0.1)
        assert server.checks == []  # sampled letters need no logprobs: nothing to check
    assert 'agent_monitor_scorings_total{outcome="ok"} 1.0' in text


def test_a_server_with_logprobs_passes_the_check_with_one_call(broker: Mosquitto) -> None:
    with scripted_server() as server:
        server.default = chat_reply(chat_choice([("K", {"K": 1.0})]))
        with serve("--broker", broker.url, "--judge", "openai", "--judge-url", server.url) as proc:
            wait_serving(proc)
        assert len(server.checks) == 1


def test_a_judge_that_drops_frames_is_announced_in_stderr_the_log_and_a_metric(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from agent_monitor.judges.llamacpp import LlamaCppJudge

    gguf = tmp_path / "model.gguf"
    # never loaded: a text-only judge is known as such before its model is
    gguf.write_bytes(b"GGUF")
    assert sees_frames(LlamaCppJudge(model_path=str(gguf))) is False
    assert sees_frames(OpenAIJudge(base_url="http://127.0.0.1:1/v1", vision=True)) is True
    # the server says at the first frame
    assert sees_frames(OpenAIJudge(base_url="http://127.0.0.1:1/v1")) is None
    from structlog.testing import capture_logs

    registry = CollectorRegistry()
    with capture_logs() as logs:
        assert (
            announce_frames(OpenAIJudge(base_url="http://127.0.0.1:1/v1", vision=False), registry)
            is False
        )
    assert registry.get_sample_value("agent_monitor_judge_sees_frames") == 0
    assert f"agent-monitor: {FRAMES_NOT_SEEN} (openai, text-only)" in capsys.readouterr().err
    assert [e["event"] for e in logs] == ["judge_drops_frames"]
    seeing = CollectorRegistry()
    announce_frames(OpenAIJudge(base_url="http://127.0.0.1:1/v1", vision=True), seeing)
    assert seeing.get_sample_value("agent_monitor_judge_sees_frames") == 1
    assert FRAMES_NOT_SEEN not in capsys.readouterr().err


async def test_the_demo_says_so_when_its_judge_does_not_see_the_robot_runs_frames(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from agent_monitor.cli._demo import run_demo

    with scripted_server() as server:
        server.default = chat_reply(chat_choice([("K", {"K": 1.0})]))
        judge = OpenAIJudge(base_url=server.url, model="scripted-model", vision=False)
        await run_demo(judge=judge, short=True, out_dir=tmp_path, metrics_port=0, pace_s=0.02)  # type: ignore[arg-type]
        await judge.aclose()
    out = capsys.readouterr().out
    assert f"Note: {FRAMES_NOT_SEEN} (openai, text-only)" in " ".join(out.split())

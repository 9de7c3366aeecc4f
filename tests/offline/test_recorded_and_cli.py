"""Recorded runs (ATIF and plain JSON) and `agent-monitor score` against a real HTTP judge
server."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent_monitor.cli import main
from agent_monitor.offline.recorded import (
    RecordedRunError,
    iter_recorded,
    load_recorded,
    parse_recorded,
)
from tests.brokers import free_port
from tests.openai_server import chat_choice, chat_reply, html_server, scripted_server
from tests.paths import FIXTURES

FIXTURE = FIXTURES / "atif_reverse_string.json"


def test_atif_run_reads_task_agent_steps_outcome() -> None:
    run = load_recorded(FIXTURE)
    assert run.task.startswith("Write rev.py") and run.outcome == 1.0
    assert len(run.steps) == 4
    assert "$ ls" in run.steps[0].text and "Observation:\nREADME.md" in run.steps[0].text
    assert run.steps[0].timestamp is not None and run.steps[3].text == (
        "The function works; the task is complete."
    )


def test_plain_form_and_clipping() -> None:
    run = parse_recorded(
        {"task": "t", "steps": ["a", {"text": "x" * 100}], "outcome": "failure"}, max_step_chars=20
    )
    assert run.outcome == 0.0 and run.steps[0].text == "a"
    assert "characters cut" in run.steps[1].text and run.steps[1].text.startswith("x" * 10)


def test_unreadable_runs_get_clear_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(RecordedRunError, match="expected a JSON object"):
        load_recorded(bad)
    with pytest.raises(RecordedRunError, match="no task text"):
        parse_recorded({"steps": ["a"]})
    with pytest.raises(RecordedRunError, match="neither ATIF"):
        parse_recorded({"foo": 1})
    (tmp_path / "nested").mkdir()
    (tmp_path / "nested" / FIXTURE.name).write_bytes(FIXTURE.read_bytes())
    bad.unlink()
    # folders are searched recursively
    assert [r.name for r in iter_recorded(tmp_path)] == ["atif_reverse_string"]


def test_score_command_prints_a_curve(capsys: pytest.CaptureFixture[str]) -> None:
    with scripted_server() as server:
        server.default = chat_reply(chat_choice([("K", {"K": 0.5, "M": 0.5})]))
        code = main(
            ["score", str(FIXTURE), "--judge", "openai", "--judge-url", server.url], environ={}
        )
        out = capsys.readouterr().out
        assert code == 0, out
        assert len(server.requests) == 4 and server.requests[0]["model"] == "scripted-model"
        assert out.count("0.579") == 4  # (10 + 12) / 2 / 19
        assert "4 calls, 0 failed" in out
        code = main(
            ["score", str(FIXTURE), "--json", "--max-steps", "2"],
            environ={"AGENT_MONITOR_JUDGE": "openai", "AGENT_MONITOR_JUDGE_URL": server.url},
        )
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert (
            code == 0
            and [r["step"] for r in rows] == [1, 2]
            and rows[0]["score"] == pytest.approx(11 / 19)
        )


def test_score_command_reports_judge_failures_once_with_the_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with scripted_server() as server:
        server.default = chat_reply(chat_choice([("The", {"The": 1.0})]))
        code = main(
            [
                "score",
                str(FIXTURE),
                "--judge",
                "openai",
                "--judge-url",
                server.url,
                "--max-steps",
                "2",
            ],
            environ={},
        )
    captured = capsys.readouterr()
    assert code == 1 and captured.out.count("FAILED  no_letter") == 2
    # The table says each failure; no log line on stderr says it again.
    assert "score_failed" not in captured.err and "no_letter" not in captured.err
    assert "judge openai model scripted-model: 2 calls, 0 failed" in captured.out


def test_score_command_probes_a_dead_judge_first(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    start = time.monotonic()
    code = main(["score", str(FIXTURE), "--judge", "openai", "--judge-url", url], environ={})
    took = time.monotonic() - start
    captured = capsys.readouterr()
    assert code == 2 and took < 5  # no retried call per step
    assert captured.out == ""  # no table of failed rows
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("agent-monitor: the openai judge is not usable: connection: ")
    assert f"cannot reach the judge server at {url} " in line and line.count(url) == 1


def test_score_and_serve_against_a_web_page_fail_with_one_line() -> None:
    with html_server() as url:
        for command in (["score", str(FIXTURE)], ["serve", "--no-store", "--metrics-port", "0"]):
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "agent_monitor",
                    *command,
                    "--judge",
                    "openai",
                    "--judge-url",
                    url,
                ],
                capture_output=True,
                text=True,
                timeout=60,
                env={k: v for k, v in os.environ.items() if not k.startswith("AGENT_MONITOR")},
            )
            assert done.returncode == 2, (command, done.stderr)
            (line,) = done.stderr.strip().splitlines()  # no traceback
            assert "AttributeError" not in line and "bad_response" in line, line
            assert f"{url} does not look like an OpenAI-compatible server" in line
            assert "check base_url (it usually ends in /v1)" in line


def test_score_command_needs_a_judge(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["score", str(FIXTURE)], environ={}) == 2
    assert "no judge chosen" in capsys.readouterr().err
    assert main(["score", str(tmp_path / "none.json"), "--judge", "openai"], environ={}) == 2
    assert "cannot read" in capsys.readouterr().err
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert main(["score", str(FIXTURE), "--judge", "openai"], environ={}) == 2
    assert "cannot set up the openai judge" in capsys.readouterr().err


def test_atif_shell_results_are_unwrapped_and_placeholder_messages_dropped() -> None:
    run = parse_recorded(
        {
            "reward": 0,
            "trajectory": {
                "steps": [
                    {"source": "user", "message": "Do it."},
                    {
                        "source": "agent",
                        "message": "$31",
                        "tool_calls": [{"arguments": {"command": "ls"}}],
                        "observation": {
                            "results": [
                                {"content": '{"returncode": 2, "output": "no such file\\n"}'}
                            ]
                        },
                    },
                ]
            },
        }
    )
    assert run.steps[0].text == "$ ls\nObservation:\nno such file\n[exit code 2]"
    assert run.outcome == 0.0


def test_replay_of_a_file_that_is_not_text_says_what_it_is(tmp_path: Path) -> None:
    import subprocess
    import sys

    png = tmp_path / "frame.json"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent_monitor",
            "replay",
            str(png),
            "--broker",
            "mqtt://127.0.0.1:9",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "is not a text file (a PNG image): byte 0x89 at offset 0 is not UTF-8" in done.stderr, (
        done.stderr
    )
    assert "codec can't decode" not in done.stderr and "Traceback" not in done.stderr

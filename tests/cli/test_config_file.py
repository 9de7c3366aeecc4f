"""`--config monitor.toml`: serve's flags from a TOML file, under the flags and their environment
twins.

The parsing tests build the real parser; the end-to-end test runs `agent-monitor serve --config
FILE` as a user does (a subprocess, a private Mosquitto, the scripted OpenAI-compatible judge),
aborts and ends a run, restarts the daemon with the same file and reads the run back at
/api/runs/<id> (and, with Chromium installed, at /runs/<id> in a real browser).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from agent_monitor.cli._flags import FlagError, Settings, build
from agent_monitor.cli._main import SERVE_CONFIG, _parser, main
from agent_monitor.daemon import MonitorConfig
from tests.brokers import Mosquitto, free_port, wait_port
from tests.chromium import CHROMIUM, Browser
from tests.cli.test_serve_cli import pub, wait_serving
from tests.openai_server import chat_choice, chat_reply, scripted_server
from tests.paths import REPO

pytestmark = pytest.mark.timeout(120)


def parse(argv: list[str], env: dict[str, str], file: dict[str, Any] | None = None) -> Any:
    return _parser(Settings(env, file, "monitor.toml")).parse_args(argv)


def test_flag_beats_environment_beats_file_beats_default() -> None:
    file = {"metrics_port": 9000, "abort_below": 0.3}
    args = parse(["serve"], {}, file)
    assert args.metrics_port == 9000 and build(MonitorConfig, args).policy.abort_below == 0.3
    args = parse(["serve"], {"AGENT_MONITOR_METRICS_PORT": "9100"}, file)
    assert args.metrics_port == 9100  # the environment over the file
    args = parse(["serve", "--metrics-port", "9200"], {"AGENT_MONITOR_METRICS_PORT": "9100"}, file)
    assert args.metrics_port == 9200  # the flag over both
    # serve's default
    assert parse(["serve"], {}, {}).metrics_port == SERVE_CONFIG.metrics_port == 9464


def test_a_serve_table_and_typed_values(tmp_path: Path) -> None:
    path = tmp_path / "monitor.toml"
    path.write_text(
        'judge = "openai"\n[serve]\nmetrics_port = 9464\nno_store = true\nmetric_labels = '
        '["team", "model"]\n'
        'abort_below = "auto"\n'
    )
    settings = Settings.load({}, str(path))
    args = _parser(settings).parse_args(["serve"])
    assert args.judge == "openai" and args.metrics_port == 9464 and args.no_store is True
    config = build(MonitorConfig, args)
    assert config.policy.abort_below == "auto" and config.metrics.labels == ("team", "model")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("metrics_prot = 9464\n", "unknown key 'metrics_prot'; did you mean metrics_port?"),
        (
            "[judge]\nurl = 'x'\n",
            "unknown table [judge]; settings go at the top level or in [serve]",
        ),
        ("metrics_port = 1\n[serve]\nmetrics_port = 2\n", "metrics_port is set twice"),
        (
            'metrics_port = "9464"\n',
            "metrics_port = '9464': give an integer (a TOML number, unquoted)",
        ),
        ("no_store = 1\n", "no_store = 1: give true or false"),
        ('judge = "llama"\n', "judge = 'llama': use one of"),
        ("metrics_port = \n", "not TOML"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_key_and_exit_code_2(
    tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "monitor.toml"
    path.write_text(text)
    assert main(["serve", "--config", str(path)], {}) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_a_missing_file_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--config", str(tmp_path / "nope.toml")], {}) == 2
    assert (
        "No such file or directory; pass the path of a TOML settings file"
        in capsys.readouterr().err
    )
    Settings.load({}, None).check()  # no file: nothing to refuse
    with pytest.raises(FlagError, match="unknown key 'x'"):
        Settings({}, {"x": 1}, "f").check()


def test_other_commands_read_the_file_where_a_flag_is_shared(tmp_path: Path) -> None:
    path = tmp_path / "monitor.toml"
    path.write_text(
        'state_dir = "/srv/monitor"\nbroker = "mqtt://10.0.0.5:1883"\nmetrics_port = 9999\n'
    )
    settings = Settings.load({}, str(path))
    parser = _parser(settings)
    assert parser.parse_args(["runs"]).state_dir == "/srv/monitor"
    assert parser.parse_args(["replay", "x.json"]).broker == "mqtt://10.0.0.5:1883"
    assert parser.parse_args(["demo"]).metrics_port == 9999


def test_config_prints_each_setting_and_where_it_came_from_secrets_masked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "monitor.toml"
    path.write_text(
        'judge = "openai"\nreward_token = "sekrit"\n[serve]\nmetrics_port = '
        "9464\nabort_below = 0.3\n"
    )
    env = {"AGENT_MONITOR_ABORT_BELOW": "0.25", "AGENT_MONITOR_BROKER_PASSWORD": "hunter2"}
    assert main(["config", "--config", str(path), "--metrics-port", "9000", "--json"], env) == 0
    out = capsys.readouterr().out
    rows = {r["key"]: r for r in map(json.loads, out.splitlines())}
    assert (rows["metrics_port"]["value"], rows["metrics_port"]["from"]) == (9000, "flag")
    assert (rows["abort_below"]["value"], rows["abort_below"]["from"]) == (0.25, "env")
    assert (rows["judge"]["value"], rows["judge"]["from"]) == ("openai", "file")
    assert (rows["topic_prefix"]["value"], rows["topic_prefix"]["from"]) == ("agents", "default")
    assert rows["reward_token"]["value"] == "***" and rows["broker_password"]["value"] == "***"
    assert "sekrit" not in out and "hunter2" not in out
    assert main(["config", "--config", str(path)], {}) == 0
    table = capsys.readouterr()
    assert (
        "settings file" in table.err and "metrics_port" in table.out and "sekrit" not in table.out
    )


@contextmanager
def serve(*args: str) -> Iterator[subprocess.Popen[str]]:
    """`agent-monitor serve ARGS` with the environment of the test minus any AGENT_MONITOR_* (the
    file decides)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_MONITOR_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent_monitor", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "AGENT_MONITOR_LOG_LEVEL": "info"},
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


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _settled(url: str, check: Any, wait_s: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + wait_s
    body: Any = None
    while time.monotonic() < deadline:
        status, body = _get(url)
        if status == 200 and check(body):
            return dict(body)
        time.sleep(0.1)
    raise AssertionError(f"not settled: {body}")


def test_serve_with_a_config_file_comes_up_on_its_ports_and_judge_and_a_run_survives_a_restart(
    broker: Mosquitto, tmp_path: Path
) -> None:
    port = free_port()
    with scripted_server() as judge:
        # 1/19 a step: below the file's threshold
        judge.default = chat_reply(chat_choice([("B", {"B": 1.0})]))
        config = tmp_path / "monitor.toml"
        config.write_text(
            f'broker = "{broker.url}"\njudge = "openai"\n'
            f'[serve]\njudge_url = "{judge.url}"\nmetrics_port = {port}\nstate_dir = '
            f'"{tmp_path / "state"}"\n'
            "abort_below = 0.2\nmin_steps = 1\npatience = 1\n"
        )
        with serve("--config", str(config), "--client-id", "cfg-1") as proc:
            lines = wait_serving(proc)
            assert f"run store {tmp_path / 'state'}/runs.sqlite3" in lines[-1], lines[-1]
            assert f"board http://127.0.0.1:{port}/" in lines[-1] and "openai judge" in lines[-1], (
                lines[-1]
            )
            wait_port(port)
            pub(broker.port, "agents/cfg-run/start", '{"task": "make the failing test pass"}')
            pub(broker.port, "agents/cfg-run/step", '{"index": 1, "text": "ran pytest: 3 failed"}')
            _settled(f"http://127.0.0.1:{port}/api/runs/cfg-run", lambda r: r["signal"] == "abort")
            pub(broker.port, "agents/cfg-run/step", '{"index": 2, "text": "gave up"}')
            pub(broker.port, "agents/cfg-run/end", '{"outcome": "failure"}')
            _settled(
                f"http://127.0.0.1:{port}/api/runs/cfg-run", lambda r: r["outcome"] == "failure"
            )
        # the file's judge scored step 1; nothing is judged after the abort
        assert len(judge.requests) == 1

        # a restart, the same file
        with serve("--config", str(config), "--client-id", "cfg-2") as proc:
            wait_serving(proc)
            wait_port(port)
            run = _settled(f"http://127.0.0.1:{port}/api/runs/cfg-run", lambda r: True)
            assert run["outcome"] == "failure" and run["live"] is False
            assert [(s["index"], s["text"]) for s in run["steps"]] == [
                (1, "ran pytest: 3 failed"),
                (2, "gave up"),
            ]
            assert {c["step"]: c["score"] for c in run["curve"]} == {1: pytest.approx(1 / 19)}
            (abort,) = run["decisions"]
            assert abort["signal"] == "abort" and abort["step"] == 1 and abort["abort_below"] == 0.2
            status, page = _get(f"http://127.0.0.1:{port}/api/runs?outcome=failure")
            assert status == 200 and [r["run_id"] for r in page["runs"]] == ["cfg-run"]
            if CHROMIUM is not None:
                asyncio.run(_browser_shows(f"http://127.0.0.1:{port}/runs/cfg-run"))


async def _browser_shows(url: str) -> None:
    async with Browser() as browser:
        await browser.navigate(url)
        await browser.wait_for("document.querySelectorAll('.step').length === 2")
        texts = await browser.evaluate(
            "[...document.querySelectorAll('.step pre.text')].map(e => e.textContent)"
        )
        assert texts == ["ran pytest: 3 failed", "gave up"]
        assert "score below 0.2" in await browser.evaluate(
            "document.getElementById('decisions').textContent"
        )
        assert (
            await browser.evaluate("document.getElementById('outcome').textContent")
            == "outcome: failure"
        )


def test_the_config_command_runs_as_a_subprocess(tmp_path: Path) -> None:
    path = tmp_path / "monitor.toml"
    path.write_text("metrics_port = 9464\n")
    done = subprocess.run(
        [sys.executable, "-m", "agent_monitor", "config", "--config", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert any(
        line.split()[:3] == ["metrics_port", "file", "9464"] for line in done.stdout.splitlines()
    )


def test_the_manuals_settings_file_is_one_serve_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import re

    page = REPO / "docs" / "daemon.md"
    (block,) = re.findall(r"```toml\n(.*?)```", page.read_text(), re.DOTALL)
    path = tmp_path / "monitor.toml"
    path.write_text(block)
    assert main(["config", "--config", str(path), "--json"], {}) == 0
    rows = {r["key"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert all(
        rows[k]["from"] == "file"
        for k in ("broker", "judge", "judge_url", "metrics_port", "abort_below")
    )

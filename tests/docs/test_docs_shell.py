"""The manual's shell examples (README.md and every page in docs/): each command checked, the
offline ones run.

Every line of every ```bash/```shell block is one case here, and each is one of:
- run: an `agent-monitor` command that needs no network service runs as written (in a scratch folder
  with the repository's files where it names them): `config`, `calibration`, `runs`, `--help`s;
- run with its services: `agent-monitor replay` of a bundled example runs against a private
  Mosquitto with a monitor on it (scripted judge), as `serve --embedded-broker` + `replay` in
  docs/daemon.md;
- parsed: any other `agent-monitor` command (a judge server, a broker, Redis, a user's own files) is
  parsed by the real command line, so its flags and their values exist, and its repository paths
  exist;
- skipped: everything else (mosquitto_pub, curl, make, vllm...), with the reason in the skip
  message.
No case is skipped silently: `pytest -rs tests/docs/test_docs_shell.py` lists each skip and why.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent_monitor.cli._flags import Settings
from agent_monitor.cli._main import _parser
from tests.paths import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
OFFLINE = {"config", "calibration", "runs", "schemas"}
"""Commands that need no network service: run as written."""
NEEDS = {
    "serve": "needs an MQTT broker and a judge server",
    "proxy": "needs an LLM API upstream and a judge server",
    "top": "needs an MQTT broker with a monitor",
    "score": "needs a judge (a server, or the local model: minutes here) and the user's "
    "recorded runs",
    "eval": "needs a judge (a server, or the local model: minutes here) and the user's "
    "recorded runs",
    "select": "needs a judge (a server, or the local model: minutes here) and the user's "
    "recorded runs",
    "replay": "needs an MQTT broker with a monitor on it (the bundled example is run with "
    "both below)",
    "export": "needs a run store with that run",
    "demo": "runs for minutes with the local model (tests/cli/test_demo.py runs it)",
}
REPO_PATHS = ("agent_monitor/", "tests/", "docs/", "dashboards/", "schemas/", "adapters/", "bench/")


def commands(page: Path) -> list[tuple[int, str]]:
    """Each command line of a page's shell blocks (continuations joined), with its block's number.

    A block with a here-document or a quoted string over several lines is one case, whole.
    """
    out = []
    for i, body in enumerate(
        re.findall(r"```(?:bash|shell|sh)\n(.*?)```", page.read_text(), re.DOTALL)
    ):
        joined = body.replace("\\\n", " ")
        if "<<" in joined:
            out.append((i, joined.strip()))
            continue
        pending = ""
        for line in joined.splitlines():
            line = (pending + "\n" + line if pending else line).strip()
            if not line or line.startswith("#"):
                continue
            try:
                shlex.split(line, comments=True)
            except ValueError:  # a quoted string that goes on on the next line
                pending = line
                continue
            pending = ""
            out.append((i, line))
        if pending:
            out.append((i, pending))
    return out


CASES = [(p.relative_to(REPO).as_posix(), i, line) for p in PAGES for i, line in commands(p)]


def words(line: str) -> list[str]:
    """The command's words: comments, `&`, redirections and `...` placeholders left out."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars="&|;<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    out: list[str] = []
    skip = False
    for w in lexer:
        if skip:
            skip = False
            continue
        if w in (">", ">>", "<", "2>"):
            skip = True
            continue
        if w in ("&", ";", "|", "&&", "...", "…"):
            if w in ("|", ";", "&&"):
                break
            continue
        out.append(w)
    return out


def test_the_manual_has_shell_examples_to_check() -> None:
    names = {p for p, _, _ in CASES}
    assert {"README.md", "docs/daemon.md", "docs/metrics.md", "docs/evaluation.md"} <= names
    assert sum(1 for _, _, line in CASES if line.startswith("agent-monitor")) >= 40


def _parse(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            _parser(Settings({})).parse_args(argv)
        except SystemExit as e:
            return int(e.code or 0), err.getvalue()
    return 0, ""


@pytest.mark.parametrize(
    ("page", "block", "line"), CASES, ids=[f"{p}:{b}:{n}" for n, (p, b, _) in enumerate(CASES)]
)
def test_each_shell_line_runs_parses_or_says_why_not(
    page: str, block: int, line: str, tmp_path: Path
) -> None:
    if "<<" in line:
        pytest.skip(
            f"{page} block {block}: a script with a here-document "
            f"({line.split()[0]}...), not agent-monitor"
        )
    argv = words(line)
    if not argv or argv[0] != "agent-monitor":
        tool = argv[0] if argv else line.split()[0]
        if tool.startswith("-"):
            pytest.skip(
                f"{page} block {block}: `{tool}...` goes on another tool's command (a "
                "trainer's), not ours"
            )
        pytest.skip(
            f"{page} block {block}: `{tool}` is not agent-monitor (a broker client, "
            "curl, make, a server...)"
        )
    argv = argv[1:]
    code, err = _parse(argv)
    assert code == 0, f"{page} block {block}: `{line}` does not parse: {err.strip()}"
    for w in argv:
        if w.startswith(REPO_PATHS):
            assert (REPO / w).exists(), (
                f"{page} block {block}: `{line}` names {w}, not in the repository"
            )
    command = argv[0] if argv else ""
    if "--cluster" in argv:
        pytest.skip(
            f"{page} block {block}: parsed only (flags and paths checked): needs the "
            "cluster's Redis"
        )
    if command in OFFLINE or "--help" in argv:
        toml = REPO / "docs" / "daemon.md"
        (block_text,) = re.findall(r"```toml\n(.*?)```", toml.read_text(), re.DOTALL)
        # the file `--config monitor.toml` examples read
        (tmp_path / "monitor.toml").write_text(block_text)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_MONITOR_")}
        env["XDG_DATA_HOME"] = str(tmp_path / "xdg")  # never the user's run store
        done = subprocess.run(
            [sys.executable, "-m", "agent_monitor", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
            env={**env, "PYTHONPATH": str(REPO)},
        )
        assert done.returncode == 0, (
            f"{page} block {block}: `{line}` exited {done.returncode}: {done.stderr[-1500:]}"
        )
        return
    pytest.skip(
        f"{page} block {block}: parsed only (flags and paths checked): "
        f"{NEEDS.get(command, command)}"
    )


def test_replaying_the_bundled_example_shows_each_runs_last_score(
    broker: Any, tmp_path: Path
) -> None:
    """docs/daemon.md's `serve` + `replay`: the summary shows the monitor's last score, not 'no
    progress'."""
    import asyncio
    import threading

    from agent_monitor.daemon import Monitor, MonitorConfig
    from agent_monitor.testing import FakeJudge
    from agent_monitor.wire import BrokerSettings

    (line,) = [
        line
        for p, _, line in CASES
        if p == "docs/daemon.md" and line.startswith("agent-monitor replay")
    ]
    argv = words(line)[1:]
    stop = threading.Event()
    ready = threading.Event()

    async def monitor() -> None:
        config = MonitorConfig(broker=BrokerSettings.from_url(broker.url), client_id="docs-replay")
        async with Monitor(config, judge=FakeJudge()):
            ready.set()
            while not stop.is_set():  # noqa: ASYNC110 - a thread's event
                await asyncio.sleep(0.05)

    thread = threading.Thread(target=asyncio.run, args=(monitor(),), daemon=True)
    thread.start()
    try:
        assert ready.wait(20)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_MONITOR_")}
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "agent_monitor",
                *argv,
                "--speed",
                "200",
                "--broker",
                broker.url,
            ],
            capture_output=True,
            text=True,
            timeout=90,
            cwd=REPO,
            env={**env, "PYTHONPATH": str(REPO)},
        )
    finally:
        stop.set()
        thread.join(20)
    assert done.returncode == 0, done.stderr
    (summary,) = [s for s in done.stderr.splitlines() if s.startswith("replay-coding-failure:")]
    assert re.fullmatch(
        r"replay-coding-failure: step 7 score 0\.\d{3}; signal continue", summary
    ), done.stderr
    assert "no monitor answered" not in done.stderr


def test_replay_without_a_monitor_says_what_to_check(broker: Any) -> None:
    example = "agent_monitor/examples/coding_failure.json"
    argv = ["replay", example, "--speed", "200", "--settle", "0.5", "--broker", broker.url]
    done = subprocess.run(
        [sys.executable, "-m", "agent_monitor", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    assert "replay-coding-failure: no score received; signal continue" in done.stderr
    assert (
        "no monitor answered within 0.5 s of the last step: is `agent-monitor serve` "
        f"running on {broker.url}"
    ) in (done.stderr)


SUBCOMMANDS = sorted(
    {words(line)[1] for _, _, line in CASES if words(line)[:1] == ["agent-monitor"]}
)


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_command_the_manual_names_has_its_help(command: str) -> None:
    """Each command the manual's examples use exists and answers --help (what a reader tries
    first)."""
    done = subprocess.run(
        [sys.executable, "-m", "agent_monitor", command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout.startswith("usage: agent-monitor " + command), (
        done.stderr
    )

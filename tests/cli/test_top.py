"""`agent-monitor top`: the table model (order, caps, bad payloads), and the command under a real
terminal (tmux).

The terminal tests run a real Monitor (FakeJudge) on a private Mosquitto, so the payloads `top`
reads are the ones monitors publish, and read the screen tmux renders.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import aiomqtt
import pytest
from rich.console import Console

from agent_monitor.cli._top import Board, Top, TopOptions, age, clean, count, render
from agent_monitor.daemon import Monitor, MonitorConfig
from agent_monitor.policy import Policy
from agent_monitor.testing import FakeJudge, letter_at
from agent_monitor.wire import MAX_PAYLOAD_BYTES, BrokerSettings
from tests.brokers import Mosquitto
from tests.paths import REPO

pytestmark = pytest.mark.timeout(120)

ROOT = REPO
# os.environ, not the process's C environment: something in the test process sets COLUMNS=80 there
# (children inherit it), and rich would size a piped table to it.
SIZELESS = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def signal(run_id: str, name: str, step: int, reason: str = "") -> bytes:
    return json.dumps({"run_id": run_id, "signal": name, "reason": reason, "step": step}).encode()


def progress(run_id: str, step: int, score: float | None = 0.5, **extra: Any) -> bytes:
    body: dict[str, Any] = {"run_id": run_id, "step": step, "score": score, "ok": score is not None}
    return json.dumps(body | extra).encode()


def text_of(board: Board, rows: int | None = None, *, styles: bool = False) -> str:
    console = Console(width=200, record=True, file=open("/dev/null", "w"), color_system="standard")  # noqa: SIM115
    console.print(render(board, source="test", rows=rows))
    console.file.close()
    return console.export_text(styles=styles)


def row(screen: str, run_id: str) -> list[str]:
    """The cells (words) of the row that starts with `run_id`; [] when there is none."""
    for line in screen.splitlines():
        words = line.split()
        if words and words[0] == run_id:
            return words
    return []


# --- the table model
# ------------------------------------------------------------------------------------


def test_most_recently_active_first_and_retained_messages_last() -> None:
    clock = Clock()
    b = Board(clock=clock)
    b.feed("agents/old/signal", signal("old", "abort", 4, "low"), retained=True)
    for r in ("a", "b", "c"):
        clock.t += 1
        b.feed(f"agents/{r}/progress", progress(r, 1))
    clock.t += 1
    b.feed("agents/a/progress", progress("a", 2, 0.7))
    # A retained message about a known run says nothing of when: it does not move the run.
    b.feed("agents/b/signal", signal("b", "continue", 1), retained=True)
    assert [v.run_id for v in b.newest()] == ["a", "c", "b", "old"]
    assert [v.run_id for v in b.newest(2)] == ["a", "c"]
    old = b.runs["old"]
    assert (old.signal, old.step, old.active_at) == ("abort", 4, None)
    clock.t += 75
    screen = text_of(b)
    assert row(screen, "a")[1:] == ["━━━━━━━━━━━╺━━━━", "0.700", "2", "1m"]
    assert row(screen, "old")[-3:] == ["abort", "low", "-"]  # age unknown: it was retained


def test_runs_are_capped_and_the_least_recently_active_forgotten() -> None:
    clock = Clock()
    b = Board(keep_runs=3, clock=clock)
    for i in range(5):
        clock.t += 1
        b.feed(f"agents/r{i}/progress", progress(f"r{i}", 1))
    clock.t += 1
    b.feed("agents/r2/progress", progress("r2", 2))
    b.feed("agents/r5/start", b'{"task": "t"}')
    b.feed("agents/r5/signal", signal("r5", "continue", 0, "run started"))  # the monitor opened it
    assert [v.run_id for v in b.newest()] == ["r5", "r2", "r4"]
    assert b.forgotten == 3
    assert "3 runs forgotten (over --keep-runs 3)" in text_of(b)


def test_rows_are_bounded_with_a_count_of_the_rest() -> None:
    b = Board(clock=Clock())
    for i in range(7):
        b.feed(f"agents/r{i}/progress", progress(f"r{i}", 1))
    screen = text_of(b, rows=3)
    shown = [
        w[0]
        for line in screen.splitlines()
        if (w := line.split()) and w[0][:1] == "r" and w[0] != "run"
    ]
    assert shown == ["r6", "r5", "r4"]
    assert "+4 more" in screen


def test_a_terminal_gets_as_many_rows_as_fit_and_never_scrolls() -> None:
    console = Console(width=60, height=12, force_terminal=True, file=open("/dev/null", "w"))  # noqa: SIM115
    t = Top(BrokerSettings(), "agents", TopOptions(), console)
    for i in range(30):
        t.board.feed(f"agents/run-{i}/progress", progress(f"run-{i}", 1, reason="x" * 300))
    t.board.bad, t.board.last_bad = 3, "y" * 200
    lines = console.render_lines(t.screen(), console.options, pad=False)
    console.file.close()
    assert len(lines) == 12
    text = ["".join(seg.text for seg in line) for line in lines]
    assert text[0].startswith("agent-monitor top") and text[-1].startswith("+21 more")
    assert [line.split()[0] for line in text[2:-1]] == [f"run-{i}" for i in range(29, 20, -1)]


BAD = [
    ("agents/r/progress", b"not json"),
    ("agents/r/progress", b"[1, 2]"),
    (
        "agents/r/progress",
        json.dumps({"run_id": "r", "step": "three", "score": 0.5, "ok": True}).encode(),
    ),
    ("agents/r/progress", json.dumps({"run_id": "r", "score": 0.5, "ok": True}).encode()),
    ("agents/r/progress", b"[" * 100_000),
    ("agents/r/progress", b"{" + b" " * MAX_PAYLOAD_BYTES + b"}"),
    ("agents/r/progress", progress("r", 1, totals={"input": -1})),
    ("agents/r/signal", signal("r", "explode", 1)),
    ("agents/r/start", json.dumps({"task": 3}).encode()),
    ("agents/r/end", json.dumps({"outcome": "maybe"}).encode()),
    ("agents/_x/progress", progress("_x", 1)),
    ("agents/r/progress/more", progress("r", 1)),
    ("agents/r/step", b"{}"),
    ("other/r/progress", progress("r", 1)),
    ("agents/_groups/g/ranking", b'{"runs": 5}'),
    ("agents/r/progress", b"\xff\xfe"),
    ("agents/r/end", b"{}" * 3),
]


def test_numbers_out_of_range_are_shown_within_it() -> None:
    b = Board(clock=Clock())
    b.feed(
        "agents/r/progress",
        b'{"run_id": "r", "step": 1, "score": NaN, "uncertainty": 0.1, "ok": true}',
    )
    b.feed("agents/s/progress", progress("s", 1, 1.5, uncertainty=float("inf")))
    assert (b.runs["r"].score, b.runs["s"].score, b.runs["s"].uncertainty) == (None, 1.0, None)
    text_of(b)


def test_bad_payloads_are_counted_never_raised_and_change_nothing() -> None:
    b = Board(clock=Clock())
    b.feed("agents/r/progress", progress("r", 2, 0.25))
    before = repr(b.runs["r"])
    for topic, payload in BAD:
        b.feed(topic, payload)
    assert b.bad == len(BAD)
    assert repr(b.runs["r"]) == before
    assert list(b.runs) == ["r"]
    assert f"{len(BAD)} bad payloads (last: agents/r/end: payload: Invalid JSON" in text_of(b)


def test_failures_signals_and_reasons() -> None:
    b = Board(clock=Clock())
    b.feed("agents/r/progress", progress("r", 1, 0.4, uncertainty=0.1))
    decision = {
        "signal": "resample",
        "reason": "regressed 0.3 from the best",
        "step": 2,
        "score": 0.1,
    }
    b.feed(
        "agents/r/progress",
        progress("r", 2, 0.1, uncertainty=0.2, decision=decision, signal="resample"),
    )
    b.feed("agents/r/progress", progress("r", 3, None, reason="timeout"))
    v = b.runs["r"]
    # A failed scoring keeps the last score (fail open) and says why; the signal in force stays.
    assert (v.step, v.score, v.uncertainty, v.failure, v.signal) == (
        3,
        0.1,
        0.2,
        "timeout",
        "resample",
    )
    assert row(text_of(b), "r")[2:7] == ["0.100", "!", "0.20", "3", "resample"]


def test_ended_runs_are_dimmed_then_dropped_after_the_grace() -> None:
    clock = Clock()
    b = Board(ended_grace_s=30, clock=clock)
    b.feed("agents/done/signal", signal("done", "abort", 3, "low"))
    b.feed("agents/live/progress", progress("live", 1))
    b.feed("agents/done/end", b'{"outcome": "failure"}')
    # the monitor clears the retained signal once the run is closed
    b.feed("agents/done/signal", b"")
    assert b.runs["done"].signal == "abort" and b.runs["done"].outcome == "failure"
    styled = text_of(b, styles=True)
    done = next(line for line in styled.splitlines() if "done" in line)
    assert "\x1b[2m" in done and "[ended failure]" in done
    assert "\x1b[2m" not in next(line for line in styled.splitlines() if "live" in line)
    assert "1 live, 1 ended" in text_of(b)
    clock.t += 29
    b.prune()
    assert "done" in b.runs
    clock.t += 1
    b.prune()
    assert list(b.runs) == ["live"]


def test_a_cleared_signal_closes_a_run_whose_end_never_came() -> None:
    b = Board(clock=Clock())
    b.feed("agents/gone/progress", progress("gone", 4, 0.3))
    b.feed("agents/unknown/signal", b"")  # nothing known of it: nothing to show
    b.feed("agents/gone/signal", b"")  # expired or evicted by the monitor
    assert list(b.runs) == ["gone"] and b.runs["gone"].ended and "[ended closed]" in text_of(b)


def test_a_run_id_started_again_is_live_again() -> None:
    clock = Clock()
    b = Board(ended_grace_s=30, clock=clock)
    b.feed("agents/r/end", b"")
    b.feed("agents/r/start", b'{"task": "second try"}')
    assert b.runs["r"].ended  # a start alone is a request: live once the monitor says so
    b.feed("agents/r/signal", signal("r", "continue", 0, "run started"))
    clock.t += 31
    b.prune()
    assert not b.runs["r"].ended and b.runs["r"].task == "second try"


def test_a_start_the_monitor_never_opened_is_never_live() -> None:
    """A refused start gets no retained state from the monitor: `top` shows no row for it, now or
    later."""
    b = Board(clock=Clock())
    b.feed("agents/refused/start", b'{"task": "t"}')
    assert "refused" not in b.runs and "refused" not in text_of(b)
    b.feed("agents/ok/start", b'{"task": "the task"}')
    b.feed("agents/ok/signal", signal("ok", "continue", 0, "run started"), retained=True)
    assert list(b.runs) == ["ok"] and b.runs["ok"].task == "the task" and not b.runs["ok"].ended


def test_group_column_only_when_a_run_has_a_group() -> None:
    b = Board(clock=Clock())
    b.feed("agents/a/progress", progress("a", 1))
    assert "group" not in text_of(b).splitlines()[1]
    b.feed(
        "agents/b/start",
        json.dumps({"task": "t", "labels": {"group": "sweep-1", "model": "m"}}).encode(),
    )
    b.feed("agents/c/start", json.dumps({"task": "t", "group": "sweep-2"}).encode())
    for r in "bc":
        b.feed(f"agents/{r}/signal", signal(r, "continue", 0, "run started"))
    b.feed(
        "agents/_groups/sweep-2/ranking",
        json.dumps(
            {
                "group": "sweep-2",
                "leader": "x",
                "runs": [{"run_id": "c", "rank": 2}, {"run_id": "x", "rank": 1}],
            }
        ).encode(),
    )
    screen = text_of(b)
    assert screen.splitlines()[1].split()[:2] == ["run", "group"]
    assert row(screen, "b")[1] == "sweep-1" and row(screen, "c")[1:3] == ["sweep-2", "#2"]
    assert row(screen, "a")[1].startswith("━")  # no group: the cell is empty


def test_tokens_and_cost_only_when_progress_has_totals() -> None:
    b = Board(clock=Clock())
    b.feed("agents/a/progress", progress("a", 1))
    assert "cost" not in text_of(b)
    totals = {"input": 12_345, "cached_input": 2000, "output": 7, "cost": 0.0123}
    b.feed("agents/b/progress", progress("b", 1, totals=totals))
    b.feed(
        "agents/c/progress",
        progress("c", 1, totals={"input": 950, "cached_input": 0, "output": 3, "cost": None}),
    )
    screen = text_of(b)
    assert "tokens in/out" in screen and "cost" in screen
    assert row(screen, "b")[2:6] == ["0.500", "1", "12.3k/7", "$0.0123"]
    # no prices: tokens without a cost
    assert row(screen, "c")[2:6] == ["0.500", "1", "950/3", "0s"]


def test_text_from_the_network_cannot_drive_the_terminal() -> None:
    b = Board(clock=Clock())
    evil = "\x1b]0;owned\x07\x1b[2J\u202ereversed\r\nnext line [bold]markup[/bold]"
    b.feed("agents/r/start", json.dumps({"task": evil}).encode())
    b.feed("agents/r/signal", signal("r", "continue", 0, "run started"))
    decision = {"signal": "abort", "reason": evil, "step": 1}
    b.feed("agents/r/progress", progress("r", 1, 0.1, decision=decision, signal="abort"))
    screen = text_of(b)
    assert "\x1b" not in screen and "\u202e" not in screen and "\x07" not in screen
    assert "[bold]markup[/bold]" in screen  # shown as sent, not read as rich markup
    assert len([line for line in screen.splitlines() if line.startswith("r ")]) == 1


def test_small_formatters() -> None:
    assert [age(s) for s in (None, -1, 0, 59.9, 60, 3600 * 5, 86400 * 2)] == [
        "-",
        "0s",
        "0s",
        "59s",
        "1m",
        "5h",
        "2d",
    ]
    assert [count(n) for n in (0, 999, 1000, 12_345, 4_100_000)] == [
        "0",
        "999",
        "1.0k",
        "12.3k",
        "4.1M",
    ]
    assert clean("a\tb\x00c" + "x" * 300, 10) == "a b c" + "x" * 4 + "…"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("refresh_s", 0),
        ("once_s", -1),
        ("rows", 0),
        ("keep_runs", 0),
        ("ended_grace_s", float("nan")),
    ],
)
def test_options_refuse_what_cannot_work(field: str, value: float) -> None:
    with pytest.raises(ValueError, match="use"):
        TopOptions(**{field: value})


# --- the command, against a real broker and monitor
# -------------------------------------------------------


def _answer(prompt: Any) -> str:
    # "stuck" stays near the bottom (aborted by the policy below); the others grow one letter a
    # step.
    return "B" if "stuck task" in prompt.prefix_text() else letter_at(prompt.step)


@asynccontextmanager
async def live_monitor(broker: Mosquitto) -> AsyncIterator[Callable[..., Any]]:
    """A real Monitor with a FakeJudge, and a function that publishes a harness's input to it."""
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url),
        client_id=f"mon-{broker.port}",
        policy=Policy(abort_below=0.2, min_steps=2, patience=2),
    )
    async with (
        Monitor(config, judge=FakeJudge(_answer)),
        aiomqtt.Client("127.0.0.1", broker.port, identifier="harness") as client,
    ):

        async def publish(run_id: str, kind: str, payload: dict[str, Any] | None = None) -> None:
            await client.publish(
                f"agents/{run_id}/{kind}", json.dumps(payload or {}).encode(), qos=1
            )

        yield publish


async def top_once(url: str) -> tuple[int | None, str]:
    """`agent-monitor top --once 1` to a pipe: its exit code, and its stdout (or stderr when it
    failed)."""
    proc = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "agent_monitor", "top", "--broker", url, "--once", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=SIZELESS,
    )
    out, err = await proc.communicate()
    return proc.returncode, (out if proc.returncode == 0 else err).decode()


def top_command(broker: Mosquitto, *flags: str) -> list[str]:
    return [sys.executable, "-m", "agent_monitor", "top", "--broker", broker.url, *flags]


class Tmux:
    """`agent-monitor top` in a tmux pane of a private tmux server: what it renders is read back
    as text."""

    def __init__(self, workdir: Path, width: int = 150, height: int = 24) -> None:
        # A server of its own, named (-L) rather than a socket path under tmp_path: socket paths are
        # short.
        self.server = f"agent-monitor-test-{secrets.token_hex(4)}"
        self.width, self.height = width, height
        self.exit_file = workdir / "exit-code"

    def tmux(self, *args: str) -> str:
        out = subprocess.run(
            ["tmux", "-L", self.server, *args], capture_output=True, text=True, check=True
        )
        return out.stdout

    def start(self, argv: list[str]) -> None:
        # The exit code lands in a file: the pane closes with the command. COLUMNS and LINES, when
        # the pane's shell sets them, would pin rich to 80x24 whatever the pane's size.
        command = shlex.join(["env", "-u", "COLUMNS", "-u", "LINES", *argv])
        stderr, exit_file = (
            shlex.quote(str(self.exit_file.parent / "stderr")),
            shlex.quote(str(self.exit_file)),
        )
        shell = f"{command} 2>{stderr}; echo $? > {exit_file}"
        size = ["-x", str(self.width), "-y", str(self.height)]
        self.tmux(
            "-f", "/dev/null", "new-session", "-d", *size, "-c", str(ROOT), "-s", "top", shell
        )

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "top")

    async def until(self, check: Callable[[str], bool], what: str, wait_s: float = 30.0) -> str:
        """The screen once `check` holds on it; fail with the last screen after `wait_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            screen = await asyncio.to_thread(self.screen) if not self.exit_file.exists() else ""
            if check(screen):
                return screen
            if loop.time() > deadline or self.exit_file.exists():
                stderr = (
                    (self.exit_file.parent / "stderr").read_text()
                    if self.exit_file.exists()
                    else ""
                )
                pytest.fail(f"{what}: not on the screen:\n{screen}\n{stderr}")
            await asyncio.sleep(0.1)

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "top", *keys)


@contextmanager
def tmux(workdir: Path) -> Iterator[Tmux]:
    if shutil.which("tmux") is None:
        pytest.fail("tmux is not installed; `apt-get install tmux` (.ci/run installs it)")
    t = Tmux(workdir)
    try:
        yield t
    finally:
        subprocess.run(["tmux", "-L", t.server, "kill-server"], capture_output=True, check=False)


async def exit_code(t: Tmux, wait_s: float = 20.0) -> int:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while not t.exit_file.exists() or not t.exit_file.read_text().strip():
        if loop.time() > deadline:
            pytest.fail(f"agent-monitor top did not exit:\n{t.screen()}")
        await asyncio.sleep(0.1)
    return int(t.exit_file.read_text())


def score(step: int) -> str:
    return f"{step / 19:.3f}"


async def test_top_shows_two_live_runs_under_a_terminal_and_updates_them(
    broker: Mosquitto, tmp_path: Path
) -> None:
    async with live_monitor(broker) as publish:
        with tmux(tmp_path) as t:
            t.start(top_command(broker, "--refresh", "0.2"))
            await t.until(
                lambda s: "agent-monitor top" in s and "no runs yet" in s, "the empty board"
            )
            await publish(
                "climb",
                "start",
                {
                    "task": "climb task",
                    "labels": {"group": "sweep-7"},
                    "policy": {"abort_below": None},
                },
            )
            # Aborted by its step 3's scoring whatever was scored before: under load steps 1-3 may
            # arrive in one batch and be scored once (coalesced), which the monitor's policy here
            # (patience 2) would not abort.
            await publish(
                "stuck", "start", {"task": "stuck task", "policy": {"min_steps": 3, "patience": 1}}
            )
            for i in (1, 2):
                await publish("climb", "step", {"index": i, "text": f"climb step {i}"})
            for i in (1, 2, 3):
                await publish("stuck", "step", {"index": i, "text": f"stuck step {i}"})

            def both(s: str) -> bool:
                return row(s, "climb")[5:7] == ["2", "continue"] and "abort" in row(s, "stuck")

            screen = await t.until(both, "both runs scored, stuck aborted")
            assert screen.splitlines()[1].split()[:3] == ["run", "group", "progress"]
            climb, stuck = row(screen, "climb"), row(screen, "stuck")
            # A run without a group has an empty group cell (no word); one judge letter: uncertainty
            # 0.
            assert climb[:2] == ["climb", "sweep-7"] and climb[3:7] == [
                score(2),
                "0.00",
                "2",
                "continue",
            ], screen
            assert climb[-3:] == ["0s", "climb", "task"], screen
            assert stuck[2:6] == [score(1), "0.00", "3", "abort"], screen
            assert "2 live, 0 ended" in screen

            # A new step's score replaces the row's, live, and its run moves to the top.
            await publish("climb", "step", {"index": 3, "text": "climb step 3"})
            screen = await t.until(
                lambda s: row(s, "climb")[3:7] == [score(3), "0.00", "3", "continue"],
                "climb's step 3",
            )
            runs = [
                line.split()[0]
                for line in screen.splitlines()[2:]
                if line.split()[:1] in (["climb"], ["stuck"])
            ]
            assert runs == ["climb", "stuck"]

            await publish("stuck", "end", {"outcome": "failure"})
            await t.until(
                lambda s: "[ended" in " ".join(row(s, "stuck")) and "1 live, 1 ended" in s,
                "stuck ended",
            )
            t.keys("q")
            assert await exit_code(t) == 0


async def test_top_exits_cleanly_on_ctrl_c(broker: Mosquitto, tmp_path: Path) -> None:
    with tmux(tmp_path) as t:
        t.start(top_command(broker, "--refresh", "0.2"))
        await t.until(lambda s: "no runs yet" in s, "the empty board")
        t.keys("C-c")
        assert await exit_code(t) == 0


async def test_top_survives_a_broker_restart(broker: Mosquitto, tmp_path: Path) -> None:
    async def publish(run_id: str, step: int) -> None:
        async with aiomqtt.Client("127.0.0.1", broker.port, identifier="pub") as c:
            await c.publish(f"agents/{run_id}/progress", progress(run_id, step, step / 10), qos=1)

    with tmux(tmp_path) as t:
        t.start(top_command(broker, "--refresh", "0.2"))
        await t.until(lambda s: "no runs yet" in s, "the empty board")
        await publish("before", 1)
        await t.until(
            lambda s: row(s, "before")[2:4] == ["0.100", "1"],
            "the run published before the restart",
        )
        await asyncio.to_thread(broker.stop)
        await t.until(
            lambda s: "connection lost" in s.splitlines()[0], "the lost connection, in the title"
        )
        await asyncio.to_thread(broker.start)
        # A clean session keeps nothing while top is away: publish (as a harness's monitor would,
        # step after step) until top, reconnected with backoff, reads again; what it knew stays on
        # the board.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while row(screen := await asyncio.to_thread(t.screen), "after")[2:4] != ["0.200", "2"]:
            assert loop.time() < deadline, (
                f"no run published after the restart on the screen:\n{screen}"
            )
            await publish("after", 2)
            await asyncio.sleep(0.3)
        assert row(screen, "before")[2:4] == ["0.100", "1"] and "connection lost" not in screen


async def test_top_once_sees_the_retained_signals_of_runs_already_there(broker: Mosquitto) -> None:
    async with live_monitor(broker) as publish:
        await publish("stuck", "start", {"task": "stuck task"})
        for i in (1, 2, 3):
            await publish("stuck", "step", {"index": i, "text": f"stuck step {i}"})
        async with aiomqtt.Client("127.0.0.1", broker.port, identifier="watch") as c:
            await c.subscribe("agents/stuck/signal", qos=1)
            # the abort is out (and retained); first came the opened state
            async with asyncio.timeout(20):
                async for m in c.messages:
                    if b'"abort"' in bytes(m.payload):  # type: ignore[arg-type]
                        break
        returncode, out = await top_once(broker.url)
    assert returncode == 0, out
    stuck = row(out, "stuck")
    # Its age is "-" (a retained signal says nothing of when); its task came with its retained
    # state.
    assert stuck[2:5] == [score(1), "3", "abort"] and stuck[-3:] == ["-", "stuck", "task"], out


async def test_top_started_after_three_runs_began_lists_all_three_and_not_the_refused_one(
    broker: Mosquitto,
) -> None:
    """No step scored yet: the runs' retained state (published when each opened) is all a late
    `top` has to go on."""
    async with live_monitor(broker) as publish:
        async with aiomqtt.Client("127.0.0.1", broker.port, identifier="watch") as c:
            await c.subscribe("agents/+/state", qos=1)
            for name in ("one", "two", "three"):
                await publish(name, "start", {"task": f"task {name}"})
            await publish("refused", "start", {"no_task": True})  # refused: no task
            opened = set()
            async with asyncio.timeout(20):
                async for m in c.messages:
                    opened.add(m.topic.value.split("/")[1])
                    if len(opened) == 3:
                        break
        assert opened == {"one", "two", "three"}
        returncode, out = await top_once(broker.url)
        assert returncode == 0, out
        for name in ("one", "two", "three"):
            assert row(out, name)[-3:] == ["-", "task", name], out  # age (retained), task
        assert "refused" not in out, out
        # The run ends: its state is cleared, so a `top` started now lists it no more.
        await publish("one", "end", {"outcome": "success"})
        async with aiomqtt.Client("127.0.0.1", broker.port, identifier="watch2") as c:
            await c.subscribe("agents/one/state", qos=1)
            cleared = False
            with contextlib.suppress(TimeoutError):
                # a retained state still there arrives at once; then the clear
                async with asyncio.timeout(3):
                    async for m in c.messages:
                        cleared = not bytes(m.payload)  # type: ignore[arg-type]
                        if cleared:
                            break
        returncode, out = await top_once(broker.url)
    assert returncode == 0, out
    assert "one" not in [line.split()[0] for line in out.splitlines()[2:] if line.split()], out
    assert row(out, "two")[-2:] == ["task", "two"], out


async def test_top_reads_a_broker_that_speaks_only_mqtt_3_1_1() -> None:
    from agent_monitor.daemon import EmbeddedBroker
    from tests.brokers import free_port

    # amqtt: refuses v5, so top falls back to 3.1.1
    async with EmbeddedBroker(port=free_port()) as b:
        async with aiomqtt.Client("127.0.0.1", b.port, protocol=aiomqtt.ProtocolVersion.V311) as c:
            await c.publish(
                "agents/old/signal", signal("old", "resample", 5, "regressed"), qos=1, retain=True
            )
        returncode, out = await top_once(b.url)
    assert returncode == 0, out
    assert row(out, "old")[2:] == ["5", "resample", "regressed", "-"], out.decode()


def test_top_says_what_to_check_when_the_broker_is_not_there(tmp_path: Path) -> None:
    from tests.brokers import free_port

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent_monitor",
            "top",
            "--broker",
            f"mqtt://127.0.0.1:{free_port()}",
            "--once",
            "0",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert out.returncode == 2
    assert out.stderr.startswith("agent-monitor: cannot watch the MQTT broker at mqtt://127.0.0.1:")
    assert "check --broker" in out.stderr


def test_in_100_columns_the_numbers_keep_their_columns_and_a_retained_only_run_says_why_it_has_no_score() -> (  # noqa: E501 (the test's name is its sentence)
    None
):
    clock = Clock()
    board = Board(clock=clock)
    reason = "score below 0.3 for 2 scored steps; best 0.41 at step 1 " * 2
    board.feed(
        "agents/coding-failure/state",
        json.dumps({"run_id": "coding-failure", "task": "t " * 80}).encode(),
    )
    board.feed(
        "agents/coding-failure/progress",
        progress(
            "coding-failure",
            3,
            0.26,
            uncertainty=0.05,
            decision={"signal": "abort", "reason": reason, "step": 3},
        ),
    )
    board.feed("agents/old/signal", signal("old", "continue", 4), retained=True)
    clock.t += 75
    console = Console(width=100, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(render(board, source="mqtt://127.0.0.1:1883", rows=None))
    console.file.close()
    screen = console.export_text()
    assert max(len(line) for line in screen.splitlines()) <= 100
    cells = row(screen, "coding-failu…")
    assert cells[2:6] == ["0.260", "0.05", "3", "abort"] and "1m" in cells, screen
    # no score yet: only its retained signal was seen
    assert row(screen, "old")[1:3] == ["-", "4"], screen
    assert "scored before top started (its score shows with its next step" in screen

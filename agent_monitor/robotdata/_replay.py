"""Replay robot episodes live into a monitor: one run per episode, its steps at the episode's own
pace, with frames."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ._episode import Episode, prefetch


class StepSink(Protocol):
    """Where one episode's steps go: a `MonitorClient` run (MQTT) or `TrackerSink` (in-process)."""

    def step(self, text: str, *, images: Iterable[bytes] = (), index: int | None = None) -> Any:
        """Send one step."""

    def end(self, outcome: Any = None) -> None:
        """End the run."""


StartRun = Callable[[str, Episode], StepSink]
"""Starts the run for an episode (its run id and the episode, for its task) and returns where its
steps go."""


class TrackerSink:
    """An in-process ProgressTracker as a replay sink: steps go to `submit` (no wait for scores)."""

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker

    def step(self, text: str, *, images: Iterable[bytes] = (), index: int | None = None) -> Any:
        """Submit the step (`index` is the tracker's own count)."""
        del index
        return self.tracker.submit(text, images=list(images))

    def end(self, outcome: Any = None) -> None:
        """Wait for the last score; the caller closes the tracker."""
        self.tracker.drain()


def episode_run_id(name: str, prefix: str = "replay-") -> str:
    """A valid run id (one topic level) from an episode's name."""
    clean = re.sub(r"[^A-Za-z0-9._:-]", "-", name).strip("-.") or "episode"
    return (prefix + clean)[:128]


@dataclass
class ReplayStats:
    """What a replay sent."""

    episodes: int = 0
    steps: int = 0
    frames: int = 0
    late_s: float = 0.0
    """The most a step was sent after its due time (decoding or publishing behind the episode's
    pace)."""
    run_ids: list[str] = field(default_factory=list)


def replay_episodes(
    episodes: Iterable[Episode],
    start: StartRun,
    *,
    speed: float = 1.0,
    run_prefix: str = "replay-",
    pause_s: float = 1.0,
    sleep: Callable[[float], None] = time.sleep,
    on_step: Callable[[str, int, int], object] | None = None,
    prefetch_depth: int = 8,
) -> ReplayStats:
    """Publish each episode as a live run, one after the other, each step at its recorded time
    divided by `speed`.

    Decoding runs in a worker thread at most `prefetch_depth` steps ahead of publishing. `speed=0`
    sends as fast as the steps decode. Between episodes, `pause_s / speed` (none at speed 0). The
    episode's outcome ends its run.
    """
    if speed < 0:
        raise ValueError("speed must be >= 0 (0: as fast as the steps decode)")
    stats = ReplayStats()
    for n, ep in enumerate(episodes):
        if n and speed and pause_s:
            sleep(pause_s / speed)
        rid = episode_run_id(ep.name, run_prefix)
        sink = start(rid, ep)
        stats.episodes += 1
        stats.run_ids.append(rid)
        begin = time.monotonic()
        outcome = None if ep.outcome is None else ("success" if ep.outcome >= 0.5 else "failure")
        try:
            for s in prefetch(ep.steps(), prefetch_depth):
                if speed:
                    wait = begin + s.timestamp / speed - time.monotonic()
                    if wait > 0:
                        sleep(wait)
                    else:
                        stats.late_s = max(stats.late_s, -wait)
                sink.step(s.text, images=s.images, index=s.index)
                stats.steps += 1
                stats.frames += len(s.images)
                if on_step is not None:
                    on_step(rid, s.index, ep.planned_steps)
        except BaseException:
            sink.end(None)  # the run ends either way; an unreadable episode has no outcome
            raise
        sink.end(outcome)
    return stats

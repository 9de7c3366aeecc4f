"""What the robot-data readers produce: episodes of steps with frames, read lazily and bounded."""

from __future__ import annotations

import io
import math
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from ..images import FrameBudget
from ..offline.recorded import RecordedRun, RecordedStep

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage

INSTALL_HINT = "install the robot extra: pip install -e '.[robot]' (in the agent-monitor checkout)"
DEFAULT_MAX_STEPS = 10_000
"""Steps read from one episode at most, unless told otherwise (at 10 Hz, 16 minutes)."""
MAX_VALUES = 32
"""Values of one vector feature written into a step's text; the rest are counted, not shown."""


class RobotDataError(ValueError):
    """A robot-data file or dataset this reader cannot read; the message names the file and what
    to do."""


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """How much of an episode a reader turns into steps, and at what cost.

    - `every`: one step per `every` source frames (control ticks); its text is the last tick's.
    - `max_steps`: steps read per episode at most; the rest of a longer episode is left out
      (`Episode.truncated`).
    - `max_side`: frames are downscaled so the longer side is at most this (None: as recorded).
    - `frame_budget`: when set, only the steps whose frames the budget would ever show at the
      episode's end (its anchors and its last `recent` steps) carry frames; the others are decoded
      but not encoded or sent. None: every step carries its frames (the monitor's own budget then
      chooses, and the tail is live).
    """

    every: int = 1
    max_steps: int = DEFAULT_MAX_STEPS
    max_side: int | None = 320
    jpeg_quality: int = 85
    frame_budget: FrameBudget | None = None

    def __post_init__(self) -> None:
        if self.every < 1 or self.max_steps < 1:
            raise ValueError("ReadOptions needs every >= 1 and max_steps >= 1")
        if self.max_side is not None and self.max_side < 8:
            raise ValueError("ReadOptions.max_side must be at least 8 (or None)")

    def planned(self, frames: int) -> int:
        """How many steps an episode of `frames` source frames yields."""
        return min(math.ceil(frames / self.every), self.max_steps)

    def keeps_frames(self, steps: int) -> Callable[[int], bool]:
        """For an episode of `steps` steps, whether the step at a 0-based ordinal carries frames."""
        budget = self.frame_budget
        if budget is None:
            return lambda _o: True
        anchors = set(budget.anchors(steps))
        last = max(0, steps - budget.recent)
        return lambda o: o in anchors or o >= last


@dataclass(frozen=True, slots=True)
class EpisodeStep:
    """One step of an episode: what the monitor receives as a step event."""

    index: int
    """1-based, as the monitor numbers steps."""
    frame_index: int
    """The source frame (control tick) the step was taken at, 0-based within the episode."""
    timestamp: float
    """Seconds from the episode's start."""
    text: str
    """The step's action and state as text (the judge reads it)."""
    images: tuple[bytes, ...] = ()
    """Encoded frames (JPEG), one per camera in `Episode.cameras` order; empty when not kept."""


@dataclass(frozen=True, slots=True)
class Episode:
    """One recorded episode: task, cameras, outcome, and its steps read lazily (`steps()`)."""

    name: str
    task: str
    source: str
    """The file or dataset directory it came from."""
    frames: int
    """Source frames (control ticks) in the episode."""
    fps: float | None
    cameras: tuple[str, ...]
    outcome: float | None
    """1 success, 0 failure, None when the data does not say."""
    planned_steps: int
    """How many steps `steps()` yields (after `every` and `max_steps`)."""
    truncated: bool
    """Whether `max_steps` left the end of the episode out."""
    _read: Callable[[], Iterator[EpisodeStep]] = field(repr=False, compare=False)

    def steps(self) -> Iterator[EpisodeStep]:
        """The steps, decoded as they are read (blocking: run it in a worker thread, or use
        `prefetch`)."""
        return self._read()

    def recorded(self) -> RecordedRun:
        """The episode read whole, as a recorded run for `agent-monitor eval` (its frames held in
        memory)."""
        start = datetime(2000, 1, 1, tzinfo=UTC)  # only the gaps between steps matter
        steps = tuple(
            RecordedStep(s.text, start + timedelta(seconds=s.timestamp), images=s.images)
            for s in self.steps()
        )
        return RecordedRun(self.name, self.task, steps, self.outcome)


def encode_jpeg(img: PILImage, options: ReadOptions) -> bytes:
    """A frame as JPEG bytes, downscaled to `options.max_side`."""
    if img.mode != "RGB":
        img = img.convert("RGB")
    if options.max_side is not None and max(img.size) > options.max_side:
        img = img.copy()
        img.thumbnail((options.max_side, options.max_side))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=options.jpeg_quality)
    return buf.getvalue()


def _number(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        text = f"{v:.3f}" if math.isfinite(v) else str(v)
        return "0.000" if text == "-0.000" else text
    return str(v)


def vector_text(label: str, values: Sequence[Any], names: Sequence[str] | None = None) -> str:
    """`label name=value ...` (or `label [v, ...]` without names), at most MAX_VALUES values
    shown."""
    shown = list(values[:MAX_VALUES])
    more = f" (+{len(values) - MAX_VALUES} more)" if len(values) > MAX_VALUES else ""
    if names is not None and len(names) == len(values):
        body = " ".join(f"{n}={_number(v)}" for n, v in zip(names, shown, strict=False))
    else:
        body = "[" + ", ".join(_number(v) for v in shown) + "]"
    return f"{label} {body}{more}"


_DONE = object()


def prefetch(steps: Iterator[EpisodeStep], depth: int = 8) -> Iterator[EpisodeStep]:
    """Read `steps` in a worker thread, at most `depth` ahead (the reader waits when the consumer is
    slower).

    A reader's error is raised in the consumer, at the step it happened. Closing the returned
    iterator early stops the worker at its next step.
    """
    q: queue.Queue[object] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for s in steps:
                if not put(s):
                    return
            put(_DONE)
        except Exception as e:  # handed to the consumer, which raises it at this step
            put(e)
        finally:
            close = getattr(steps, "close", None)
            if close is not None:
                # a generator's open files (videos, bags) are closed in the thread that used them
                close()

    worker = threading.Thread(target=work, name="robotdata-decode", daemon=True)
    worker.start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, EpisodeStep)
            yield item
    finally:
        stop.set()
        worker.join(timeout=5.0)

"""ROS 2 bags in MCAP: camera topics (sensor_msgs/Image, CompressedImage), a task topic and text
topics -> steps.

Read with `mcap` and `mcap-ros2-support` (foxglove/mcap at 95d0673564eac0b27fd9a8616083fdd47c4c2ec7:
python/mcap/mcap/reader.py `make_reader`, `get_summary`, `iter_decoded_messages` in log-time order;
python/mcap-ros2-support/mcap_ros2/decoder.py `DecoderFactory` for CDR messages with `ros2msg`
schemas; decoded messages are SimpleNamespace-like objects with `__slots__`,
python/mcap-ros2-support/mcap_ros2/_dynamic.py).

The mapping, one bag = one episode:
- a control tick is a message on the first camera topic (sorted by name, or the first of `cameras`);
  a step is taken every `every` ticks, with the newest frame of every camera topic at that moment;
- the step's text is the step's time and the newest message of each text topic (by default every
  topic that is neither a camera nor the task or outcome topic: `std_msgs/String` as its text, other
  messages field by field);
- the task is `task` when given, else the first `std_msgs/String` on `task_topic` (default `/task`);
- the outcome is the last message on `outcome_topic` (default `/outcome`): a `std_msgs/String`
  "success" or "failure", or a `std_msgs/Bool`; none when the bag has no such topic.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ._episode import (
    INSTALL_HINT,
    Episode,
    EpisodeStep,
    ReadOptions,
    RobotDataError,
    encode_jpeg,
    vector_text,
)

IMAGE_TYPES = frozenset({"sensor_msgs/msg/Image", "sensor_msgs/Image"})
COMPRESSED_TYPES = frozenset({"sensor_msgs/msg/CompressedImage", "sensor_msgs/CompressedImage"})
# Raw encodings (sensor_msgs/image_encodings.hpp) -> PIL mode and raw decoder mode.
ENCODINGS = {
    "rgb8": ("RGB", "RGB"),
    "bgr8": ("RGB", "BGR"),
    "8UC3": ("RGB", "BGR"),
    "rgba8": ("RGBA", "RGBA"),
    "bgra8": ("RGBA", "BGRA"),
    "mono8": ("L", "L"),
    "8UC1": ("L", "L"),
}
MAX_TOPIC_TEXT = 400
"""Characters of one text topic's message in a step's text, at most."""


def _libs() -> tuple[Any, Any, Any]:
    try:
        from mcap.exceptions import McapError
        from mcap.reader import make_reader
        from mcap_ros2.decoder import DecoderFactory
    except ImportError:
        raise RobotDataError(
            f"reading MCAP files needs mcap and mcap-ros2-support: {INSTALL_HINT}"
        ) from None
    return make_reader, DecoderFactory, McapError


def is_mcap(path: Path) -> bool:
    """Whether `path` is an MCAP file by its name."""
    return path.is_file() and path.suffix.lower() == ".mcap"


def message_text(msg: Any, depth: int = 0) -> str:
    """A decoded ROS 2 message as short text: a String's data, else `field=value` pairs."""
    if isinstance(msg, (str, int, float, bool)):
        return f"{msg:.3f}" if isinstance(msg, float) else str(msg)
    if isinstance(msg, (bytes, bytearray)):
        return f"<{len(msg)} bytes>"
    if isinstance(msg, (list, tuple)):
        if all(isinstance(v, (int, float)) for v in msg):
            return vector_text("", list(msg)).strip()
        return (
            "["
            + ", ".join(message_text(v, depth + 1) for v in msg[:8])
            + (", ..." if len(msg) > 8 else "")
            + "]"
        )
    slots = getattr(msg, "__slots__", None)
    if not slots or depth > 3:
        return str(msg)[:MAX_TOPIC_TEXT]
    if list(slots) == ["data"]:
        return message_text(msg.data, depth + 1)
    return " ".join(
        f"{s}={message_text(getattr(msg, s), depth + 1)}" for s in slots if s != "header"
    )


def _frame(msg: Any, schema: str, topic: str, options: ReadOptions) -> bytes:
    from PIL import Image, UnidentifiedImageError

    if schema in COMPRESSED_TYPES:
        try:
            with Image.open(io.BytesIO(bytes(msg.data))) as img:
                return encode_jpeg(img, options)
        except (UnidentifiedImageError, OSError) as e:
            raise RobotDataError(
                f"{topic}: a CompressedImage ({msg.format!r}) does not decode ({e})"
            ) from None
    encoding = str(msg.encoding)
    if encoding not in ENCODINGS:
        raise RobotDataError(
            f"{topic}: image encoding {encoding!r} is not supported; use one of "
            f"{', '.join(ENCODINGS)} "
            "or publish sensor_msgs/CompressedImage"
        )
    mode, raw = ENCODINGS[encoding]
    width, height, step, data = int(msg.width), int(msg.height), int(msg.step), bytes(msg.data)
    if width <= 0 or height <= 0 or step < width * len(raw) or len(data) < step * height:
        raise RobotDataError(
            f"{topic}: image {width}x{height} with step {step} needs {step * height} bytes, "
            f"has {len(data)}"
        )
    pic = Image.frombuffer(mode, (width, height), data, "raw", raw, step, 1)
    return encode_jpeg(pic, options)


class McapBag:
    """An MCAP file of ROS 2 messages: its topics and the one episode it holds."""

    def __init__(
        self,
        path: str | Path,
        *,
        task: str | None = None,
        task_topic: str = "/task",
        outcome_topic: str = "/outcome",
        cameras: Sequence[str] | None = None,
        text_topics: Sequence[str] | None = None,
    ) -> None:
        self.path = Path(path)
        make_reader, decoder_factory, mcap_error = _libs()
        self._make_reader, self._factory, self._error = make_reader, decoder_factory, mcap_error
        with self._open() as reader:
            try:
                summary = reader.get_summary()
            except (mcap_error, ValueError, OSError) as e:
                raise RobotDataError(f"{self.path}: not a readable MCAP file ({e})") from None
            if summary is None:
                raise RobotDataError(
                    f"{self.path}: no summary section (the recording was not closed?); repair "
                    "it with "
                    "`mcap recover` and read the repaired file"
                )
            self._schemas = {
                cid: summary.schemas[ch.schema_id].name if ch.schema_id in summary.schemas else ""
                for cid, ch in summary.channels.items()
            }
            self.topics: dict[str, str] = {
                ch.topic: self._schemas[cid] for cid, ch in summary.channels.items()
            }
            counts = summary.statistics.channel_message_counts if summary.statistics else {}
            self._counts = {
                summary.channels[cid].topic: n
                for cid, n in counts.items()
                if cid in summary.channels
            }
        found = sorted(t for t, s in self.topics.items() if s in IMAGE_TYPES | COMPRESSED_TYPES)
        self.cameras = tuple(cameras) if cameras else tuple(found)
        if not self.cameras:
            raise RobotDataError(
                f"{self.path}: no camera topic (sensor_msgs/Image or CompressedImage); its topics: "
                + (", ".join(f"{t} ({s})" for t, s in sorted(self.topics.items())) or "none")
            )
        for c in self.cameras:
            if self.topics.get(c) not in IMAGE_TYPES | COMPRESSED_TYPES:
                raise RobotDataError(
                    f"{self.path}: {c} is not a sensor_msgs/Image or CompressedImage topic"
                )
        self.task_topic, self.outcome_topic = task_topic, outcome_topic
        skip = set(self.cameras) | {task_topic, outcome_topic}
        self.text_topics = (
            tuple(text_topics)
            if text_topics is not None
            else tuple(
                sorted(
                    t
                    for t, s in self.topics.items()
                    if t not in skip and s not in IMAGE_TYPES | COMPRESSED_TYPES
                )
            )
        )
        self.task = task if task is not None else self._first_text(task_topic)
        if not self.task:
            raise RobotDataError(
                f"{self.path}: no task: no std_msgs/String on {task_topic}; pass the task "
                "(--task TEXT) or its topic "
                "(--task-topic)"
            )
        self.ticks = self._counts.get(self.cameras[0], 0)
        self.outcome = self._outcome()

    @contextmanager
    def _open(self) -> Iterator[Any]:
        try:
            f = self.path.open("rb")
        except OSError as e:
            raise RobotDataError(f"{self.path}: cannot open ({e.strerror})") from None
        with f:
            try:
                reader = self._make_reader(f, decoder_factories=[self._factory()])
            except (self._error, ValueError, OSError) as e:
                raise RobotDataError(f"{self.path}: not an MCAP file ({e})") from None
            yield reader

    def _messages(
        self, reader: Any, topics: Sequence[str], *, reverse: bool = False
    ) -> Iterator[Any]:
        try:
            yield from reader.iter_decoded_messages(topics=list(topics), reverse=reverse)
        except RobotDataError:
            raise
        except (self._error, ValueError, KeyError, IndexError, OSError, UnicodeDecodeError) as e:
            raise RobotDataError(
                f"{self.path}: a message does not decode ({type(e).__name__}: {e})"
            ) from None

    def _first_text(self, topic: str) -> str:
        if topic not in self.topics:
            return ""
        with self._open() as reader:
            for m in self._messages(reader, [topic]):
                return message_text(m.decoded_message).strip()
        return ""

    def _outcome(self) -> float | None:
        if self.outcome_topic not in self.topics:
            return None
        with self._open() as reader:
            for m in self._messages(reader, [self.outcome_topic], reverse=True):
                v = getattr(m.decoded_message, "data", None)
                if isinstance(v, bool):
                    return 1.0 if v else 0.0
                if isinstance(v, str) and v.strip().lower() in ("success", "failure"):
                    return 1.0 if v.strip().lower() == "success" else 0.0
                raise RobotDataError(
                    f"{self.path}: {self.outcome_topic} says {v!r}; publish 'success' or "
                    "'failure' (or a Bool)"
                )
        return None

    def episode(self, options: ReadOptions) -> Episode:
        """The bag as one episode, steps read lazily."""
        planned = options.planned(self.ticks)
        duration = None
        fps = None
        if self.ticks > 1:
            with self._open() as reader:
                times = [
                    m.message.log_time
                    for _, m in zip(
                        range(2), self._messages(reader, self.cameras[:1]), strict=False
                    )
                ]
                last = next(self._messages(reader, self.cameras[:1], reverse=True)).message.log_time
            duration = (last - times[0]) / 1e9
            fps = (self.ticks - 1) / duration if duration > 0 else None
        return Episode(
            name=self.path.stem,
            task=self.task,
            source=str(self.path),
            frames=self.ticks,
            fps=fps,
            cameras=self.cameras,
            outcome=self.outcome,
            planned_steps=planned,
            truncated=planned * options.every < self.ticks,
            _read=lambda: self._steps(options, planned),
        )

    def _steps(self, options: ReadOptions, planned: int) -> Iterator[EpisodeStep]:
        keep = options.keeps_frames(planned)
        primary = self.cameras[0]
        latest: dict[str, tuple[Any, str]] = {}
        texts: dict[str, str] = {}
        tick = 0
        ordinal = 0
        start: int | None = None
        pending: int | None = None  # the log time of the tick being collected
        said: list[str] = []  # the text topics as they were at that tick's primary frame

        def step(t_ns: int) -> EpisodeStep:
            nonlocal ordinal
            assert start is not None
            t = (t_ns - start) / 1e9
            images: tuple[bytes, ...] = ()
            if keep(ordinal):
                images = tuple(_frame(*latest[c], c, options) for c in self.cameras if c in latest)
            parts = [f"t={t:.2f}s", *said]
            ordinal += 1
            return EpisodeStep(
                index=ordinal,
                frame_index=tick - 1,
                timestamp=t,
                text="; ".join(parts),
                images=images,
            )

        with self._open() as reader:
            for m in self._messages(reader, list(self.cameras) + list(self.text_topics)):
                topic = m.channel.topic
                if topic == primary:
                    # A tick's step is complete when the next tick begins (its other cameras' frames
                    # are in).
                    if pending is not None:
                        yield step(pending)
                        if ordinal >= planned:
                            return
                        pending = None
                    start = m.message.log_time if start is None else start
                    tick += 1
                    if tick % options.every == 0 or tick == self.ticks:
                        pending = m.message.log_time
                        # The action that led to this frame was logged before it; the other cameras'
                        # frames of this tick come just after it.
                        said = [f"{k}: {texts[k]}" for k in self.text_topics if k in texts]
                if topic in self.text_topics:
                    texts[topic] = message_text(m.decoded_message)[:MAX_TOPIC_TEXT]
                else:
                    latest[topic] = (m.decoded_message, m.schema.name if m.schema else "")
            if pending is not None and ordinal < planned:
                yield step(pending)
        if ordinal == 0 and self.ticks:
            raise RobotDataError(f"{self.path}: {primary} has no readable message")

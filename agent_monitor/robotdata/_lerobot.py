"""LeRobot v3 datasets: meta/info.json, episodes in meta/episodes/*.parquet, frames in
data/*.parquet, mp4 videos.

Read with pyarrow and PyAV only (no lerobot, no torch). The layout, as lerobot writes it
(huggingface/lerobot at 7427f31801f944f5ec9ce53cda02862ce7d1638b):

- `meta/info.json` (src/lerobot/datasets/utils.py, DatasetInfo): `codebase_version` ("v3.0"), `fps`,
  `features` (name -> dtype, shape, names; dtype "video" for cameras stored as mp4, "image" for
  images in the parquet), `data_path` "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
  and `video_path` "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4";
- `meta/episodes/chunk-*/file-*.parquet` (dataset_metadata.py, save_episode /
  _save_episode_metadata): one row per episode with `episode_index`, `tasks` (list of strings),
  `length`, `data/chunk_index`, `data/file_index`, `dataset_from_index`, `dataset_to_index`, and per
  camera `videos/{key}/chunk_index`, `.../file_index`, `.../from_timestamp`, `.../to_timestamp`
  (many episodes share one parquet and one mp4 file);
- `meta/tasks.parquet`: the task strings (index column `task`) with their `task_index`;
- a data row per frame: `timestamp`, `frame_index`, `episode_index`, `index`, `task_index` and the
  features;
- a camera's frame for a row is the video's frame at `from_timestamp + timestamp`
  (dataset_reader.py, _query_videos), decoded here as lerobot's PyAV path does (video_utils.py,
  decode_video_frames_pyav: seek to the keyframe before, decode forward).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import stat
import string
from collections.abc import Iterator, Mapping, Sequence
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

DEFAULT_FEATURES = ("timestamp", "frame_index", "episode_index", "index", "task_index")
"""Bookkeeping columns of every data row (lerobot.utils.constants.DEFAULT_FEATURES): not step
text."""
SUCCESS_COLUMNS = ("next.success", "success", "is_success")
"""Where a dataset records success: a per-frame column (the episode succeeded if its last frame says
so) or an episode column."""


MAX_INFO_BYTES = 4 * 1024 * 1024
"""The largest meta/info.json read (a real one is a few kilobytes)."""
_FIELDS = frozenset({"chunk_index", "file_index", "video_key", "episode_index", "episode_chunk"})
_INT_SPEC = re.compile(r"0?[1-9]?\dd|d|")
"""What a template may say of an integer field: lerobot's `03d`, at most two digits of width."""


def fill(template: str, source: Path, **fields: object) -> str:
    """A metadata path template filled safely: named fields only, integer widths of two digits at
    most.

    `str.format` would evaluate `{chunk_index.__class__.__mro__}` and build a billion-character path
    for `{chunk_index:0999999999d}`: a template from a downloaded dataset is data, filled field by
    field here.
    """
    out: list[str] = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise RobotDataError(
            f"{source}: path template {template[:200]!r} does not parse ({e})"
        ) from None
    for literal, name, spec, conversion in parsed:
        out.append(literal)
        if name is None:
            continue
        if name not in _FIELDS or name not in fields or conversion is not None:
            raise RobotDataError(
                f"{source}: path template {template[:200]!r} names {{{name[:50]}}}; only "
                f"{', '.join(sorted(_FIELDS))} may appear (no attributes, indexes or conversions)"
            )
        value, spec = fields[name], spec or ""
        if isinstance(value, int):
            if not _INT_SPEC.fullmatch(spec):
                raise RobotDataError(
                    f"{source}: path template {template[:200]!r} formats {name} as "
                    f"{spec[:20]!r}; use e.g. 03d"
                )
            out.append(format(value, spec or "d"))
        elif spec:
            raise RobotDataError(
                f"{source}: path template {template[:200]!r} formats {name} as {spec[:20]!r}"
            )
        else:
            out.append(str(value))
    return "".join(out)


def regular_file(path: Path, root: Path) -> Path:
    """`path` resolved, checked to be inside the dataset `root` and a regular file (not a FIFO,
    device, directory)."""
    resolved = path.resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise RobotDataError(
            f"{path}: outside the dataset {root} (its metadata may only name files inside it)"
        )
    try:
        st = os.stat(resolved)
    except FileNotFoundError:
        raise RobotDataError(
            f"{path}: missing (the dataset's metadata names it; is the download complete?)"
        ) from None
    except OSError as e:
        raise RobotDataError(f"{path}: cannot be read ({e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise RobotDataError(
            f"{path}: not a regular file (a FIFO, device or directory is never read)"
        )
    return resolved


def _pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise RobotDataError(f"reading LeRobot datasets needs pyarrow: {INSTALL_HINT}") from None
    return pq


def _read_table(path: Path, **kw: Any) -> Any:
    pq = _pyarrow()
    import pyarrow as pa

    try:
        return pq.read_table(path, **kw)
    except FileNotFoundError:
        raise RobotDataError(
            f"{path}: missing (the dataset's metadata names it; is the download complete?)"
        ) from None
    except (pa.ArrowException, OSError) as e:
        raise RobotDataError(
            f"{path}: not a readable parquet file ({e}); download the dataset again"
        ) from None


def is_lerobot(path: Path) -> bool:
    """Whether `path` looks like a LeRobot dataset directory (it has meta/info.json)."""
    return path.is_dir() and (path / "meta" / "info.json").is_file()


class LeRobotDataset:
    """A LeRobot v3 dataset on disk: its info, episodes and tasks (no frames are read until
    asked)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        info_path = self.root / "meta" / "info.json"
        if not info_path.is_file():
            raise RobotDataError(f"{self.root}: not a LeRobot dataset (no meta/info.json)")
        regular_file(info_path, self.root)
        try:
            with info_path.open("rb") as f:
                raw = f.read(MAX_INFO_BYTES + 1)
            if len(raw) > MAX_INFO_BYTES:
                raise RobotDataError(
                    f"{info_path}: over {MAX_INFO_BYTES} bytes; not a LeRobot info.json"
                )
            info = json.loads(raw.decode("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise RobotDataError(f"{info_path}: not valid JSON ({e})") from None
        except RecursionError:
            raise RobotDataError(
                f"{info_path}: nests too deeply to be a LeRobot info.json"
            ) from None
        if not isinstance(info, dict):
            raise RobotDataError(f"{info_path}: expected a JSON object")
        version = str(info.get("codebase_version", ""))
        if not version.startswith("v3"):
            raise RobotDataError(
                f"{info_path}: codebase_version {version or 'missing'!r}; only LeRobot v3 "
                "datasets are read "
                "(convert older ones with lerobot's convert_dataset_v21_to_v30)"
            )
        fps = info.get("fps")
        features = info.get("features")
        if not isinstance(fps, (int, float)) or fps <= 0 or not isinstance(features, dict):
            raise RobotDataError(f"{info_path}: needs a positive 'fps' and a 'features' object")
        self.info: dict[str, Any] = info
        self.fps = float(fps)
        self.features: dict[str, dict[str, Any]] = {
            k: v for k, v in features.items() if isinstance(v, dict)
        }
        self.data_path = str(
            info.get("data_path") or "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
        )
        self.video_path = str(
            info.get("video_path")
            or "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
        )
        self.video_keys = tuple(k for k, f in self.features.items() if f.get("dtype") == "video")
        self.image_keys = tuple(k for k, f in self.features.items() if f.get("dtype") == "image")
        self.episodes = self._episodes()
        self.tasks = self._tasks()

    def _episodes(self) -> list[dict[str, Any]]:
        files = sorted((self.root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
        if not files:
            raise RobotDataError(
                f"{self.root}: no meta/episodes/chunk-*/file-*.parquet (not a v3 dataset?)"
            )
        rows: list[dict[str, Any]] = []
        for f in files:
            table = _read_table(regular_file(f, self.root))
            cols = [c for c in table.column_names if not c.startswith("stats/")]
            rows.extend(table.select(cols).to_pylist())
        for r in rows:
            for key in ("episode_index", "length", "data/chunk_index", "data/file_index"):
                if not isinstance(r.get(key), int):
                    raise RobotDataError(f"{self.root}: an episode row lacks the integer {key!r}")
        return sorted(rows, key=lambda r: int(r["episode_index"]))

    def _tasks(self) -> dict[int, str]:
        path = self.root / "meta" / "tasks.parquet"
        if not path.is_file():
            return {}
        rows = _read_table(regular_file(path, self.root)).to_pylist()
        out: dict[int, str] = {}
        for r in rows:
            if isinstance(r.get("task_index"), int) and isinstance(r.get("task"), str):
                out[int(r["task_index"])] = r["task"]
        return out

    def names(self, key: str) -> list[str] | None:
        """The names of a vector feature's components, when info.json gives them."""
        names = self.features.get(key, {}).get("names")
        if isinstance(names, Mapping):  # {"motors": [...]} in some datasets
            names = next(iter(names.values()), None)
        if isinstance(names, list) and all(isinstance(n, str) for n in names):
            return names
        return None

    def read(
        self, options: ReadOptions, *, episodes: Sequence[int] | None = None
    ) -> Iterator[Episode]:
        """The dataset's episodes (all, or those with these `episode_index` values), steps read
        lazily."""
        wanted = None if episodes is None else set(episodes)
        known = {int(r["episode_index"]) for r in self.episodes}
        if wanted is not None and (missing := sorted(wanted - known)):
            raise RobotDataError(
                f"{self.root}: no episode {missing} (it has {len(known)}: "
                f"0..{max(known, default=0)})"
            )
        for row in self.episodes:
            index = int(row["episode_index"])
            if wanted is not None and index not in wanted:
                continue
            length = int(row["length"])
            planned = options.planned(length)
            outcome = self._episode_outcome(row)
            if outcome is None and any(k in self.features for k in SUCCESS_COLUMNS):
                outcome = self.outcome_from_frames(row)
            yield Episode(
                name=f"{self.root.name}-episode-{index:06d}",
                task=self._task_of(row),
                source=str(self.root),
                frames=length,
                fps=self.fps,
                cameras=self.video_keys + self.image_keys,
                outcome=outcome,
                planned_steps=planned,
                truncated=planned * options.every < length,
                _read=functools.partial(self._steps, row, options),
            )

    def _task_of(self, row: Mapping[str, Any]) -> str:
        tasks = row.get("tasks")
        if isinstance(tasks, list) and (
            texts := [t for t in tasks if isinstance(t, str) and t.strip()]
        ):
            return "; ".join(texts)
        # no task list on the episode row: the first frame's task_index in meta/tasks.parquet
        if self.tasks:
            _path, table = self._rows(row)
            if "task_index" in table.column_names and table.num_rows:
                return self.tasks.get(int(table.column("task_index")[0].as_py()), "")
        return ""

    def _episode_outcome(self, row: Mapping[str, Any]) -> float | None:
        for key in SUCCESS_COLUMNS:
            v = row.get(key)
            if isinstance(v, (bool, int, float)) and not (isinstance(v, float) and math.isnan(v)):
                return 1.0 if float(v) >= 0.5 else 0.0
        return None

    def _rows(self, row: Mapping[str, Any]) -> Any:
        path = self.root / fill(
            self.data_path,
            self.root / "meta" / "info.json",
            chunk_index=int(row["data/chunk_index"]),
            file_index=int(row["data/file_index"]),
            episode_index=int(row["episode_index"]),
        )
        regular_file(path, self.root)
        import pyarrow.compute as pc

        table = _read_table(path, filters=pc.field("episode_index") == int(row["episode_index"]))
        if "timestamp" not in table.column_names:
            raise RobotDataError(f"{path}: no 'timestamp' column")
        if "frame_index" in table.column_names:
            table = table.sort_by("frame_index")
        return path, table

    def _steps(self, row: Mapping[str, Any], options: ReadOptions) -> Iterator[EpisodeStep]:
        path, table = self._rows(row)
        length = table.num_rows
        if length == 0:
            raise RobotDataError(f"{path}: no rows for episode {row['episode_index']}")
        planned = options.planned(length)
        keep = options.keeps_frames(planned)
        text_keys = [
            k
            for k in table.column_names
            if k not in DEFAULT_FEATURES
            and k not in self.image_keys
            and k not in SUCCESS_COLUMNS
            and self.features.get(k, {}).get("dtype") not in ("video", "image", "string")
        ]
        cursors = [self._cursor(row, key) for key in self.video_keys]
        try:
            for ordinal, i in enumerate(range(0, length, options.every)):
                if ordinal >= planned:
                    break
                # One step per `every` ticks, at the window's last tick (what the robot had done by
                # then).
                at = min(i + options.every, length) - 1
                rec = table.slice(at, 1).to_pylist()[0]
                ts = float(rec["timestamp"])
                images: tuple[bytes, ...] = ()
                if cursors or self.image_keys:
                    # decoded always: the video is coded frame to frame
                    frames = [c.at(ts) for c in cursors]
                    if keep(ordinal):
                        images = tuple(encode_jpeg(f, options) for f in frames) + tuple(
                            self._image(rec[k], path, k, options) for k in self.image_keys
                        )
                parts = [f"t={ts:.2f}s"]
                for k in text_keys:
                    v = rec.get(k)
                    if isinstance(v, list):
                        parts.append(vector_text(k, v, self.names(k)))
                    elif v is not None:
                        parts.append(f"{k} {v}")
                yield EpisodeStep(
                    index=ordinal + 1,
                    frame_index=int(rec.get("frame_index", at)),
                    timestamp=ts,
                    text="; ".join(parts),
                    images=images,
                )
        finally:
            for c in cursors:
                c.close()

    def outcome_from_frames(self, row: Mapping[str, Any]) -> float | None:
        """Success from a per-frame column (`next.success`) at the episode's last frame, when the
        dataset has one."""
        _path, table = self._rows(row)
        for key in SUCCESS_COLUMNS:
            if key in table.column_names and table.num_rows:
                v = table.column(key)[table.num_rows - 1].as_py()
                if isinstance(v, (bool, int, float)):
                    return 1.0 if float(v) >= 0.5 else 0.0
        return None

    def _cursor(self, row: Mapping[str, Any], key: str) -> VideoCursor:
        try:
            chunk = int(row[f"videos/{key}/chunk_index"])
            file = int(row[f"videos/{key}/file_index"])
            start = float(row[f"videos/{key}/from_timestamp"])
        except (KeyError, TypeError, ValueError):
            raise RobotDataError(
                f"{self.root}: episode {row['episode_index']} lacks videos/{key}/chunk_index, "
                "file_index or "
                "from_timestamp in meta/episodes"
            ) from None
        path = self.root / fill(
            self.video_path,
            self.root / "meta" / "info.json",
            video_key=key,
            chunk_index=chunk,
            file_index=file,
            episode_index=int(row["episode_index"]),
        )
        regular_file(path, self.root)
        return VideoCursor(path, start, self.fps)

    def _image(self, value: Any, path: Path, key: str, options: ReadOptions) -> bytes:
        data = value.get("bytes") if isinstance(value, Mapping) else None
        if not isinstance(data, (bytes, bytearray)):
            raise RobotDataError(f"{path}: image column {key!r} holds no image bytes")
        import io
        import warnings

        from PIL import Image, UnidentifiedImageError

        try:
            with warnings.catch_warnings():
                # Past Pillow's decompression-bomb size a warning, twice past it an error: both
                # refused here.
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                with Image.open(io.BytesIO(bytes(data))) as img:
                    return encode_jpeg(img, options)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise RobotDataError(
                f"{path}: image column {key!r} holds an image too large to decode ({e})"
            ) from None
        except (UnidentifiedImageError, OSError, ValueError) as e:
            raise RobotDataError(
                f"{path}: image column {key!r} holds an undecodable image ({e})"
            ) from None


class VideoCursor:
    """Frames of one mp4 at increasing times: seek once to the keyframe before `start`, then
    decode forward."""

    def __init__(self, path: Path, start: float, fps: float) -> None:
        try:
            import av
        except ImportError:
            raise RobotDataError(f"decoding LeRobot videos needs PyAV: {INSTALL_HINT}") from None
        self.path = path
        self.start = start
        # The frame shown at t is the last one at or before t + half a period; further than that
        # (plus lerobot's own tolerance, 1e-4 s) from t means the video ran out or its clock
        # differs: an error, not a match.
        self._half = 0.5 / fps
        self.tolerance = self._half + 1e-4
        try:
            self._container = av.open(str(path))
        except FileNotFoundError:
            raise RobotDataError(f"{path}: missing (meta/episodes names it)") from None
        # a corrupt header's text: UnicodeDecodeError
        except (av.FFmpegError, OSError, ValueError) as e:
            raise RobotDataError(
                f"{path}: not a readable video ({type(e).__name__}: {e})"
            ) from None
        try:
            if not self._container.streams.video:
                raise RobotDataError(f"{path}: no video stream")
            self._stream = self._container.streams.video[0]
            self._stream.thread_type = "AUTO"  # FFmpeg's own decode threads, off the GIL
            base = self._stream.time_base
            if start > 0 and base is not None:
                self._container.seek(
                    max(0, round(start / base) - 1),
                    backward=True,
                    any_frame=False,
                    stream=self._stream,
                )
            self._frames = self._container.decode(self._stream)
            self._cur: Any = None
            self._cur_t = -math.inf
            self._next, self._next_t = self._pull()
        except (av.FFmpegError, OSError, ValueError) as e:
            self._container.close()
            raise RobotDataError(
                f"{path}: not a readable video ({type(e).__name__}: {e})"
            ) from None
        except BaseException:
            self._container.close()
            raise

    def _pull(self) -> tuple[Any, float]:
        import av

        try:
            while True:
                frame = next(self._frames)
                if frame.pts is None or frame.time is None:
                    continue
                return frame, float(frame.time) - self.start
        except StopIteration:
            return None, math.inf
        # ValueError: UnicodeDecodeError of a corrupt stream's text
        except (av.FFmpegError, ValueError) as e:
            raise RobotDataError(
                f"{self.path}: the video does not decode ({type(e).__name__}: {e})"
            ) from None

    def at(self, t: float) -> Any:
        """The frame shown at `t` seconds into the episode, as a PIL image."""
        while self._next is not None and self._next_t <= t + self._half:
            self._cur, self._cur_t = self._next, self._next_t
            self._next, self._next_t = self._pull()
        if self._cur is None or abs(self._cur_t - t) > self.tolerance:
            raise RobotDataError(
                f"{self.path}: no frame within {self.tolerance:.3f} s of {self.start + t:.3f} s "
                "(the video is shorter than the episode's data, or its timestamps differ)"
            )
        try:
            return self._cur.to_image()
        except (ValueError, OSError) as e:
            raise RobotDataError(
                f"{self.path}: a frame does not convert to an image ({e})"
            ) from None

    def close(self) -> None:
        """Close the video file."""
        self._container.close()

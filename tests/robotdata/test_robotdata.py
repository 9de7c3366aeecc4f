"""Robot data in: LeRobot v3 datasets and ROS 2 MCAP bags written by the tests, read into steps
with frames."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image

from agent_monitor import FrameBudget
from agent_monitor.robotdata import (
    Episode,
    LeRobotDataset,
    ReadOptions,
    RobotDataError,
    prefetch,
    read_episodes,
)
from tests.fixtures.robot_data import CAMERAS, LeRobotSpec, level, make_lerobot, make_mcap


def _gray(data: bytes) -> tuple[tuple[int, int], int]:
    img = Image.open(io.BytesIO(data))
    assert img.format == "JPEG"
    return img.size, int(img.convert("L").getpixel((img.size[0] // 2, img.size[1] // 2)))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_lerobot(tmp_path_factory.mktemp("robot") / "toy")


@pytest.fixture(scope="module")
def bag(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_mcap(tmp_path_factory.mktemp("robot") / "stack.mcap")


def _read(
    path: Path, options: ReadOptions | None = None, **kw: object
) -> list[tuple[Episode, list]]:  # type: ignore[type-arg]
    return [(ep, list(ep.steps())) for ep in read_episodes(path, options, **kw)]  # type: ignore[arg-type]


def test_lerobot_episodes_tasks_outcomes_and_frames_in_order(dataset: Path) -> None:
    spec = LeRobotSpec()
    read = _read(dataset)
    assert [ep.name for ep, _ in read] == ["toy-episode-000000", "toy-episode-000001"]
    assert [ep.task for ep, _ in read] == list(spec.tasks)
    assert [ep.outcome for ep, _ in read] == [1.0, 0.0]  # next.success at the episode's last frame
    assert [ep.frames for ep, _ in read] == list(spec.lengths) and all(
        ep.fps == 10.0 for ep, _ in read
    )
    for (ep, steps), n in zip(read, spec.lengths, strict=True):
        assert ep.cameras == tuple(CAMERAS) and not ep.truncated
        assert [s.index for s in steps] == list(range(1, n + 1))
        assert [s.frame_index for s in steps] == list(range(n))
        assert [s.timestamp for s in steps] == pytest.approx([i / 10 for i in range(n)])
        for i, s in enumerate(steps):
            # Both cameras, at their own resolution, and the frame of this very step (the second
            # episode's frames come from the middle of the same mp4 files: from_timestamp).
            assert [_gray(b)[0] for b in s.images] == list(CAMERAS.values())
            assert all(abs(_gray(b)[1] - level(i)) <= 4 for b in s.images), (ep.name, i)
    first = read[1][1][2]
    assert first.text == "t=0.20s; action dx=0.300 dy=-0.050; observation.state x=2.000 y=1.000"
    assert "stats" not in first.text and "next.success" not in first.text


def test_lerobot_every_max_steps_and_frame_budget_bound_the_work(dataset: Path) -> None:
    (_, a), (_, b) = _read(dataset, ReadOptions(every=3))
    assert [s.frame_index for s in a] == [2, 5] and [s.frame_index for s in b] == [2, 5, 7]
    assert all(abs(_gray(s.images[0])[1] - level(s.frame_index)) <= 4 for s in a + b)
    (ep, steps), _ = _read(dataset, ReadOptions(max_steps=4))
    assert ep.truncated and ep.planned_steps == 4 and len(steps) == 4
    budget = FrameBudget(every=2, recent=1, per_stride=2)
    _, (ep, steps) = _read(dataset, ReadOptions(frame_budget=budget))
    kept = [s.frame_index for s in steps if s.images]
    assert kept == sorted(set(budget.anchors(8)) | {7}) == [0, 2, 4, 7]
    assert all(len(s.images) == 2 for s in steps if s.images)
    (_, small), _ = _read(dataset, ReadOptions(max_side=16))
    assert [_gray(b)[0] for b in small[0].images] == [(16, 12), (16, 16)]


def test_lerobot_select_episodes_and_replace_task(dataset: Path) -> None:
    [(ep, steps)] = _read(dataset, episodes=[1], task="Open the top drawer")
    assert ep.name.endswith("000001") and ep.task == "Open the top drawer" and len(steps) == 8
    with pytest.raises(RobotDataError, match=r"no episode \[5\]"):
        list(read_episodes(dataset, episodes=[5]))


def test_lerobot_reader_reads_the_dataset_metadata(dataset: Path) -> None:
    ds = LeRobotDataset(dataset)
    assert ds.video_keys == tuple(CAMERAS) and ds.fps == 10.0
    assert ds.tasks == {0: "Put the red cube in the bowl", 1: "Open the drawer"}
    assert ds.names("action") == ["dx", "dy"]


def test_mcap_bag_is_one_episode_with_task_text_and_both_cameras(bag: Path) -> None:
    [(ep, steps)] = _read(bag)
    assert (
        ep.name == "stack"
        and ep.task == "Stack the blue block on the green one"
        and ep.outcome == 1.0
    )
    assert ep.cameras == ("/camera/front", "/camera/wrist") and ep.frames == 12
    assert ep.fps == pytest.approx(10.0)
    assert [s.index for s in steps] == list(range(1, 13))
    for i, s in enumerate(steps):
        assert s.timestamp == pytest.approx(i / 10)
        assert s.text == f"t={i / 10:.2f}s; /cmd: move dx={0.1 * (i + 1):.1f}"
        sizes = [_gray(b) for b in s.images]
        assert [z for z, _ in sizes] == [(64, 48), (32, 32)]
        # the wrist frame logged just after is this tick's
        assert all(abs(g - level(i)) <= 4 for _, g in sizes), i
    [(_, every)] = _read(bag, ReadOptions(every=5))
    assert [s.frame_index for s in every] == [4, 9, 11]


def test_mcap_task_from_the_command_line_and_other_encodings(tmp_path: Path) -> None:
    no_task = make_mcap(tmp_path / "a.mcap", task=None, outcome=None)
    with pytest.raises(
        RobotDataError,
        match=r"no task: no std_msgs/String on /task; pass the " r"task \(--task TEXT\)",
    ):
        list(read_episodes(no_task))
    [(ep, steps)] = _read(no_task, task="Pick up the cup")
    assert ep.task == "Pick up the cup" and ep.outcome is None and len(steps) == 12
    bgr = make_mcap(tmp_path / "b.mcap", encoding="bgr8")
    assert _gray(_read(bgr)[0][1][3].images[0])[1] == pytest.approx(level(3), abs=4)
    bayer = make_mcap(tmp_path / "c.mcap", encoding="bayer_rggb8")
    with pytest.raises(
        RobotDataError,
        match=r"/camera/front: image encoding 'bayer_rggb8' is not supported; " r"use one of rgb8",
    ):
        _read(bayer)


def test_bad_files_are_clear_errors(tmp_path: Path, dataset: Path, bag: Path) -> None:
    with pytest.raises(RobotDataError, match="no such file or directory"):
        list(read_episodes(tmp_path / "nothing"))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(
        RobotDataError,
        match=r"neither a LeRobot v3 dataset directory \(with " r"meta/info.json\) nor an .mcap",
    ):
        list(read_episodes(tmp_path / "notes.txt"))
    # An older dataset: named, with what to do.
    old = make_lerobot(tmp_path / "old")
    info = (old / "meta" / "info.json").read_text().replace('"v3.0"', '"v2.1"')
    (old / "meta" / "info.json").write_text(info)
    with pytest.raises(
        RobotDataError,
        match=r"codebase_version 'v2.1'; only LeRobot v3 .* " r"convert_dataset_v21_to_v30",
    ):
        list(read_episodes(old))
    # A corrupt episodes table, a corrupt video: the file is named.
    bad = make_lerobot(tmp_path / "bad")
    (bad / "meta" / "episodes" / "chunk-000" / "file-000.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(RobotDataError, match=r"file-000.parquet: not a readable parquet file"):
        list(read_episodes(bad))
    cut = make_lerobot(tmp_path / "cut")
    video = cut / "videos" / "observation.images.front" / "chunk-000" / "file-000.mp4"
    video.write_bytes(b"\x00\x00\x00\x18ftypisom" + b"\x00" * 200)
    [ep, _] = read_episodes(cut)
    with pytest.raises(
        RobotDataError,
        match=r"observation.images.front/chunk-000/file-000.mp4: " r"not a readable video",
    ):
        list(ep.steps())
    # A video shorter than its episode's data.
    short = make_lerobot(tmp_path / "short")
    _, ep2 = read_episodes(short)
    good = make_lerobot(tmp_path / "six", LeRobotSpec(lengths=(6,), tasks=("t",), success=(True,)))
    (short / "videos" / "observation.images.wrist" / "chunk-000" / "file-000.mp4").write_bytes(
        (good / "videos" / "observation.images.wrist" / "chunk-000" / "file-000.mp4").read_bytes()
    )
    with pytest.raises(
        RobotDataError,
        match=r"wrist/chunk-000/file-000.mp4: no frame within 0.050 s of 0.600 s \(the video "
        r"is shorter than the",
    ):
        list(ep2.steps())
    # MCAP: garbage, and a bag whose recording was cut off (no summary).
    (tmp_path / "junk.mcap").write_bytes(b"\x89MCAP0\r\n" + b"\x01" * 64)
    with pytest.raises(RobotDataError, match=r"junk.mcap: not (an|a readable) MCAP file"):
        list(read_episodes(tmp_path / "junk.mcap"))
    (tmp_path / "cut.mcap").write_bytes(bag.read_bytes()[: bag.stat().st_size // 2])
    with pytest.raises(
        RobotDataError,
        match=r"cut.mcap: (no summary section .* mcap " r"recover|not a readable MCAP)",
    ):
        list(read_episodes(tmp_path / "cut.mcap"))


def test_prefetch_reads_ahead_in_a_thread_bounded_and_raises_where_it_failed(dataset: Path) -> None:
    import threading

    threads: set[str] = set()
    done: list[int] = []

    def steps():  # type: ignore[no-untyped-def]
        ep = next(iter(read_episodes(dataset)))
        for s in ep.steps():
            threads.add(threading.current_thread().name)
            done.append(s.index)
            yield s
        raise RobotDataError("broken at the end")

    it = prefetch(steps(), depth=2)
    first = next(it)
    assert first.index == 1 and threads == {"robotdata-decode"}
    assert len(done) <= 1 + 2 + 1  # the consumer's step, the queue, and the one the worker holds
    got = [first.index]
    with pytest.raises(RobotDataError, match="broken at the end"):
        got.extend(s.index for s in it)
    assert got == [1, 2, 3, 4, 5, 6]

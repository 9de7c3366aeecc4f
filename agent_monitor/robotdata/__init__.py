"""Robot data in: LeRobot v3 datasets and ROS 2 bags (MCAP) as episodes of steps with camera frames.

Optional extra `robot` (pyarrow, PyAV, mcap, mcap-ros2-support; no torch, no lerobot). Reading is
blocking and lazy: an episode's steps are decoded as they are iterated (`prefetch` runs that in a
worker thread, a bounded number of steps ahead), and `ReadOptions` bound what one episode costs
(steps, frame size, frames kept).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from ._episode import DEFAULT_MAX_STEPS, Episode, EpisodeStep, ReadOptions, RobotDataError, prefetch
from ._lerobot import LeRobotDataset, VideoCursor, is_lerobot
from ._mcap import McapBag, is_mcap
from ._replay import ReplayStats, StartRun, StepSink, TrackerSink, episode_run_id, replay_episodes

__all__ = [
    "DEFAULT_MAX_STEPS",
    "Episode",
    "EpisodeStep",
    "LeRobotDataset",
    "McapBag",
    "ReadOptions",
    "ReplayStats",
    "RobotDataError",
    "StartRun",
    "StepSink",
    "TrackerSink",
    "VideoCursor",
    "episode_run_id",
    "is_lerobot",
    "is_mcap",
    "is_robot_data",
    "prefetch",
    "read_episodes",
    "replay_episodes",
]


def is_robot_data(path: str | Path) -> bool:
    """Whether `path` is a LeRobot dataset directory or an .mcap file."""
    p = Path(path)
    return is_lerobot(p) or is_mcap(p)


def read_episodes(
    path: str | Path,
    options: ReadOptions | None = None,
    *,
    episodes: Sequence[int] | None = None,
    task: str | None = None,
    task_topic: str = "/task",
    outcome_topic: str = "/outcome",
    cameras: Sequence[str] | None = None,
) -> Iterator[Episode]:
    """The episodes of a LeRobot v3 dataset directory (`episodes`: which) or of an .mcap file (one
    episode).

    `task` replaces the recorded task text (for an MCAP file, it is needed when the bag has no
    `task_topic`). Raises RobotDataError naming the file and what to do when it cannot be read.
    """
    options = options or ReadOptions()
    p = Path(path)
    if is_lerobot(p):
        for ep in LeRobotDataset(p).read(options, episodes=episodes):
            if task is not None:
                from dataclasses import replace

                ep = replace(ep, task=task)
            yield ep
    elif is_mcap(p):
        if episodes is not None and list(episodes) != [0]:
            raise RobotDataError(f"{p}: an MCAP file holds one episode (0)")
        bag = McapBag(
            p, task=task, task_topic=task_topic, outcome_topic=outcome_topic, cameras=cameras
        )
        yield bag.episode(options)
    elif not p.exists():
        raise RobotDataError(f"{p}: no such file or directory")
    else:
        raise RobotDataError(
            f"{p}: neither a LeRobot v3 dataset directory (with meta/info.json) nor an .mcap file"
        )

"""`agent-monitor replay` of robot data into a real Monitor over a real Mosquitto, judged by a
scripted vision judge."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import pytest
from PIL import Image

from agent_monitor import FrameBudget
from agent_monitor.cli import main
from agent_monitor.daemon import Monitor, MonitorConfig
from agent_monitor.prompts import ImagePart, Prompt
from agent_monitor.robotdata import TrackerSink, read_episodes, replay_episodes
from agent_monitor.testing import FakeJudge
from agent_monitor.wire import BrokerSettings
from tests.brokers import Mosquitto
from tests.fixtures.robot_data import CAMERAS, LeRobotSpec, level, make_lerobot, make_mcap

pytestmark = pytest.mark.timeout(120)

# Every frame an anchor: the judge's last prompt of an episode then holds all of its frames, in
# order.
ALL_FRAMES = FrameBudget(every=1, recent=0, per_stride=64)


def _frames(p: Prompt) -> list[tuple[tuple[int, int], int]]:
    out = []
    for part in p.parts:
        if isinstance(part, ImagePart):
            img = Image.open(io.BytesIO(part.frame.data)).convert("L")
            out.append(
                (
                    (part.frame.width, part.frame.height),
                    int(img.getpixel((img.size[0] // 2, img.size[1] // 2))),
                )
            )  # type: ignore[arg-type]
    return out


def _last_prompts(judge: FakeJudge, task: str) -> list[Prompt]:
    return [p for p in judge.prompts if task in p.prefix_text()]


async def _wait(check: object, what: str, wait_s: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + wait_s
    while not check():  # type: ignore[operator]
        if loop.time() > end:
            raise AssertionError(f"waited {wait_s} s for {what}")
        await asyncio.sleep(0.05)


def _check_episode(judge: FakeJudge, task: str, steps: int, sizes: list[tuple[int, int]]) -> None:
    prompts = _last_prompts(judge, task)
    assert prompts and prompts[-1].step == steps
    # scored in order, coalescing allowed
    assert [p.step for p in prompts] == sorted(p.step for p in prompts)
    seen = _frames(prompts[-1])
    # every camera's frame of every step, at its resolution
    assert [z for z, _ in seen] == sizes * steps
    levels = [g for _, g in seen]
    expected = [level(i) for i in range(steps) for _ in sizes]
    assert all(abs(g - e) <= 4 for g, e in zip(levels, expected, strict=True)), levels
    for i in range(1, steps + 1):
        assert f"t={(i - 1) / 10:.2f}s" in prompts[-1].prefix_text()


async def test_replay_publishes_lerobot_and_mcap_episodes_live_with_their_frames(
    broker: Mosquitto, tmp_path: Path
) -> None:
    dataset = make_lerobot(tmp_path / "toy")
    bag = make_mcap(tmp_path / "stack.mcap")
    judge = FakeJudge(latency_s=0.01)
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url), client_id="mon-robot", frame_budget=ALL_FRAMES
    )
    spec = LeRobotSpec()
    async with Monitor(config, judge=judge):
        rc = await asyncio.to_thread(
            main, ["replay", str(dataset), "--broker", broker.url, "--speed", "4"]
        )
        assert rc == 0
        for task, n in zip(spec.tasks, spec.lengths, strict=True):
            await _wait(
                lambda task=task, n=n: any(p.step == n for p in _last_prompts(judge, task)),
                f"{task} scored",
            )
            _check_episode(judge, task, n, list(CAMERAS.values()))
        rc = await asyncio.to_thread(
            main, ["replay", str(bag), "--broker", broker.url, "--speed", "4", "--every", "1"]
        )
        assert rc == 0
        task = "Stack the blue block on the green one"
        await _wait(lambda: any(p.step == 12 for p in _last_prompts(judge, task)), "the bag scored")
        _check_episode(judge, task, 12, [(64, 48), (32, 32)])
        assert "/cmd: move dx=1.2" in _last_prompts(judge, task)[-1].prefix_text()


async def test_replay_of_a_bad_file_is_exit_2_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "x.mcap").write_bytes(b"not an mcap file at all")
    rc = await asyncio.to_thread(
        main, ["replay", str(tmp_path / "x.mcap"), "--broker", "mqtt://127.0.0.1:1"]
    )
    assert rc == 2
    assert "x.mcap: not an MCAP file" in capsys.readouterr().err


def test_replay_in_process_into_a_tracker(tmp_path: Path) -> None:
    from agent_monitor import ProgressTracker

    dataset = make_lerobot(tmp_path / "toy")
    judge = FakeJudge()
    trackers: dict[str, ProgressTracker] = {}

    def start(rid: str, ep: object) -> TrackerSink:
        trackers[rid] = ProgressTracker(ep.task, judge=judge, frame_budget=ALL_FRAMES)  # type: ignore[attr-defined]
        return TrackerSink(trackers[rid])

    stats = replay_episodes(read_episodes(dataset), start, speed=0)
    try:
        assert stats.episodes == 2 and stats.steps == 14 and stats.frames == 28
        assert [len(t.steps) for t in trackers.values()] == [6, 8]
        assert all(len(s.frames) == 2 for t in trackers.values() for s in t.steps)
        last = [t.latest for t in trackers.values()]
        assert [p.step for p in last if p is not None] == [6, 8]
    finally:
        for t in trackers.values():
            t.close()


def test_eval_scores_episodes_offline_with_a_vision_judge_and_reports_voc_and_auroc(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import base64
    import json
    from typing import Any

    from agent_monitor.scale import LETTERS
    from tests.openai_server import Reply, chat_choice, chat_reply, scripted_server

    dataset = make_lerobot(tmp_path / "toy")
    seen: list[tuple[int, int]] = []

    def vision(body: dict[str, Any]) -> Reply:
        # The judge looks at the newest frame: brighter is further along; the drawer episode never
        # gets anywhere.
        urls = [
            p["image_url"]["url"]
            for m in body["messages"]
            if isinstance(m["content"], list)
            for p in m["content"]
            if p.get("type") == "image_url"
        ]
        img = Image.open(io.BytesIO(base64.b64decode(urls[-1].split(",", 1)[1]))).convert("L")
        gray = int(img.getpixel((img.size[0] // 2, img.size[1] // 2)))  # type: ignore[arg-type]
        seen.append((len(urls), gray))
        letter = (
            "B" if "Open the drawer" in json.dumps(body) else LETTERS[min(19, round(gray / 20))]
        )
        return chat_reply(chat_choice([(letter, {letter: 1.0})]))

    with scripted_server() as server:
        server.default = vision
        rc = main(
            [
                "eval",
                str(dataset),
                "--judge",
                "openai",
                "--judge-url",
                server.url,
                "--out",
                str(tmp_path / "out"),
            ]
        )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert len(server.requests) == 6 + 8  # every prefix of both episodes, each with its frames
    assert [g for _, g in seen[:6]] == pytest.approx([level(i) for i in range(6)], abs=4)
    assert "VOC 1.00" in out and "success AUROC at the run's end 1.00" in out
    robot = json.loads((tmp_path / "out" / "eval.json").read_text())["robot"]
    assert robot["voc"]["n"] == 1 and robot["end_auroc"]["n"] == 2
    # A bag the same way: one successful episode whose frames brighten, so VOC is 1 again.
    bag = make_mcap(tmp_path / "stack.mcap")
    with scripted_server() as server:
        server.default = vision
        rc = main(
            [
                "eval",
                str(bag),
                "--judge",
                "openai",
                "--judge-url",
                server.url,
                "--out",
                str(tmp_path / "bag"),
            ]
        )
    out = capsys.readouterr().out
    assert rc == 0 and len(server.requests) == 12, out
    assert "VOC 1.00" in out
    spec = LeRobotSpec()
    assert spec.success == (True, False)


def test_eval_of_a_bad_dataset_is_exit_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = make_lerobot(tmp_path / "toy")
    (dataset / "meta" / "info.json").write_text("{not json")
    rc = main(["eval", str(dataset), "--judge", "openai", "--judge-url", "http://127.0.0.1:9/v1"])
    assert rc == 2 and "info.json: not valid JSON" in capsys.readouterr().err

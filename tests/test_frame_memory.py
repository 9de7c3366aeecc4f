"""A long run holds the pixels of the frames the budget still shows, not of every frame (issue
32's bounded memory)."""

from __future__ import annotations

import io
import itertools

from PIL import Image

from agent_monitor import AsyncProgressTracker, FrameBudget, ProgressTracker
from agent_monitor.prompts import ImagePart
from agent_monitor.testing import FakeJudge


def _png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 12), (i % 256, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()


def test_frames_no_prompt_will_show_lose_their_pixels_and_prompts_stay_whole() -> None:
    budget = FrameBudget(every=4, recent=2, per_stride=4)
    judge = FakeJudge()
    t = ProgressTracker("Drive the dot home", judge=judge, frame_budget=budget)
    try:
        for i in range(60):
            t.update(f"tick {i}", images=[_png(i)])
        held = [o for o, s in enumerate(t.steps) if s.frames[0].data]
        anchors, recent = budget.select(60)
        assert held == sorted(anchors + recent)  # the anchors and the newest frames, nothing else
        # sizes and digests kept
        assert all(len(s.frames) == 1 and s.frames[0].width == 16 for s in t.steps)
        for p in judge.prompts:
            a, r = budget.select(p.step)
            images = [part.frame for part in p.parts if isinstance(part, ImagePart)]
            # every frame shown has pixels
            assert len(images) == len(a) + len(r) and all(f.data for f in images)
            assert "no longer held" not in p.text()
        # Prefix-stable as before: each prompt's head is a prefix of the next one's.
        heads = [p.prefix_text() for p in judge.prompts]
        assert all(b.startswith(a) for a, b in itertools.pairwise(heads))
    finally:
        t.close()


async def test_an_older_prefix_scored_late_says_its_dropped_frames_are_gone() -> None:
    budget = FrameBudget(every=8, recent=3, per_stride=2)
    judge = FakeJudge()
    t = AsyncProgressTracker("t", judge=judge, frame_budget=budget)
    for i in range(12):
        await t.add(f"tick {i}", images=[_png(i)])
    assert (await t.score(12)).ok  # anchors 0 and 8, newest 9-11: frames 1-7 no longer held
    assert [o for o, s in enumerate(t.steps) if s.frames[0].data] == [0, 8, 9, 10, 11]
    # a slow, older prefix: its newest frames (3-5) are gone, and the prompt says so
    p = await t.score(6)
    assert p.ok
    text = judge.prompts[-1].text()
    assert text.count("[frame no longer held]") == 3 and "Step 4: [frame no longer held]" in text

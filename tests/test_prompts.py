"""Prompts are prefix-stable: the prompt for n steps, less its tail, is a prefix of the prompt for n + 1."""

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from agent_monitor.criteria import load_criteria
from agent_monitor.images import Frame, FrameBudget
from agent_monitor.prompts import ANSWER_CUE, ImagePart, Part, Prompt, Step, TextPart, build_prompt


def frame(tag: str) -> Frame:
    data = tag.encode()
    return Frame(data=data, mime="image/png", width=4, height=3, digest=hashlib.sha256(data).hexdigest())


def flat(parts: tuple[Part, ...]) -> list[str]:
    """What a prefix cache sees: characters of text, and each image as one opaque item."""
    out: list[str] = []
    for p in parts:
        out.extend(p.text if isinstance(p, TextPart) else ["<img:" + p.frame.digest + ">"])
    return out


def whole(p: Prompt) -> list[str]:
    return [p.instructions, *flat(p.parts)]


def head(p: Prompt) -> list[str]:
    return [p.instructions, *flat(p.prefix)]


step_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=60)
trajectories = st.lists(st.tuples(step_text, st.integers(0, 3)), min_size=1, max_size=25)
budgets = st.builds(FrameBudget, every=st.integers(1, 6), recent=st.integers(0, 4), max_frames=st.integers(1, 200))


@settings(max_examples=150, deadline=None)
@given(
    task=step_text.filter(str.strip),
    traj=trajectories,
    budget=budgets,
    rubric_name=st.sampled_from(["progress", "coding", "robot"]),
    crit_pick=st.integers(0, 10),
)
def test_prefix_property_over_random_trajectories(
    task: str, traj: list[tuple[str, int]], budget: FrameBudget, rubric_name: str, crit_pick: int
) -> None:
    rubric = load_criteria(rubric_name)
    steps = []
    k = 0
    for i, (text, nframes) in enumerate(traj, 1):
        frames = tuple(frame(f"f{(k := k + 1)}") for _ in range(nframes))
        steps.append(Step(index=i, text=text, frames=frames))
    total_frames = sum(len(s.frames) for s in steps)
    for n in range(1, len(steps)):
        # Different criteria for n and n + 1: the criterion lives in the tail only.
        c_n = rubric.criteria[crit_pick % len(rubric.criteria)]
        c_next = rubric.criteria[(crit_pick + n) % len(rubric.criteria)]
        p_n = build_prompt(task, rubric, steps[:n], c_n, budget=budget)
        p_next = build_prompt(task, rubric, steps[: n + 1], c_next, budget=budget)
        h = head(p_n)
        assert whole(p_next)[: len(h)] == h
        assert p_next.text().startswith(p_n.prefix_text())
        # The tail carries the step count and the criterion.
        tail_text = "".join(p.text for p in p_n.tail if isinstance(p, TextPart))
        assert f"has {n} step" in tail_text and f"'{c_n.name}'" in tail_text
        assert p_n.text().endswith(ANSWER_CUE)
    # Images sent stay within budget.
    last = build_prompt(task, rubric, steps, rubric.criteria[0], budget=budget)
    images = [p for p in last.parts if isinstance(p, ImagePart)]
    assert len(images) <= budget.max_frames + budget.recent
    assert len({p.frame.digest for p in images}) == len(images) <= total_frames


def test_layout_order_and_images_follow_their_step() -> None:
    rubric = load_criteria({"done": "is it done", "safe": "is it safe"})
    steps = [
        Step(1, "moved arm", (frame("a"),)),
        Step(2, "grasped cup", ()),
        Step(3, "lifted cup", (frame("b"), frame("c"))),
    ]
    p = build_prompt(
        "Put the cup on the shelf.", rubric, steps, rubric.criteria[1], budget=FrameBudget(every=2, recent=2)
    )
    text = p.text(image=lambda f: f"<{f.data.decode()}>")
    order = ["## Task", "Put the cup", "## Rubric", "### Step 1", "moved arm", "<a>",
             "### Step 2", "### Step 3", "lifted cup", "<c>", "## Most recent camera frames", "Step 3:", "<b>",
             "## Question", "3 steps so far", "'safe'", ANSWER_CUE]  # fmt: skip
    at = text.index("## Task")
    for s in order:  # each piece appears after the one before it
        at = text.index(s, at)
    # Only the criterion asked about is in the prompt (in the tail): the other's text is not.
    assert "is it done" not in text and "is it safe" in p.tail[-1].text  # type: ignore[union-attr]
    # Anchors are frames 0 and 2 (a, c): inline after their step; b is recent and goes in the tail.
    assert [p.frame.data for p in p.prefix if isinstance(p, ImagePart)] == [b"a", b"c"]
    assert [p.frame.data for p in p.tail if isinstance(p, ImagePart)] == [b"b"]
    assert p.step == 3 and p.criterion == "safe" and p.frames == 3


def test_frame_budget_keeps_anchors_and_recent() -> None:
    b = FrameBudget(every=10, recent=3, max_frames=64)
    anchors, recent = b.select(500)
    assert anchors == list(range(0, 500, 10))
    assert recent == [497, 498, 499]
    # Past the cap no anchor is added or dropped (either would break the prefix); recent frames go on.
    capped, recent2 = FrameBudget(every=5, recent=3, max_frames=64).select(500)
    assert capped == list(range(0, 320, 5))
    assert recent2 == [497, 498, 499]
    assert FrameBudget(every=5, recent=3).select(3) == ([0], [1, 2])

"""Prompts are prefix-stable: the prompt for n steps, less its tail, is a prefix of the prompt
for n + 1."""

import hashlib
import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from agent_monitor.criteria import load_criteria
from agent_monitor.images import Frame, FrameBudget
from agent_monitor.prompts import ANSWER_CUE, ImagePart, Part, Prompt, Step, TextPart, build_prompt


def frame(tag: str) -> Frame:
    data = tag.encode()
    return Frame(
        data=data, mime="image/png", width=4, height=3, digest=hashlib.sha256(data).hexdigest()
    )


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
budgets = st.builds(
    FrameBudget,
    every=st.integers(1, 6),
    recent=st.integers(0, 4),
    per_stride=st.integers(1, 20).map(lambda k: 2 * k),
)


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
    assert len(images) <= anchor_bound(budget, total_frames) + budget.recent
    assert len({p.frame.digest for p in images}) == len(images) <= total_frames


def test_layout_order_and_images_follow_their_step() -> None:
    rubric = load_criteria({"done": "is it done", "safe": "is it safe"})
    steps = [
        Step(1, "moved arm", (frame("a"),)),
        Step(2, "grasped cup", ()),
        Step(3, "lifted cup", (frame("b"), frame("c"))),
    ]
    p = build_prompt(
        "Put the cup on the shelf.",
        rubric,
        steps,
        rubric.criteria[1],
        budget=FrameBudget(every=2, recent=2),
    )
    text = p.text(image=lambda f: f"<{f.data.decode()}>")
    order = [
        "## Task",
        "Put the cup",
        "## Rubric",
        "### Step 1",
        "moved arm",
        "<a>",
        "### Step 2",
        "### Step 3",
        "lifted cup",
        "<c>",
        "## Most recent camera frames",
        "Step 3:",
        "<b>",
        "## Question",
        "3 steps so far",
        "'safe'",
        ANSWER_CUE,
    ]
    at = text.index("## Task")
    for s in order:  # each piece appears after the one before it
        at = text.index(s, at)
    # Every criterion's text is in the shared head, read once per run; the tail names the one asked
    # about only.
    head = p.prefix_text()
    assert "- done (weight 0.50): is it done" in head and "- safe (weight 0.50): is it safe" in head
    question = p.tail[-1].text  # type: ignore[union-attr]
    assert "'safe'" in question and "is it safe" not in question and "is it done" not in question
    # Anchors are frames 0 and 2 (a, c): inline after their step; b is recent and goes in the tail.
    assert [p.frame.data for p in p.prefix if isinstance(p, ImagePart)] == [b"a", b"c"]
    assert [p.frame.data for p in p.tail if isinstance(p, ImagePart)] == [b"b"]
    assert p.step == 3 and p.criterion == "safe" and p.frames == 3


def anchor_bound(b: FrameBudget, n: int) -> int:
    """The stated cost: per_stride anchors, then per_stride / 2 more each time the run doubles."""
    first = b.per_stride * b.every
    return b.per_stride + (b.per_stride // 2) * (
        math.ceil(math.log2(n / first)) if n > first else 0
    )


def test_frame_budget_keeps_anchors_and_recent() -> None:
    b = FrameBudget(every=10, recent=3, per_stride=64)
    anchors, recent = b.select(500)
    assert anchors == list(range(0, 500, 10))
    assert recent == [497, 498, 499]
    # Past per_stride * every frames the stride doubles each time the run doubles: anchors go on to
    # the end.
    long, recent2 = FrameBudget(every=5, recent=3, per_stride=32).select(500)
    assert long == [*range(0, 160, 5), *range(160, 320, 10), *range(320, 500, 20)]
    assert recent2 == [497, 498, 499]
    assert FrameBudget(every=5, recent=3).select(3) == ([0], [1, 2])
    assert FrameBudget(every=5, recent=3, per_stride=2).select(40)[1] == [37, 38, 39]


@settings(max_examples=200, deadline=None)
@given(
    every=st.integers(1, 9),
    per_stride=st.integers(1, 40).map(lambda k: 2 * k),
    n=st.integers(1, 20_000),
)
def test_anchors_are_appended_only_span_the_run_and_cost_what_is_stated(
    every: int, per_stride: int, n: int
) -> None:
    b = FrameBudget(every=every, recent=2, per_stride=per_stride)
    a_n, a_next = b.anchors(n), b.anchors(n + 1)
    # appended only: the prefix holds
    assert a_next[: len(a_n)] == a_n and len(a_next) - len(a_n) <= 1
    assert a_n[0] == 0 and all(b.is_anchor(o) for o in a_n)
    assert [o for o in range(max(0, n - 50), n) if b.is_anchor(o)] == [
        o for o in a_n if o >= n - 50
    ]
    # The widest gap (the last anchor to the run's end included) is at most 2 / per_stride of the
    # run.
    gaps = [y - x for x, y in itertools.pairwise([*a_n, n])]
    assert max(gaps) <= max(every, 2 * n / per_stride)
    assert len(a_n) <= anchor_bound(b, n)


def test_last_update_of_a_6000_step_episode_spans_every_minute() -> None:
    """10 Hz, one frame a step: the frames in the prompt at step 6,000 fall in each of its 10
    minutes."""
    rubric = load_criteria("robot")
    steps = [Step(i, f"tick {i}", (frame(f"f{i}"),)) for i in range(1, 6001)]
    # the default FrameBudget
    p = build_prompt("Stack the blocks.", rubric, steps, rubric.criteria[0])
    shown = [int(part.frame.data.decode()[1:]) for part in p.parts if isinstance(part, ImagePart)]
    assert shown == sorted(shown) and len(shown) == len(set(shown)) == p.frames
    minutes = {(i - 1) // 600 for i in shown}
    assert minutes == set(range(10))  # the first and the last minute and every minute between
    assert shown[0] == 1 and shown[-1] == 6000  # the first frame and the newest
    assert p.frames <= anchor_bound(FrameBudget(), 6000) + FrameBudget().recent
    # The replaced rule (anchors stop after 64) have shown nothing between 51.2 s and the last 4
    # frames.
    assert len([i for i in shown if 1200 < i <= 1800]) >= 4

"""The group policy (agent_monitor.groups): ranking, prunes, keep_top, fail-open."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_monitor.groups import GroupFull, GroupState, combined_uncertainty, replay
from agent_monitor.policy import Policy, PolicyError
from agent_monitor.progress import Progress


def _group(n: int = 4, **policy: object) -> GroupState:
    g = GroupState(
        "g", Policy(**{"min_steps": 1, "patience": 2, "keep_top": 2, "prune_margin": 0.2, **policy})
    )  # type: ignore[arg-type]
    for i in range(n):
        g.join(f"r{i}")
    return g


def test_two_laggards_of_four_are_pruned_and_the_leaders_continue() -> None:
    g = _group()
    pruned = []
    for step in (1, 2, 3):
        for run, score in (("r0", 0.8), ("r1", 0.7), ("r2", 0.2), ("r3", 0.3)):
            u = g.observe(run, step=step, score=score, uncertainty=0.05)
            pruned += [(p.run_id, p.step, p.leader) for p in u.prunes]
    assert pruned == [("r2", 2, "r0"), ("r3", 2, "r0")]
    ranking = g.ranking()
    assert ranking["leader"] == "r0"
    assert [(r["run_id"], r["rank"], r["state"]) for r in ranking["runs"]] == [
        ("r0", 1, "live"),
        ("r1", 2, "live"),
        ("r3", 3, "pruned"),
        ("r2", 4, "pruned"),
    ]
    assert g.live == ["r0", "r1"]


def test_the_gap_must_exceed_the_combined_uncertainty() -> None:
    g = _group(2, keep_top=1, max_uncertainty=1.0)
    for step in (1, 2, 3, 4):
        g.observe("r0", step=step, score=0.8, uncertainty=0.3)
        # gap 0.4 < hypot(0.3, 0.3) = 0.42
        u = g.observe("r1", step=step, score=0.4, uncertainty=0.3)
        assert u.prunes == ()
    assert combined_uncertainty(0.3, 0.4) == pytest.approx(0.5)


def test_a_streak_needs_patience_steps_in_a_row_and_a_step_on_track_resets_it() -> None:
    g = _group(2, keep_top=1, patience=3)
    g.observe("r0", step=1, score=0.9)
    for step, score in ((1, 0.1), (2, 0.1), (3, 0.8), (4, 0.1), (5, 0.1)):
        assert g.observe("r1", step=step, score=score).prunes == ()
    assert g.observe("r1", step=6, score=0.1).prunes[0].run_id == "r1"


def test_nothing_is_pruned_before_min_steps_or_without_a_margin() -> None:
    g = _group(2, keep_top=1, min_steps=5)
    g.observe("r0", step=1, score=0.9)
    assert all(not g.observe("r1", step=s, score=0.0).prunes for s in range(1, 5))
    off = _group(2, keep_top=1, prune_margin=None)
    off.observe("r0", step=1, score=0.9)
    assert all(not off.observe("r1", step=s, score=0.0).prunes for s in range(1, 10))


def test_a_judge_outage_prunes_nothing_and_breaks_no_streak() -> None:
    g = _group(2, keep_top=1, patience=2)
    g.observe("r0", step=1, score=0.9)
    g.observe("r1", step=1, score=0.1)
    for step in range(2, 20):
        assert g.observe("r1", step=step, score=None, ok=False).prunes == ()
        g.observe("r0", step=step, score=None, ok=False)
    assert g.live == ["r0", "r1"]
    # The streak of one resumes where it was: the outage neither counted nor broke it.
    assert g.observe("r1", step=20, score=0.1).prunes[0].run_id == "r1"


def test_changed_says_when_the_order_a_state_or_a_score_moved() -> None:
    g = GroupState("g", Policy())
    assert g.join("a").changed
    assert g.join("b").changed
    assert not g.join("b").changed
    # The retained ranking must not keep stale scores (issue 27): a score change alone republishes.
    assert g.observe("a", step=1, score=0.5).changed  # a scored, b not: a stays first
    assert g.observe("a", step=2, score=0.6).changed  # score moves, order does not
    assert not g.observe("a", step=3, score=0.6001).changed  # below the published precision
    assert g.observe("b", step=1, score=0.9).changed  # b overtakes
    assert g.end("b", "success").changed
    assert g.ranking()["runs"][0] == {
        "run_id": "b",
        "rank": 1,
        "score": 0.9,
        "uncertainty": None,
        "step": 1,
        "state": "ended",
        "outcome": "success",
    }
    assert not g.done
    g.end("a")
    assert g.done


def test_older_results_and_final_states_do_not_move_the_group() -> None:
    g = _group(2, keep_top=1, patience=1)
    g.observe("r0", step=3, score=0.9)
    g.observe("r0", step=2, score=0.1)  # a slow older scoring
    assert g.members["r0"].score == 0.9
    assert g.observe("r1", step=1, score=0.1).prunes
    g.observe("r1", step=2, score=1.0)
    assert g.members["r1"].state == "pruned" and g.members["r1"].score == 0.1


def test_a_group_is_bounded() -> None:
    g = GroupState("g", Policy(), max_runs=2)
    g.join("a")
    g.join("b")
    g.join("a")
    with pytest.raises(GroupFull, match="already has 2 runs"):
        g.join("c")
    with pytest.raises(KeyError, match="join it first"):
        g.observe("zz", step=1, score=0.5)


def test_a_pairwise_order_reorders_only_leaders_pointwise_cannot_separate() -> None:
    g = GroupState("g", Policy())
    for r, s in (("a", 0.70), ("b", 0.68), ("c", 0.2)):
        g.join(r)
        g.observe(r, step=1, score=s, uncertainty=0.05)
    assert g.tied_leaders() == ["a", "b"]
    assert g.set_order(["c", "b", "a"]).changed
    # c is far behind: its pairwise place does not count
    assert [m.run_id for m in g.ranked()] == ["b", "a", "c"]
    assert g.tied_leaders() == ["b", "a"]
    g.set_order(())
    assert g.leader == "a"


def test_group_policy_settings_are_validated() -> None:
    with pytest.raises(PolicyError, match="keep_top"):
        Policy(keep_top=0)
    with pytest.raises(PolicyError, match="prune_margin"):
        Policy(prune_margin=1.5)
    with pytest.raises(PolicyError, match="compare"):
        Policy(compare="yes")  # type: ignore[arg-type]
    assert (
        Policy().with_overrides({"keep_top": 2.0, "prune_margin": 0.1, "compare": True}).keep_top
        == 2
    )


def test_replay_rebuilds_the_same_group() -> None:
    pol = Policy(min_steps=1, patience=1, keep_top=1, prune_margin=0.1)
    events = [
        ("join", "a", None),
        ("join", "b", None),
        ("score", "a", Progress(step=1, score=0.9, uncertainty=None, criteria={}, ok=True)),
        ("score", "b", Progress(step=1, score=0.1, uncertainty=None, criteria={}, ok=True)),
        ("end", "a", "success"),
    ]
    g = replay("g", pol, events)
    assert [(r["run_id"], r["state"]) for r in g.ranking()["runs"]] == [
        ("a", "ended"),
        ("b", "pruned"),
    ]


_events = st.lists(
    st.tuples(
        st.integers(0, 5),  # run
        st.one_of(st.none(), st.floats(0.0, 1.0)),  # score (None: the judge failed)
        st.floats(0.0, 0.5),  # uncertainty
        st.booleans(),  # the run ends here
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(
    events=_events,
    keep_top=st.integers(1, 4),
    margin=st.floats(0.0, 0.5),
    patience=st.integers(1, 3),
    min_steps=st.integers(0, 3),
)
def test_keep_top_is_never_violated(
    events: list[tuple[int, float | None, float, bool]],
    keep_top: int,
    margin: float,
    patience: int,
    min_steps: int,
) -> None:
    g = GroupState(
        "g",
        Policy(
            keep_top=keep_top,
            prune_margin=margin,
            patience=patience,
            min_steps=min_steps,
            max_uncertainty=1.0,
        ),
    )
    steps = [0] * 6
    for run in range(6):
        g.join(f"r{run}")
    for run, score, unc, ends in events:
        rid = f"r{run}"
        steps[run] += 1
        live_before = len(g.live)
        u = g.observe(rid, step=steps[run], score=score, uncertainty=unc, ok=score is not None)
        if u.prunes:
            assert len(u.prunes) == 1 and u.prunes[0].run_id == rid
            assert len(g.live) == live_before - 1 >= keep_top
            assert score is not None and steps[run] >= min_steps
        if ends:
            g.end(rid)
        ranks = [r["rank"] for r in g.ranking()["runs"]]
        assert ranks == list(range(1, 7))


@settings(max_examples=200, deadline=None)
@given(events=_events)
def test_an_outage_prunes_nothing(events: list[tuple[int, float | None, float, bool]]) -> None:
    g = GroupState(
        "g", Policy(keep_top=1, prune_margin=0.0, patience=1, min_steps=0, max_uncertainty=1.0)
    )
    steps = [0] * 6
    for run in range(6):
        g.join(f"r{run}")
    for run, _score, _unc, _ends in events:
        steps[run] += 1
        assert g.observe(f"r{run}", step=steps[run], score=None, ok=False).prunes == ()
    assert len(g.live) == 6

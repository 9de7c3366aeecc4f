"""Criteria files, dicts and lists; weights and the rubric hash."""

from pathlib import Path

import pytest

from agent_monitor.criteria import (
    CriteriaError,
    Criterion,
    bundled_criteria,
    load_criteria,
    parse_criteria,
)


def test_bundled_rubrics_load_with_weights_summing_to_one() -> None:
    assert {"progress", "coding", "robot", "coding_tests"} <= set(bundled_criteria())
    for name in bundled_criteria():
        r = load_criteria(name)
        assert sum(c.weight for c in r.criteria) == pytest.approx(1.0)
        assert all(c.description for c in r.criteria)
    assert load_criteria(None).criteria[0].name == "task_progress"
    coding = load_criteria("coding")
    assert [c.name for c in coding.criteria] == [
        "goal_progress",
        "verification",
        "trajectory_health",
    ]
    assert coding.criteria[0].weight == pytest.approx(0.6)
    tests_first = load_criteria("coding_tests")
    assert tests_first.criteria[0].rules and tests_first.criteria[0].uses_judge
    assert [" ".join(c.description.split()) for c in tests_first.criteria] == [
        " ".join(c.description.split()) for c in coding.criteria
    ]


def test_markdown_format_and_normalisation(tmp_path: Path) -> None:
    f = tmp_path / "mine.md"
    f.write_text(
        "# Mine\n\n## speed\nweight: 3\n\nIs it fast.\n\n## safety\nweight: 1\nIs "
        "it safe.\nReally.\n"
    )
    r = load_criteria(f)
    assert r.title == "Mine"
    assert [(c.name, c.weight) for c in r.criteria] == [("speed", 0.75), ("safety", 0.25)]
    assert r.criteria[1].description == "Is it safe.\nReally."
    assert load_criteria(str(f)) == r


def test_dict_and_list_forms() -> None:
    r = load_criteria({"a": "did a", "b": "did b"})
    assert [(c.name, c.weight) for c in r.criteria] == [("a", 0.5), ("b", 0.5)]
    r2 = load_criteria(
        ["first thing", {"name": "x", "description": "y", "weight": 3}, Criterion("z", "zz", 0)]
    )
    assert [(c.name, c.weight) for c in r2.criteria] == [("c1", 0.25), ("x", 0.75), ("z", 0.0)]


def test_hash_changes_with_content_and_not_with_identity() -> None:
    a = load_criteria({"a": "did a"})
    assert a.hash == load_criteria({"a": "did a"}).hash
    assert a.hash != load_criteria({"a": "did a!"}).hash
    assert load_criteria("coding").hash != load_criteria("progress").hash


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nope", "no bundled criteria named 'nope'"),
        ({}, "weights are zero"),
        ([{"name": "x"}], "lacks 'description'"),
        ([{"name": "x", "description": "d", "weight": -1}], "weights must be finite"),
        (["a", Criterion("c1", "dup")], "names repeat"),
        ("/does/not/exist.md", "cannot read criteria file"),
    ],
)
def test_bad_criteria_get_clear_errors(spec: object, message: str) -> None:
    with pytest.raises(CriteriaError, match=message):
        load_criteria(spec)  # type: ignore[arg-type]


def test_parse_errors_name_the_problem() -> None:
    with pytest.raises(CriteriaError, match="no criteria found"):
        parse_criteria("just text")
    with pytest.raises(CriteriaError, match="has weight 'heavy'"):
        parse_criteria("## a\nweight: heavy\ndesc")
    with pytest.raises(CriteriaError, match="has no description"):
        parse_criteria("## a\nweight: 1\n")

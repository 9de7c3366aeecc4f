"""Robot metrics: VOC (Spearman of progress against frame order, successful episodes) and
end-of-episode AUROC."""

import pytest

from agent_monitor.offline.evaluate import RunCurve
from agent_monitor.offline.robotmetrics import end_auroc, robot_metrics, voc


def ep(name: str, outcome: float | None, scores: list[float | None]) -> RunCurve:
    return RunCurve(name=name, outcome=outcome, scores=scores)


def test_voc_is_spearman_against_order_over_successful_episodes_only() -> None:
    # a failed call (None) is left out, not read as 0
    rising = ep("a", 1.0, [0.1, 0.2, None, 0.5, 0.9])
    reversed_ = ep("b", 1.0, [0.9, 0.5, 0.2, 0.1])
    failed = ep("c", 0.0, [0.9, 0.1, 0.05])  # not a successful episode: does not count
    assert voc([rising]) == pytest.approx(1.0)
    assert voc([rising, reversed_, failed]) == pytest.approx(0.0)
    assert voc([failed]) is None and voc([ep("d", 1.0, [0.5])]) is None


def test_end_auroc_ranks_last_scores_against_success() -> None:
    curves = [
        ep("s1", 1.0, [0.2, 0.9]),
        ep("s2", 1.0, [0.1, 0.7, None]),
        ep("f1", 0.0, [0.8, 0.3]),
        ep("f2", 0.0, [0.6]),
        ep("u", None, [0.0]),
    ]
    assert end_auroc(curves) == pytest.approx(1.0)
    curves.append(ep("f3", 0.0, [0.95]))  # a failure scored above both successes
    assert end_auroc(curves) == pytest.approx(4 / 6)
    assert end_auroc([c for c in curves if c.success]) is None


def test_bootstrap_intervals_hold_the_estimate_and_are_reproducible() -> None:
    curves = [
        ep(f"s{i}", 1.0, [0.1 * k + (0.3 if k == i % 4 else 0) for k in range(6)]) for i in range(8)
    ]
    curves += [ep(f"f{i}", 0.0, [0.5 - 0.05 * k + 0.02 * i for k in range(6)]) for i in range(6)]
    m = robot_metrics(curves, resamples=300, seed=1)
    assert m.voc.n == 8 and m.end_auroc.n == 14
    for iv in (m.voc, m.end_auroc):
        assert iv.value is not None and iv.low is not None and iv.high is not None
        assert iv.low <= iv.value <= iv.high
    assert m.voc.high - m.voc.low > 0  # the episodes differ: the interval is not a point
    assert robot_metrics(curves, resamples=300, seed=1) == m
    assert robot_metrics(curves[:1]).voc.low is None  # one episode: no interval
    with pytest.raises(ValueError, match="resamples"):
        robot_metrics(curves, resamples=0)

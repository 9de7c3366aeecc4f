"""`agent-monitor self-check`: the skill's token-free self-check (no judge, no network).

It checks the 20-letter scale, the expectation math on planted letter distributions, the bundled
rubrics, and the rubric and prompt template files given; it prints each check and exits 1 if any
fails.
"""

from __future__ import annotations

import argparse
import itertools
import math
from collections.abc import Callable
from pathlib import Path

from ..criteria import CriteriaError, Rubric, bundled_criteria, load_criteria
from ..scale import LETTERS, ScoreError, distribution, mirrored, phi, score_samples
from ..templates import TemplateError, load_template


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    command: Callable[..., argparse.ArgumentParser],
) -> None:
    """Register `self-check` (`command` is the CLI's subcommand factory)."""
    p = command(
        sub,
        "self-check",
        "check the scale, the expectation math and rubric / prompt files, with no judge",
    )
    p.add_argument(
        "--rubric",
        action="append",
        default=[],
        metavar="FILE",
        help="a rubric file to check (repeatable)",
    )
    p.add_argument(
        "--prompt",
        action="append",
        default=[],
        metavar="FILE",
        help="a prompt template to check (repeatable)",
    )


class _Checks:
    def __init__(self) -> None:
        self.failed = 0
        self.passed = 0

    def check(self, what: str, ok: bool, detail: str = "") -> None:
        mark = "ok  " if ok else "FAIL"
        print(f"{mark} {what}" + (f": {detail}" if detail else ""))
        if ok:
            self.passed += 1
        else:
            self.failed += 1


def _logprobs(dist: dict[str, float]) -> dict[str, float]:
    return {k: math.log(v) for k, v in dist.items() if v > 0}


def _planted(c: _Checks) -> None:
    """The expectation over planted distributions, against values worked out by hand."""
    c.check(
        "scale: 20 letters A..T",
        list(LETTERS) == [chr(ord("A") + i) for i in range(20)] and len(LETTERS) == 20,
    )
    steps = {round(phi(b) - phi(a), 12) for a, b in itertools.pairwise(LETTERS)}
    c.check(
        "scale: phi(A) = 0, phi(T) = 1, evenly spaced by 1/19",
        phi("A") == 0 and phi("T") == 1 and steps == {round(1 / 19, 12)},
    )
    planted = [
        ({"A": 1.0}, 0.0, 0.0),
        ({"T": 1.0}, 1.0, 0.0),
        ({"C": 1.0}, 2 / 19, 0.0),
        ({"J": 0.5, "K": 0.5}, 0.5, 0.5 / 19),
        ({"A": 0.5, "T": 0.5}, 0.5, 0.5),
        (
            {k: 1 / 20 for k in LETTERS},
            0.5,
            math.sqrt(sum((i / 19 - 0.5) ** 2 for i in range(20)) / 20),
        ),
    ]
    for dist, mean, sd in planted:
        d = distribution(_logprobs(dist), min_mass=0.5)
        ok = math.isclose(d.expectation, mean, abs_tol=1e-9) and math.isclose(
            d.dispersion, sd, abs_tol=1e-9
        )
        c.check(
            f"expectation of {dist if len(dist) < 5 else 'uniform A..T'}",
            ok,
            f"{d.expectation:.6f} ± {d.dispersion:.6f}, want {mean:.6f} ± {sd:.6f}",
        )
    # Non-letter tokens take mass away and are renormalised out; too little mass on the letters is
    # no score.
    d = distribution(_logprobs({"K": 0.6, "The": 0.4}), min_mass=0.5)
    c.check(
        "non-letter tokens are renormalised out",
        math.isclose(d.expectation, 10 / 19) and math.isclose(d.mass, 0.6),
    )
    try:
        distribution(_logprobs({"K": 0.2, "The": 0.8}), min_mass=0.5)
        c.check("mass below min_mass is refused", False, "a score was made from 0.2 of the mass")
    except ScoreError as e:
        c.check("mass below min_mass is refused", e.reason == "low_mass", e.reason)
    k3 = score_samples(
        "c", 1.0, [_logprobs({"C": 1.0}), _logprobs({"K": 1.0}), _logprobs({"T": 1.0})], repeats=3
    )
    c.check(
        "K repeats average: (C + K + T) / 3",
        math.isclose(k3.score, (2 + 10 + 19) / 57),
        f"{k3.score:.6f}",
    )
    flipped = distribution(mirrored(_logprobs({"A": 1.0})) or {}, min_mass=0.5)
    c.check("a reversed scale (A = best) reads A as 1", math.isclose(flipped.expectation, 1.0))


def _rubric(c: _Checks, path: str) -> None:
    try:
        r = load_criteria(Path(path))
    except CriteriaError as e:
        c.check(f"rubric {path}", False, str(e))
        return
    _describe(c, f"rubric {path}", r)


def _describe(c: _Checks, what: str, r: Rubric) -> None:
    total = sum(x.weight for x in r.criteria)
    c.check(
        f"{what}: loads, {len(r.criteria)} criteria ({', '.join(x.name for x in r.criteria)})", True
    )
    c.check(f"{what}: weights sum to 1", math.isclose(total, 1.0, abs_tol=1e-9), f"{total:.6f}")
    if r.scale:
        c.check(
            f"{what}: its own scale is told to the judge",
            True,
            "A = best, mirrored onto ours" if r.reversed_scale else "A = worst",
        )
    if r.verdicts is not None:
        p, rv = r.verdicts
        planted = {
            min(1.0, p + 0.01): "pass",
            (p + rv) / 2: "review" if rv < p else "pass",
            max(0.0, rv - 0.01): "fail",
        }
        got = {s: r.verdict(s) for s in planted}
        c.check(
            f"{what}: verdicts at pass {p:g} / review {rv:g}",
            got == planted,
            ", ".join(f"{s:.3f} -> {v}" for s, v in got.items()),
        )


def _prompt(c: _Checks, path: str) -> None:
    try:
        t = load_template(Path(path))
    except TemplateError as e:
        c.check(f"prompt {path}", False, str(e))
        return
    c.check(f"prompt {path}: a {t.kind} template", True, f"usable for {t.uses}")
    if t.kind == "pairwise":
        try:
            t.check_for("progress")
        except TemplateError as e:
            print(f"note progress: {e}")


def run(args: argparse.Namespace) -> int:
    """Run every check; 0 if all pass, 1 otherwise."""
    c = _Checks()
    _planted(c)
    for name in bundled_criteria():
        try:
            _describe(c, f"bundled rubric {name}", load_criteria(name))
        except CriteriaError as e:
            c.check(f"bundled rubric {name}", False, str(e))
    for path in args.rubric:
        _rubric(c, path)
    for path in args.prompt:
        _prompt(c, path)
    print(f"self-check: {c.passed} passed, {c.failed} failed")
    return 1 if c.failed else 0


__all__ = ["add_parser", "run"]

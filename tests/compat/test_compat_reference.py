"""The reference library's (llm-verifier's) README and docs examples, run unchanged against a local
judge server.

The code blocks below are copied from llm-verifier's README and its "Pairwise Comparison" docs page
(MIT License, Copyright (c) 2026 llm-as-a-verifier); the one change is `import llm_verifier` ->
`import agent_monitor as llm_verifier`. The judge is a scripted OpenAI-compatible server
(tests/openai_server.py) named by AGENT_MONITOR_JUDGE_URL: no `judge=` anywhere, as upstream.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import pytest

import agent_monitor
from agent_monitor._compat import MissingJudgeError, UnsupportedOption, judge_from_env, read_dotenv
from agent_monitor.progress import ScoringFailed
from agent_monitor.scale import LETTERS
from tests.openai_server import Reply, ScriptedServer, chat_choice, chat_reply, scripted_server

QUICKSTART = """
import agent_monitor as llm_verifier

problem = "Write a function that reverses a string."
candidates = [
    "def rev(s): return s[::-1]", "def rev(s): return s", "def rev(s): return ''.join(sorted(s))",
]

result = llm_verifier.select(
    problem=problem,
    candidates=candidates,
    criteria={"Correctness": "Does the code actually reverse the string?"},
)
print(result.index)   # index of the best candidate: 0
print(result.scores)  # candidate scores: [0.73104, 0.38446, 0.38449]
"""

COMPARE = """
reward_a, reward_b = llm_verifier.compare(
    problem, candidates[0], candidates[1],
    criteria={"Overall": "Does the code solve the problem?"},
)
print(reward_a, reward_b)   # fine-grained rewards in [0, 1]: 0.99994 0
"""

TRACK = """
steps = [
    'Read the problem statement',
    'Wrote def rev(s): return s ',
    'Tested: rev("abc") returned "abc"',
    'Changed to def rev(s): return s[::-1]',
    'Tested: rev("abc") returned "cba"',
]

result = llm_verifier.track(problem=problem, steps=steps,
                            checkpoint_steps=[1, 2, 3, 4, 5], n_evaluations=4)
print(result.scores)  # progress after each step: [0.00106, 0.02417, 0.03143, 0.62004, 0.99978]
"""

ONLINE = """
tracker = llm_verifier.ProgressTracker(problem, n_evaluations=4)

score = tracker.update('Read the problem statement')            # 0.00002
score = tracker.update('Wrote def rev(s): return s')            # 0.00013
score = tracker.update('Changed to def rev(s): return s[::-1]') # 0.73938
score = tracker.update('Tested: rev("abc") returned "cba"')     # 0.98604

if score < 0.05:      # after any step: abandon a hopeless rollout early
    ...
"""

MULTIMODAL = """
result = llm_verifier.select(problem, candidates, criteria=criteria,
                             images=["before.png", "after.png"])

tracker = llm_verifier.ProgressTracker(problem)
score = tracker.update(step, images="camera_frame.png")  # per-step frame
"""

DOCS_COMPARE = """
import agent_monitor as llm_verifier

problem = "Write a function that reverses a string."
candidates = [
    "def rev(s): return s[::-1]",              # correct reversal
    "def rev(s): return s",                    # identity — returns the string unchanged
    "def rev(s): return ''.join(sorted(s))",   # sorts the characters instead
]

reward_a, reward_b = llm_verifier.compare(
    problem, candidates[0], candidates[1],
    criteria={"Overall": "Does the code solve the problem?"},
    n_evaluations=1,                   # repeats K per criterion, averaged
    max_workers=50,                     # concurrency for the scoring calls
    model="gemini-2.5-flash",          # verifier model
)
print(reward_a, reward_b)   # fine-grained rewards in [0, 1]: 0.99994 0
"""

DOCS_BIAS = """
r_ab = llm_verifier.compare(problem, a, b, criteria=crits)
r_ba = llm_verifier.compare(problem, b, a, criteria=crits)
r_a = (r_ab[0] + r_ba[1]) / 2
r_b = (r_ab[1] + r_ba[0]) / 2
"""

QUALITY = {"s[::-1]": 3, "sorted(s)": 1}  # any other candidate: the identity, 0


def _text(body: dict[str, Any]) -> str:
    parts = []
    for m in body.get("messages", []):
        c = m.get("content")
        parts.extend(
            [c] if isinstance(c, str) else [p.get("text", "") for p in c if p.get("type") == "text"]
        )
    return "\n".join(parts)


def _quality(section: str) -> int:
    return next((q for code, q in QUALITY.items() if code in section), 0)


def judge_reply(body: dict[str, Any]) -> Reply:
    """A judge that reads the prompt: pairwise -> which trajectory holds the better code;
    progress -> the evidence."""
    text = _text(body)
    if "## Trajectory 1" in text:
        one = text.split("## Trajectory 1", 1)[1].split("## Trajectory 2", 1)[0]
        two = text.split("## Trajectory 2", 1)[1].split("## Question", 1)[0]
        i = min(19, max(0, round(9.5 + 3 * (_quality(two) - _quality(one)))))
    else:
        steps = text.split("## Trajectory so far", 1)[1].split("## Question", 1)[0]
        last = steps.rsplit("### Step", 1)[-1]
        i = (
            19
            if 'returned "cba"' in last
            else 14
            if "s[::-1]" in steps
            else 2
            if "abc" in steps
            else 0
        )
    letter = LETTERS[i]
    dist = {LETTERS[max(0, i - 1)]: 0.05, LETTERS[min(19, i + 1)]: 0.05}
    dist[letter] = 1.0 - sum(v for k, v in dist.items() if k != letter)
    return chat_reply(
        *(chat_choice([(letter, dist)], index=k) for k in range(int(body.get("n") or 1)))
    )


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    monkeypatch.chdir(tmp_path)  # no stray .env, and the image files the multimodal example names
    for var in (
        "OPENAI_BASE_URL",
        "OPENAI_API_KEY",
        "GEMINI_API_KEY",
        "GOOGLE_API_KEY",
        "VERTEX_API_KEY",
    ):
        monkeypatch.delenv(var, raising=False)
    with scripted_server() as s:
        s.default = judge_reply
        monkeypatch.setenv("AGENT_MONITOR_JUDGE_URL", s.url)
        yield s


def _png(path: Path, color: tuple[int, int, int]) -> None:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buf, format="PNG")
    path.write_bytes(buf.getvalue())


def _run(code: str, ns: dict[str, Any]) -> dict[str, Any]:
    # the examples are this file's own text
    exec(compile(code, "<llm-verifier example>", "exec"), ns)
    return ns


def _pairwise_prompts(s: ScriptedServer) -> list[str]:
    return [t for t in map(_text, s.requests) if "## Trajectory 1" in t]


def test_the_readme_quickstart_select_compare_and_track_run_unchanged(
    server: ScriptedServer,
) -> None:
    ns = _run(QUICKSTART, {})
    result = ns["result"]
    assert result.index == 0 and result.best == "def rev(s): return s[::-1]"
    # the pivot tournament, as upstream
    assert result.method == "pairwise" and result.n_comparisons > 0
    # As upstream's VerifierResult: scores a list in the candidates' order, the ranking their
    # positions.
    assert (
        isinstance(result.scores, list)
        and len(result.scores) == 3
        and result.scores[0] > result.scores[1]
    )
    assert result.ranking[0] == 0 and sorted(result.ranking) == [0, 1, 2]
    assert ns["candidates"][result.ranking[0]] == result.best
    prompts = _pairwise_prompts(server)
    # Each candidate is one whole step, never a step per character.
    assert prompts and all(
        "Trajectory 1 has 1 step so far and trajectory 2 has 1" in p for p in prompts
    )
    assert any("### Step 1\ndef rev(s): return s[::-1]\n" in p for p in prompts)
    assert not any("### Step 2" in p for p in prompts)
    # Upstream's select repeats 4 times by default (n_evaluations=4).
    assert {r.get("n", 1) for r in server.requests} == {4}

    ns = _run(COMPARE, ns)
    assert ns["reward_a"] > 0.5 > ns["reward_b"]
    assert ns["reward_a"] + ns["reward_b"] == pytest.approx(1.0)

    server.requests.clear()
    ns = _run(TRACK, ns)
    track = ns["result"]
    assert track.steps == [1, 2, 3, 4, 5]
    assert track.scores[-1] > 0.9 > track.scores[3] > track.scores[0]
    assert track.final == track.scores[-1]
    assert len(track.per_rep_scores) == 4 and all(len(row) == 5 for row in track.per_rep_scores)
    # One call per prefix; the prompt for step k holds k steps, each a whole line of the list.
    progress_prompts = [t for t in map(_text, server.requests) if "## Trajectory so far" in t]
    assert any('### Step 5\nTested: rev("abc") returned "cba"' in t for t in progress_prompts)


def test_the_online_tracker_and_the_multimodal_examples_run_unchanged(
    server: ScriptedServer, tmp_path: Path
) -> None:
    ns = _run(QUICKSTART.split("result = ")[0], {})
    ns = _run(ONLINE, ns)
    score = ns["score"]
    assert float(score) > 0.9 and not score < 0.05 and score > 0.5
    tracker = ns["tracker"]
    assert [p.step for p in tracker.curve] == [1, 2, 3, 4]
    tracker.close()

    for name, color in (
        ("before.png", (255, 0, 0)),
        ("after.png", (0, 255, 0)),
        ("camera_frame.png", (0, 0, 255)),
    ):
        _png(tmp_path / name, color)
    server.requests.clear()
    ns.update(
        criteria={"Correctness": "Does the code actually reverse the string?"}, step="Wrote the fix"
    )
    ns = _run(MULTIMODAL, ns)
    assert ns["result"].index == 0
    # The task's two images reach every pairwise prompt; the per-step frame is one image, not 16
    # letters.
    pair = [r for r in server.requests if "## Trajectory 1" in _text(r)]
    assert pair and all(_images(r) == 2 for r in pair)
    last = server.requests[-1]
    assert _images(last) == 1 and "## Trajectory so far" in _text(last)
    ns["tracker"].close()


def _images(body: dict[str, Any]) -> int:
    return sum(
        1
        for m in body.get("messages", [])
        if not isinstance(m.get("content"), str)
        for p in m["content"]
        if p.get("type") == "image_url"
    )


def test_the_pairwise_docs_page_runs_unchanged_and_both_orders_are_asked(
    server: ScriptedServer,
) -> None:
    ns = _run(DOCS_COMPARE, {})
    assert ns["reward_a"] > 0.5 > ns["reward_b"]
    prompts = _pairwise_prompts(server)
    # Both slot orders, one call each (n_evaluations=1, one criterion); model= names the model on
    # the server.
    assert len(prompts) == 2 and {r["model"] for r in server.requests} == {"gemini-2.5-flash"}
    firsts = {
        p.split("## Trajectory 1", 1)[1].split("## Trajectory 2", 1)[0].strip() for p in prompts
    }
    assert len(firsts) == 2

    ns.update(
        a=ns["candidates"][0], b=ns["candidates"][2], crits=["Does the code reverse the string?"]
    )
    ns = _run(DOCS_BIAS, ns)
    assert ns["r_a"] > ns["r_b"]
    c = agent_monitor.compare(ns["problem"], ns["a"], ns["b"], criteria=ns["crits"])
    assert c.p_a_over_b == pytest.approx(1 / (1 + 2.718281828459045 ** -(c.reward_a - c.reward_b)))
    assert c.p_a_over_b > 0.5


def test_a_failed_judge_is_never_a_reward_or_a_score(server: ScriptedServer) -> None:
    server.default = Reply(401, {"error": {"message": "bad key"}})
    c = agent_monitor.compare("t", "x", "y", criteria=["is it right?"])
    assert not c.ok and c.reason == "auth"
    with pytest.raises(ValueError, match="auth"):
        _reward_a, _reward_b = c
    tracker = agent_monitor.ProgressTracker("t")
    p = tracker.update("a step")
    assert not p.ok
    with pytest.raises(ScoringFailed, match="auth"):
        float(p)
    with pytest.raises(ScoringFailed):
        _ = p < 0.05
    tracker.close()
    with pytest.raises(agent_monitor.JudgeError):
        agent_monitor.select("t", ["x", "y"], criteria=["ok?"], on_error="raise")


def test_options_without_meaning_here_are_refused_with_what_to_use(server: ScriptedServer) -> None:
    with pytest.raises(UnsupportedOption, match="compare_fn="):
        agent_monitor.select("t", ["x", "y"], criteria=["ok?"], cache="cache/scores.json")
    with pytest.raises(UnsupportedOption, match="never makes a failure a score"):
        agent_monitor.select("t", ["x", "y"], criteria=["ok?"], on_error="tie")
    with pytest.raises(UnsupportedOption, match="on_progress="):
        agent_monitor.track("t", ["x"], progress=True)
    from agent_monitor.testing import FakeJudge

    judge = FakeJudge()
    with pytest.raises(UnsupportedOption, match="set it on that judge"):
        agent_monitor.track("t", ["x"], judge=judge, max_workers=4)
    with pytest.raises(TypeError, match="repeats= alone"):
        agent_monitor.track("t", ["x"], judge=judge, repeats=2, n_evaluations=3)
    with pytest.raises(TypeError, match="one string"):
        agent_monitor.select("t", "just one candidate", criteria=["ok?"])
    with pytest.raises(TypeError, match="unexpected keyword"):
        agent_monitor.track("t", ["x"], judge=judge, n_evaluation=2)


def test_the_judge_comes_from_the_environment_or_one_error_names_both_ways(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    empty: dict[str, str] = {}
    with pytest.raises(MissingJudgeError, match="AGENT_MONITOR_JUDGE_URL") as e:
        judge_from_env(None, environ=empty)
    assert "model=" in str(e.value) and "GEMINI_API_KEY" in str(e.value)
    with pytest.raises(MissingJudgeError, match="GEMINI_API_KEY"):
        judge_from_env("gemini-2.5-flash", environ=empty)
    with pytest.raises(MissingJudgeError, match="OPENAI_API_KEY"):
        judge_from_env("gpt-4o-mini", environ=empty)
    j = judge_from_env("gpt-4o-mini", max_workers=3, environ={"OPENAI_API_KEY": "sk-test"})
    assert type(j).__name__ == "OpenAIJudge" and j.model == "gpt-4o-mini" and j.concurrency == 3
    g = judge_from_env("gemini-2.5-flash", environ={"GEMINI_API_KEY": "k"})
    assert type(g).__name__ == "GeminiJudge"
    # .env is read as upstream reads it (KEY=value, comments), under the process environment, never
    # into it.
    (tmp_path / ".env").write_text(
        "# local judge\nAGENT_MONITOR_JUDGE_URL = http://127.0.0.1:9/v1\nX=a=b\n"
    )
    assert read_dotenv() == {"AGENT_MONITOR_JUDGE_URL": "http://127.0.0.1:9/v1", "X": "a=b"}
    j = judge_from_env("served", environ={})
    assert j.base_url == "http://127.0.0.1:9/v1" and j.model == "served"  # type: ignore[attr-defined]
    import os

    assert "X" not in os.environ


REFERENCE_CRITERIA = """# My Task — Verifier Criteria

<!-- An author's comment: never shown to the judge. -->

## Ground Truth Note

Do NOT trust the agent's self-assessment.

## Criteria

### Final Answer Correctness

Compare the final answer with what the task asked for.

### Empirical Verification {#verification}

Look at the commands the agent actually ran.
"""


def test_criteria_in_every_reference_form(tmp_path: Path) -> None:
    path = tmp_path / "my_task.md"
    path.write_text(REFERENCE_CRITERIA)
    r = agent_monitor.load_criteria(str(path))
    assert [c.name for c in r.criteria] == ["final_answer_correctness", "verification"]
    assert r.note == "Do NOT trust the agent's self-assessment."
    assert r.title == "My Task — Verifier Criteria"
    prompt = agent_monitor.build_prompt("t", r, [agent_monitor.Step(1, "ran it")], r.criteria[0])
    text = "".join(getattr(p, "text", "") for p in prompt.parts)
    assert "Do NOT trust the agent's self-assessment." in text and "author's comment" not in text
    # Each criterion's prompt shows that criterion (per-criterion prompts, issue 27): the second
    # one's, in its own.
    second = agent_monitor.build_prompt("t", r, [agent_monitor.Step(1, "ran it")], r.criteria[1])
    assert "Empirical Verification: Look at the commands" in "".join(
        getattr(p, "text", "") for p in second.parts
    )
    for name in ("terminal_bench", "swe_bench", "medagentbench"):
        bundled = agent_monitor.load_criteria(name)
        assert bundled.note and len(bundled.criteria) >= 2
    # ground_truth_note= replaces a file's note, in the prompt too.
    from agent_monitor._compat import with_note

    noted = with_note(str(path), "Trust only test output.")
    assert isinstance(noted, agent_monitor.Rubric) and noted.note == "Trust only test output."
    assert noted.hash != r.hash
    assert [
        c.name
        for c in agent_monitor.load_criteria({"Root cause": "Did it fix the cause?"}).criteria
    ] == ["Root cause"]
    assert [c.name for c in agent_monitor.load_criteria(["a", "b"]).criteria] == ["c1", "c2"]
    with pytest.raises(agent_monitor.CriteriaError, match="outside '## Criteria'"):
        agent_monitor.load_criteria(_write(tmp_path / "bad.md", "# T\n\n### Loose {#x}\n\ntext\n"))


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_a_string_step_and_one_image_path_are_one_each_in_the_async_tracker(tmp_path: Path) -> None:
    import asyncio

    from agent_monitor.testing import FakeJudge

    _png(tmp_path / "f.png", (1, 2, 3))
    judge = FakeJudge()

    async def main() -> None:
        t = agent_monitor.AsyncProgressTracker(
            "task", judge=judge, images=str(tmp_path / "f.png"), allow_files=True
        )
        await t.update("one step", images=str(tmp_path / "f.png"))
        assert len(t.steps) == 1 and len(t.steps[0].frames) == 1

    asyncio.run(main())
    assert judge.prompts[-1].image_count == 2  # the task's image and the step's, each once
    results = agent_monitor.track("task", "a whole trajectory as one string", judge=FakeJudge())
    assert len(results) == 1 and results.steps == [1]
    assert re.search(
        r"### Step 1\n", "".join(getattr(p, "text", "") for p in judge.prompts[-1].parts)
    )


def test_a_prebuilt_openai_client_becomes_the_judge(
    server: ScriptedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import openai

    monkeypatch.delenv("AGENT_MONITOR_JUDGE_URL")
    client = openai.OpenAI(base_url=server.url, api_key="k")
    good, bad = "def rev(s): return s[::-1]", "def rev(s): return s"
    reward_a, reward_b = agent_monitor.compare(
        "reverse", good, bad, criteria=["correct?"], client=client, model="mine"
    )
    assert reward_a > reward_b and {r["model"] for r in server.requests} == {"mine"}

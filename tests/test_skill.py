"""The llm-as-verifier skill's files (tests/fixtures/skill: its rubric.json and prompt.md, MIT)
and its self-check."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent_monitor import ProgressTracker, load_criteria
from agent_monitor.templates import TemplateError, check_template, load_template
from agent_monitor.testing import FakeJudge
from tests.brokers import Mosquitto
from tests.paths import FIXTURES

SKILL = FIXTURES / "skill"


def self_check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent_monitor", "self-check", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_skill_rubric_loads_with_its_scale_weights_and_thresholds() -> None:
    r = load_criteria(str(SKILL / "rubric.json"))
    assert [c.name for c in r.criteria] == ["specification", "output", "errors"]
    assert [c.weight for c in r.criteria] == pytest.approx([0.34, 0.33, 0.33])
    assert r.reversed_scale and "A = best (value 20)" in r.scale and r.verdicts == (0.8, 0.6)
    assert [r.verdict(s) for s in (0.85, 0.8, 0.7, 0.6, 0.59)] == [
        "pass",
        "pass",
        "review",
        "review",
        "fail",
    ]


def test_the_skill_scale_is_told_to_the_judge_and_its_letters_are_not_flipped_silently() -> None:
    # The skill's A is its best answer: an all-A judge means done, an all-T judge means failed.
    for letter, want in (("A", 1.0), ("T", 0.0), ("B", 18 / 19)):
        judge = FakeJudge([letter])
        with ProgressTracker(
            "reverse a string", judge=judge, criteria=str(SKILL / "rubric.json"), repeats=1
        ) as t:
            p = t.update("wrote and tested rev")
        assert p.score == pytest.approx(want)
        prompt = judge.prompts[-1]
        assert "A = clearly and completely succeeded" in prompt.instructions
        assert "from A (nothing done) to T" not in prompt.tail[-1].text  # type: ignore[union-attr]
        assert "from A (best) to T (worst)" in prompt.tail[-1].text  # type: ignore[union-attr]


def test_a_skill_rubric_whose_weights_do_not_sum_to_one_is_refused(tmp_path: Path) -> None:
    data = json.loads((SKILL / "rubric.json").read_text())
    data["criteria"][0]["weight"] = 0.5
    bad = tmp_path / "rubric.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"sum to 1\.16"):
        load_criteria(str(bad))
    out = self_check("--rubric", str(bad))
    assert out.returncode == 1 and "FAIL rubric" in out.stdout and "sum to 1.16" in out.stdout


def test_self_check_passes_on_the_skill_files_and_says_where_the_pairwise_prompt_is_used() -> None:
    out = self_check("--rubric", str(SKILL / "rubric.json"), "--prompt", str(SKILL / "prompt.md"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAIL" not in out.stdout and "expectation of uniform A..T" in out.stdout
    assert "a pairwise template" in out.stdout and "progress grades one trajectory" in out.stdout
    assert "verdicts at pass 0.8 / review 0.6" in out.stdout


def test_templates_are_checked_for_placeholders_and_prefix_stability(tmp_path: Path) -> None:
    good = check_template("Judge.\n{task}\n{criteria}\n{trajectory}\n{question}\n")
    assert good.kind == "progress"
    with pytest.raises(TemplateError, match="lacks \\{criteria\\}"):
        check_template("{task}\n{trajectory}\n{question}")
    with pytest.raises(TemplateError, match="unknown placeholder"):
        check_template("{task}\n{criteria}\n{trajectory}\n{question}\n{step_count}")
    pairwise = load_template(SKILL / "prompt.md")
    assert pairwise.kind == "pairwise"
    with pytest.raises(TemplateError, match="use it with compare/select"):
        pairwise.check_for("progress")
    bad = tmp_path / "question_first.md"
    bad.write_text("{question}\n{task}\n{criteria}\n{trajectory}\n")
    out = self_check("--prompt", str(bad))
    assert out.returncode == 1 and "{question} comes before {trajectory}" in out.stdout


def test_track_gives_the_skill_rubric_verdict_on_the_final_score() -> None:
    from agent_monitor import track

    done = track("t", ["a", "b"], judge=FakeJudge(["T", "A"]), criteria=str(SKILL / "rubric.json"))
    assert done.final == 1.0 and done.verdict == "pass"
    # 1 - 6/19 = 0.684
    shaky = track("t", ["a"], judge=FakeJudge(["G"]), criteria=str(SKILL / "rubric.json"))
    assert shaky.verdict == "review"
    # no thresholds in the default rubric
    assert track("t", ["a"], judge=FakeJudge(["T"])).verdict is None


TEMPLATE = """You grade a coding agent for the team. Be strict.

# The task
{task}

# What we grade
{criteria}

# What the agent did
{trajectory}

# Your answer
{question}
"""


def test_a_progress_template_lays_out_the_prompt_and_stays_prefix_stable() -> None:
    judge = FakeJudge()
    with ProgressTracker("reverse a string", judge=judge, prompt=TEMPLATE, repeats=1) as t:
        t.update("wrote rev")
        t.update("ran the tests: 3 passed")
    one, two = judge.prompts
    assert (
        one.instructions
        == two.instructions
        == ("You grade a coding agent for the team. Be strict.\n\n# The task")
    )
    head1, head2 = one.prefix_text(), two.prefix_text()
    assert (
        head2.startswith(head1) and "# What the agent did" in head1 and "reverse a string" in head1
    )
    assert "# Your answer" in one.tail[-1].text and "1 step so far" in one.tail[-1].text  # type: ignore[union-attr]
    assert t.rubric.template == TEMPLATE
    with pytest.raises(TemplateError, match="use it with compare/select"):
        ProgressTracker("t", judge=FakeJudge(), prompt=str(SKILL / "prompt.md"))
    with pytest.raises(TemplateError, match="before"):
        ProgressTracker(
            "t", judge=FakeJudge(), prompt="{question}\n{task}\n{criteria}\n{trajectory}"
        )


async def test_serve_prompt_lays_out_every_runs_prompts_and_its_own_rubric_too(
    tmp_path: Path,
) -> None:
    from agent_monitor.daemon import MemoryStore, Monitor, MonitorConfig

    path = tmp_path / "prompt.md"
    path.write_text(TEMPLATE)
    judge = FakeJudge()
    async with Monitor(
        MonitorConfig(prompt=str(path)), judge=judge, store=MemoryStore()
    ) as monitor:
        await monitor.handle("agents/r1/start", json.dumps({"task": "reverse a string"}).encode())
        own = {
            "task": "sort a list",
            "criteria": [{"name": "tests_pass", "description": "the tests pass"}],
        }
        await monitor.handle("agents/r2/start", json.dumps(own).encode())
        for run in ("r1", "r2"):
            await monitor.handle(
                f"agents/{run}/step", json.dumps({"index": 1, "text": "wrote it"}).encode()
            )
        await monitor.drain()
    assert len(judge.prompts) == 2
    for prompt in judge.prompts:
        assert prompt.instructions == (
            "You grade a coding agent for the team. Be strict.\n\n# The task"
        )
        assert "# What the agent did" in prompt.prefix_text()
    # The run with its own rubric: its criteria in the operator's layout.
    mine = next(p for p in judge.prompts if "sort a list" in p.text())
    assert "the tests pass" in mine.prefix_text()


def test_serve_prompt_is_checked_at_start_up_before_the_judge_or_broker(tmp_path: Path) -> None:
    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "agent_monitor",
                "serve",
                "--judge",
                "openai",
                "--judge-url",
                "http://127.0.0.1:9",
                "--broker",
                "mqtt://127.0.0.1:9",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )

    swapped = tmp_path / "swapped.md"
    swapped.write_text("{task}\n{criteria}\n{question}\n{trajectory}")
    out = serve("--prompt", str(swapped))
    assert out.returncode != 0
    assert "--prompt" in out.stderr and "put {question} after {trajectory}" in out.stderr
    out = serve("--prompt", str(SKILL / "prompt.md"))
    assert out.returncode != 0 and "use it with compare/select" in out.stderr
    out = serve("--prompt", str(tmp_path / "missing.md"))
    assert out.returncode != 0 and "cannot read prompt template" in out.stderr
    assert "Traceback" not in out.stderr


async def test_a_run_ending_under_a_rubric_with_thresholds_gets_its_verdict_on_mqtt_and_in_export(
    broker: Mosquitto, tmp_path: Path
) -> None:
    from agent_monitor.daemon import Monitor, MonitorConfig, SqliteStore
    from agent_monitor.wire import BrokerSettings, ProgressOut
    from tests.daemon.test_daemon_mqtt import harness

    def answer(prompt: Any) -> str:
        # The skill scale runs A = best: A is 1.0 (pass), G 0.684 (review).
        return "A" if "the good task" in prompt.prefix_text() else "G"

    store = SqliteStore(tmp_path / "runs.db")
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url),
        client_id="mon-verdict",
        criteria=str(SKILL / "rubric.json"),
    )
    async with Monitor(config, judge=FakeJudge(answer), store=store), harness(broker.port) as h:
        for run, task in (("good", "the good task"), ("shaky", "the shaky task")):
            await h.publish(run, "start", {"task": task})
            await h.publish(run, "step", {"index": 1, "text": "did it"})
        await h.until(lambda: h.last_step("good") == 1 and h.last_step("shaky") == 1)
        assert all(
            "verdict" not in p or p["verdict"] is None
            for r in ("good", "shaky")
            for p in h.progress(r)
        )
        for run in ("good", "shaky"):
            await h.publish(run, "end", {"outcome": "success"})
        await h.until(lambda: all(h.progress(r)[-1].get("final") for r in ("good", "shaky")))
        finals = {r: ProgressOut.model_validate(h.progress(r)[-1]) for r in ("good", "shaky")}
    assert (finals["good"].verdict, finals["good"].step, finals["good"].score) == ("pass", 1, 1.0)
    assert finals["shaky"].verdict == "review"
    exported = await store.export("good")
    assert (
        exported is not None
        and exported["verdict"] == "pass"
        and exported["curve"][-1]["final"] is True
    )
    await store.aclose()


async def test_a_rubric_without_thresholds_sends_no_final_message(broker: Mosquitto) -> None:
    from agent_monitor.daemon import Monitor, MonitorConfig
    from agent_monitor.wire import BrokerSettings
    from tests.daemon.test_daemon_mqtt import harness

    config = MonitorConfig(broker=BrokerSettings.from_url(broker.url), client_id="mon-plain")
    async with Monitor(config, judge=FakeJudge(), store=None), harness(broker.port) as h:
        await h.publish("r", "start", {"task": "t"})
        await h.publish("r", "step", {"index": 1, "text": "did it"})
        await h.until(lambda: h.last_step("r") == 1)
        await h.publish("r", "end", {"outcome": "success"})
        # the retained signal cleared: closed
        await h.until(lambda: h.seen[("r", "signal")][-1:] == [None])
    assert len(h.progress("r")) == 1 and not h.progress("r")[0].get("final")


def _skill_judge(prompt: Any) -> str:
    """A letter per tag on the skill's scale (A = best): the trajectory that ran the tests is
    near the best."""
    text, tail = prompt.prefix_text(), prompt.tail[-1].text
    slot_a = text.split("**Trajectory A:**", 1)[1].split("**Trajectory B:**", 1)[0]
    good_in_a = "3 passed" in slot_a
    asks_a = "<score_A>" in tail
    return "B" if asks_a == good_in_a else "R"


def test_compare_with_the_skill_pairwise_template_reads_a_letter_per_tag_in_both_orders() -> None:
    from agent_monitor import compare

    good, bad = ["wrote rev", "ran the tests: 3 passed"], ["wrote rev", "gave up"]
    judge = FakeJudge(_skill_judge)
    # the skill's scale (A = best), as its template tells the judge
    rubric = str(SKILL / "rubric.json")
    c = asyncio.run(
        compare(
            "reverse a string",
            good,
            bad,
            judge=judge,
            criteria=rubric,
            prompt=str(SKILL / "prompt.md"),
        )
    )
    # Two orders x two tags: 4 calls for each of the 3 judged criteria; e(B) = 1/19, e(R) = 17/19.
    assert c.ok and c.calls == 12 == len(judge.prompts)
    assert c.preference == pytest.approx(35 / 38) and c.forward == pytest.approx(3 / 38)
    reward_a, reward_b = c
    assert reward_a > 0.9 > 0.1 > reward_b
    tags = sorted("<score_A>" in p.tail[-1].text for p in judge.prompts)
    assert tags == [False] * 6 + [True] * 6
    # The template's own layout: its head before {task} is the instructions; the tags' prompts share
    # their head.
    first = judge.prompts[0]
    assert first.instructions.startswith("# Verifier Prompt Template (directed pairwise scoring)")
    assert first.instructions.endswith("**Task:**") and "{criterion_name}" not in first.instructions
    assert first.criterion in first.instructions  # its criterion named where the template puts it
    assert first.prefix[0].text.startswith("reverse a string\n\n**Trajectory A:**")  # type: ignore[union-attr]
    assert "{a}" not in first.prefix_text() and "### Step 2\n" in first.prefix_text()
    heads = {p.prefix_text() for p in judge.prompts}
    assert len(heads) == 6  # one per criterion and order, shared by its two tags
    # The letter is read right after the question: the template's own closing lines come before it.
    assert all(
        p.tail[-1].text.strip().startswith("Give only the letter of <score_") for p in judge.prompts
    )


def test_select_takes_the_skill_pairwise_template_and_a_progress_template_is_refused_for_compare() -> (  # noqa: E501 (the test's name is its sentence)
    None
):
    from agent_monitor import compare, select

    cands = [["wrote rev", "gave up"], ["wrote rev", "ran the tests: 3 passed"], ["looked around"]]
    prompt, rubric = str(SKILL / "prompt.md"), str(SKILL / "rubric.json")
    s = select(
        "reverse a string", cands, judge=FakeJudge(_skill_judge), criteria=rubric, prompt=prompt
    )
    assert s.method == "pairwise" and s.index == 1 and s.ranking[0] == 1
    # Our bundled rubric describes its letters the other way (A = worst): refused with the template,
    # not misread.
    with pytest.raises(ValueError, match="A = worst, T = best"):
        select("reverse a string", cands, judge=FakeJudge(_skill_judge), prompt=prompt)
    with pytest.raises(TemplateError, match="compare/select need a pairwise one"):
        asyncio.run(compare("t", ["a"], ["b"], judge=FakeJudge(), prompt=TEMPLATE))
    with pytest.raises(ValueError, match="needs pairwise=True"):
        select("t", cands, judge=FakeJudge(), prompt=str(SKILL / "prompt.md"), pairwise=False)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.filterwarnings("ignore::agent_monitor.judges.llamacpp.TinyJudgeWarning")
def test_the_skill_pairwise_template_on_a_real_model_reads_each_tag_s_letter() -> None:
    """The packaged tiny judge, in process: every tag's prompt gives a letter distribution at the
    answer position."""
    pytest.importorskip("llama_cpp")
    from agent_monitor import LlamaCppJudge, compare
    from tests.llama_models import gemma_path

    judge = LlamaCppJudge(gemma_path(), n_ctx=4096)
    try:
        good, bad = (
            ["wrote def rev(s): return s[::-1]", "ran the tests: 3 passed"],
            ["wrote rev", "gave up"],
        )
        c = asyncio.run(
            compare(
                "Write a function that reverses a string.",
                good,
                bad,
                judge=judge,
                criteria=str(SKILL / "rubric.json"),
                prompt=str(SKILL / "prompt.md"),
            )
        )
    finally:
        judge.close()
    # A score or a reason, never a made-up one: with the whole vocabulary read, the letters hold the
    # mass.
    assert c.ok, (c.reason, c.error)
    assert c.calls == 12 and c.preference is not None and 0.0 <= c.preference <= 1.0
    assert (
        c.forward is not None
        and c.backward is not None
        and set(c.criteria) == {"specification", "output", "errors"}
    )

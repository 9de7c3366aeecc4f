"""lmms-eval's verifiers guide, its code blocks run with only the package name changed (lmms_eval ->
agent_monitor).

The LLM verifiers talk to a scripted OpenAI-compatible server (tests/openai_server.py) named by
OPENAI_BASE_URL, as the guide's `OpenAIVerifier()` reads the environment.
"""

from __future__ import annotations

from typing import Any

import pytest

from agent_monitor import CriteriaError, load_criteria
from tests.openai_server import Reply, ScriptedServer, chat_choice, chat_reply, scripted_server

QUICK_START = """
from agent_monitor.verifiers import VerificationPipeline
from agent_monitor.verifiers.extractors import StripReasoningExtractor
from agent_monitor.verifiers.rule import ExactMatchVerifier

pipeline = VerificationPipeline(
    extractors=[StripReasoningExtractor()],
    verifier=ExactMatchVerifier(ignore_case=True),
)
result = pipeline("What color is the sky?", "<think>hmm</think>Blue", "Blue")
assert result.is_correct
"""

FROM_CONFIG = """
from agent_monitor.verifiers import build_verification_pipeline

pipeline = build_verification_pipeline({
    "extractors": [{"type": "strip_reasoning"}],
    "verifier": {"type": "openai", "model": "gpt-4o-2024-11-20", "judge_type": "binary"},
})
"""

COMPOSITE = """
from agent_monitor.verifiers.composite import CompositeVerifier
from agent_monitor.verifiers.rule import ExactMatchVerifier
from agent_monitor.verifiers.openai import OpenAIVerifier

verifier = CompositeVerifier([
    ExactMatchVerifier(),   # fast, always confident
    OpenAIVerifier(),       # expensive fallback
])
"""

JUDGE_FAILURES = """
def my_process_results(doc, results):
    verdict = _pipeline(doc["question"], results[0], doc["answer"])
    if verdict.metadata.get("judge_failed"):
        # judge infra failed — track separately so it doesn't count against acc
        return {"acc": 0.0, "judge_failed": 1.0}
    return {"acc": 1.0 if verdict.is_correct else 0.0, "judge_failed": 0.0}
"""

IN_A_TASK = """
from agent_monitor.verifiers import build_verification_pipeline

_pipeline = build_verification_pipeline({
    "extractors": [{"type": "strip_reasoning"}],
    "verifier": {"type": "exact_match"},
})

def my_process_results(doc, results):
    prediction = results[0]
    verdict = _pipeline(doc["question"], prediction, doc["answer"])
    return {"acc": 1.0 if verdict.is_correct else 0.0}
"""

CUSTOM = """
from agent_monitor.verifiers.base import Verifier, VerifyResult

class MyVerifier(Verifier):
    def verify(self, question, prediction, ground_truth, **kwargs) -> VerifyResult:
        correct = my_custom_check(prediction, ground_truth)
        return VerifyResult(score=1.0 if correct else 0.0, is_correct=correct)
"""


def _run(code: str, ns: dict[str, Any] | None = None) -> dict[str, Any]:
    ns = {} if ns is None else ns
    exec(compile(code, "<lmms-eval guide>", "exec"), ns)  # the guide's blocks, this file's own text
    return ns


def judge_says(body: dict[str, Any]) -> Reply:
    """T when the prediction (the prompt's tail) holds the reference answer's word, else A."""
    text = "\n".join(
        m["content"] if isinstance(m["content"], str) else "" for m in body["messages"]
    )
    reference = text.split("## Reference answer\n", 1)[1].split("\n", 1)[0].strip().lower()
    prediction = text.split("## Prediction\n", 1)[1].lower()
    letter = "T" if reference in prediction else "A"
    return chat_reply(chat_choice([(letter, {letter: 0.9, "J": 0.1})]))


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Any:
    with scripted_server() as s:
        s.default = judge_says
        monkeypatch.setenv("OPENAI_BASE_URL", s.url)
        monkeypatch.setenv("OPENAI_API_KEY", "not-needed")
        yield s


def test_the_quick_start_runs() -> None:
    ns = _run(QUICK_START)
    assert ns["result"].is_correct and ns["result"].score == 1.0
    assert ns["result"].metadata["confident"] is True


def test_the_config_built_openai_judge_and_the_composite_fallback(server: ScriptedServer) -> None:
    ns = _run(FROM_CONFIG)
    r = ns["pipeline"](
        "What color is the sky?", "<think>it is blue</think>It's blue, of course.", "blue"
    )
    assert r.is_correct and r.metadata["judge_failed"] is False
    # the expectation over the letters, not a parsed word
    assert r.score == pytest.approx(0.9 * 1.0 + 0.1 * 9 / 19)
    assert (
        server.requests[-1]["model"] == "gpt-4o-2024-11-20"
        and server.requests[-1]["max_tokens"] == 1
    )
    assert "it is blue" not in str(server.requests[-1])  # the reasoning block was stripped first

    ns = _run(COMPOSITE)
    calls = len(server.requests)
    exact = ns["verifier"]("q", "Paris", "paris")
    assert exact.is_correct and len(server.requests) == calls  # confident: the judge is not asked
    fallback = ns["verifier"]("Capital of France?", "I believe it is Paris.", "paris")
    assert (
        fallback.is_correct
        and fallback.metadata["verifier_index"] == 1
        and len(server.requests) == calls + 1
    )
    wrong = ns["verifier"]("Capital of France?", "Lyon", "paris")
    assert not wrong.is_correct and wrong.score < 0.1


def test_judge_failures_are_flagged_never_raised(server: ScriptedServer) -> None:
    server.default = Reply(503, {"error": {"message": "overloaded"}})
    from agent_monitor.verifiers import build_verification_pipeline

    ns = {
        "_pipeline": build_verification_pipeline({"verifier": {"type": "openai", "max_retries": 0}})
    }
    ns = _run(JUDGE_FAILURES, ns)
    assert ns["my_process_results"]({"question": "q", "answer": "a"}, ["a"]) == {
        "acc": 0.0,
        "judge_failed": 1.0,
    }
    v = ns["_pipeline"]("q", "a", "a")
    assert v.score == 0.0 and not v.is_correct and v.metadata["reason"] == "server_error"


def test_the_task_helper_and_a_custom_verifier_run() -> None:
    ns = _run(IN_A_TASK)
    assert ns["my_process_results"](
        {"question": "q", "answer": "Blue"}, ["<think>x</think> blue "]
    ) == {"acc": 1.0}
    assert ns["my_process_results"]({"question": "q", "answer": "Blue"}, ["red"]) == {"acc": 0.0}
    ns = _run(CUSTOM, {"my_custom_check": lambda p, g: p.strip() == g})
    assert ns["MyVerifier"]()("q", " 4 ", "4").is_correct


@pytest.mark.parametrize(
    ("prediction", "truth", "correct", "confident"),
    [
        ("(B)", "B", True, True),
        ("B.", "(B)", True, True),
        ("B)", "b", True, True),
        ("The answer is (C) because ...", "C", True, True),
        ("Answer: A", "B", False, True),  # cleanly read, wrong: a confident wrong
        ("I cannot decide", "B", False, False),  # no letter: falls through
        ("A or B", "A", False, False),  # ambiguous: falls through
    ],
)
def test_mcq_match_is_tolerant_of_formats(
    prediction: str, truth: str, correct: bool, confident: bool
) -> None:
    from agent_monitor.verifiers.rule import MCQMatchVerifier

    r = MCQMatchVerifier().verify("q", prediction, truth)
    assert (r.is_correct, r.metadata["confident"]) == (correct, confident)


def test_mcq_and_number_pipelines() -> None:
    from agent_monitor.verifiers import build_verification_pipeline

    mcq = build_verification_pipeline(
        {"extractors": [{"type": "mcq"}], "verifier": {"type": "mcq_match"}}
    )
    # Without strip_reasoning the thinking's explicit answer is read; with it, the final one.
    assert mcq("q", "<think>the answer is (D)</think>(A)", "A").is_correct is False
    mcq2 = build_verification_pipeline(
        {
            "extractors": [{"type": "strip_reasoning"}, {"type": "mcq"}],
            "verifier": {"type": "mcq_match"},
        }
    )
    assert mcq2("q", "<think>the answer is (D)</think>(A)", "A").is_correct
    assert mcq2("q", "<think>maybe A</think>So the answer is (D).", "D").is_correct
    num = build_verification_pipeline(
        {"extractors": [{"type": "number"}], "verifier": {"type": "numeric"}}
    )
    assert num("q", "so \\boxed{1,234.5}", "1234.5").is_correct
    assert num("q", "first 3 then 12", "12").is_correct
    r = num("q", "no number here", "12")
    assert not r.is_correct and r.metadata["confident"] is False
    close = build_verification_pipeline({"verifier": {"type": "numeric", "rel_tol": 0.01}})
    assert close("q", "99.5", "100").is_correct and not close("q", "98", "100").is_correct
    regex = build_verification_pipeline(
        {
            "extractors": [{"type": "regex", "pattern": r"ANSWER:\s*(\w+)", "fallback": "none"}],
            "verifier": {"type": "exact_match"},
        }
    )
    assert regex("q", "blah ANSWER: yes", "YES").is_correct and regex.extract("nothing") == "none"
    strip = build_verification_pipeline({"extractors": ["strip"], "verifier": {"type": "contains"}})
    assert strip("q", "the answer is blue</s><|im_end|>", "Blue").is_correct


def test_configs_are_read_exactly_or_refused_with_the_key_named() -> None:
    from agent_monitor.verifiers import build_verification_pipeline

    with pytest.raises(ValueError, match="'thresholds'"):
        build_verification_pipeline(
            {"verifier": {"type": "exact_match"}, "thresholds": {"pass": 0.5}}
        )
    with pytest.raises(ValueError, match="unknown verifier type 'fuzzy'"):
        build_verification_pipeline({"verifier": {"type": "fuzzy"}})
    with pytest.raises(ValueError, match="ignorecase"):
        build_verification_pipeline({"verifier": {"type": "exact_match", "ignorecase": True}})
    with pytest.raises(ValueError, match="'verifier' is missing"):
        build_verification_pipeline({"extractors": ["strip"]})
    # The same config given as a rubric (criteria=, a start event's rubric) is refused, never
    # criteria named after keys.
    with pytest.raises(CriteriaError, match=r"'verifier'.*build_verification_pipeline"):
        load_criteria(
            {"extractors": [{"type": "strip_reasoning"}], "verifier": {"type": "exact_match"}}
        )

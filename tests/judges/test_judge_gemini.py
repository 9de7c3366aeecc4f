"""GeminiJudge through the real google-genai SDK against a scripted local Gemini REST server."""

from __future__ import annotations

import base64
import io
import math
import random
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from google import genai
from google.genai import types

from agent_monitor import AsyncProgressTracker
from agent_monitor.criteria import load_criteria
from agent_monitor.images import Frame, load_image
from agent_monitor.judges.base import JudgeError, JudgeRequest, Usage
from agent_monitor.judges.gemini import GeminiJudge
from agent_monitor.prompts import INSTRUCTIONS, Prompt, Step, TextPart, build_prompt
from agent_monitor.scale import LETTERS, ScoreError, distribution
from tests.gemini_server import (
    GeminiServer,
    Received,
    Reply,
    candidate,
    error,
    iter_parts,
    letter_reply,
    response,
    step,
    text_candidate,
)

ln = math.log
MODEL = "gemini-test"


@pytest.fixture
def server() -> Iterator[GeminiServer]:
    srv = GeminiServer().start()
    yield srv
    srv.stop()


@pytest.fixture
async def make_judge(server: GeminiServer) -> AsyncIterator[Callable[..., GeminiJudge]]:
    judges: list[GeminiJudge] = []

    def make(**kw: Any) -> GeminiJudge:
        kw.setdefault("model", MODEL)
        if "client" not in kw:
            kw.setdefault("api_key", "test")
            kw.setdefault("base_url", server.url)
        kw.setdefault("backoff_s", 0.001)
        kw.setdefault("timeout_s", 5.0)
        judge = GeminiJudge(**kw)
        judges.append(judge)
        return judge

    yield make
    for j in judges:
        await j.aclose()


def prompt(steps: tuple[Step, ...] = (Step(1, "did x"),)) -> Prompt:
    rubric = load_criteria(None)
    return build_prompt(
        "Fix the failing test in repo foo.", rubric, list(steps), rubric.criteria[0]
    )


def png(color: tuple[int, int, int] = (255, 0, 0), fmt: str = "PNG") -> Frame:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 3), color).save(buf, format=fmt)
    return load_image(buf.getvalue())


def config(req: Received) -> dict[str, Any]:
    cfg: dict[str, Any] = req.body["generationConfig"]
    return cfg


def key(d: Any, camel: str, snake: str) -> Any:
    """A field the SDK may serialise in either spelling (it sends some nested fields in
    snake_case)."""
    return d[camel] if camel in d else d[snake]


# --- scores
# --------------------------------------------------------------------------------------------------


async def test_exact_logprobs_give_the_exact_expectation(
    server: GeminiServer, make_judge: Callable[..., GeminiJudge]
) -> None:
    server.queue(letter_reply({"C": ln(0.5), "E": ln(0.25), " e": ln(0.25)}))
    resp = await make_judge().grade(JudgeRequest(prompt()))

    assert resp.model == MODEL and resp.attempts == 1
    (sample,) = resp.samples
    assert sample is not None
    assert dict(sample) == pytest.approx({"C": ln(0.5), "E": ln(0.25), " e": ln(0.25)})
    d = distribution(sample)
    assert d.expectation == pytest.approx(0.5 * 2 / 19 + 0.5 * 4 / 19)
    assert d.mass == pytest.approx(1.0)
    assert d.as_dict() == {"C": pytest.approx(0.5), "E": pytest.approx(0.5)}


async def test_the_letter_is_read_at_the_first_generated_letter_position(
    server: GeminiServer, make_judge: Callable[..., GeminiJudge]
) -> None:
    server.queue(
        response(
            candidate(
                step({"Grade": ln(0.9), "Score": ln(0.1)}),
                step({":": 0.0}),
                step({" K": ln(0.7), " L": ln(0.3)}),
                step({"\n": 0.0}),
            )
        )
    )
    resp = await make_judge(max_output_tokens=4).grade(JudgeRequest(prompt()))

    assert config(server.requests[0])["maxOutputTokens"] == 4
    (sample,) = resp.samples
    assert sample is not None and set(sample) == {" K", " L"}
    assert distribution(sample).expectation == pytest.approx(0.7 * 10 / 19 + 0.3 * 11 / 19)


async def test_the_chosen_token_counts_even_when_missing_from_the_top_candidates(
    server: GeminiServer, make_judge: Callable[..., GeminiJudge]
) -> None:
    server.queue(
        response(candidate(step({"C": ln(0.5), "E": ln(0.3)}, chosen="D", chosen_lp=ln(0.2))))
    )
    (sample,) = (await make_judge().grade(JudgeRequest(prompt()))).samples

    assert sample is not None and sample["D"] == pytest.approx(ln(0.2))
    assert distribution(sample).expectation == pytest.approx((0.5 * 2 + 0.3 * 4 + 0.2 * 3) / 19)


@pytest.mark.parametrize(
    "top",
    [{"The": ln(0.6), "One": ln(0.3)}, {"The": 0.0}],
    ids=["The-One", "The-only"],
)
async def test_an_answer_without_a_letter_is_no_score(
    server: GeminiServer, make_judge: Callable[..., GeminiJudge], top: dict[str, float]
) -> None:
    server.queue(letter_reply(top))
    (sample,) = (await make_judge().grade(JudgeRequest(prompt()))).samples

    assert sample is not None and set(sample) == set(top)  # the answer exists ...
    with pytest.raises(ScoreError) as exc:
        distribution(sample)  # ... but it is not a number: "The" is not "T"
    assert exc.value.reason == "no_letter"


async def test_a_sliver_of_letter_mass_is_no_score(
    server: GeminiServer, make_judge: Callable[..., GeminiJudge]
) -> None:
    server.queue(letter_reply({"The": ln(0.94), "T": ln(0.06)}))
    (sample,) = (await make_judge().grade(JudgeRequest(prompt()))).samples

    assert sample is not None
    with pytest.raises(ScoreError) as exc:
        distribution(sample)
    assert exc.value.reason == "low_mass"


async def test_a_candidate_without_logprobs_is_an_empty_sample(
    server: GeminiServer, make_judge: Callable[..., GeminiJudge]
) -> None:
    bare = {
        "content": {"role": "model", "parts": [{"text": "C"}]},
        "finishReason": "STOP",
        "index": 0,
    }
    server.queue(response(bare))
    resp = await make_judge().grade(JudgeRequest(prompt()))
    assert resp.samples == (None,)


async def test_a_blocked_prompt_is_a_judge_error(
    server: GeminiServer, make_judge: Callable[..., GeminiJudge]
) -> None:
    server.queue(
        Reply(
            {"promptFeedback": {"blockReason": "SAFETY"}, "usageMetadata": {"promptTokenCount": 9}}
        )
    )
    with pytest.raises(JudgeError) as exc:
        await make_judge().grade(JudgeRequest(prompt()))
    assert exc.value.reason == "blocked" and not exc.value.retryable
    assert "(SAFETY)" in str(exc.value)
    assert len(server.requests) == 1


# --- the request
# ----------------------------------------------------------------------------------------------


async def test_the_request_asks_for_logprobs_of_one_token_with_the_prompt(
    server: GeminiServer, make_judge: Callable[..., GeminiJudge]
) -> None:
    server.queue(letter_reply({"C": 0.0}))
    p = prompt()
    await make_judge().grade(JudgeRequest(p))

    (req,) = server.requests
    assert req.path.endswith(f"/models/{MODEL}:generateContent")
    assert req.headers["x-goog-api-key"] == "test"
    cfg = config(req)
    assert cfg["responseLogprobs"] is True
    assert cfg["logprobs"] == 20
    assert cfg["maxOutputTokens"] == 1
    assert cfg["temperature"] == 0.0
    assert cfg["candidateCount"] == 1
    assert key(cfg["thinkingConfig"], "thinkingBudget", "thinking_budget") == 0
    assert [part["text"] for part in req.body["systemInstruction"]["parts"]] == [INSTRUCTIONS]
    (content,) = req.body["contents"]
    assert content["role"] == "user"
    sent = "".join(part["text"] for part in content["parts"])
    assert sent == "".join(part.text for part in p.parts if isinstance(part, TextPart))
    assert "### Step 1\ndid x" in sent and "Fix the failing test in repo foo." in sent


async def test_thinking_config_is_left_out_when_thinking_budget_is_none(
    server: GeminiServer, make_judge: Callable[..., GeminiJudge]
) -> None:
    server.queue(letter_reply({"C": 0.0}))
    await make_judge(thinking_budget=None, top_logprobs=5).grade(JudgeRequest(prompt()))
    cfg = config(server.requests[0])
    assert "thinkingConfig" not in cfg and cfg["logprobs"] == 5


async def test_images_are_sent_inline_in_prompt_order(
    server: GeminiServer, make_judge: Callable[..., GeminiJudge]
) -> None:
    first, second = png((255, 0, 0)), png((0, 0, 255), fmt="JPEG")
    assert (first.mime, second.mime) == ("image/png", "image/jpeg")
    server.queue(letter_reply({"C": 0.0}))
    resp = await make_judge().grade(
        JudgeRequest(prompt((Step(1, "did x", frames=(first, second)),)))
    )
    assert resp.images_dropped == 0

    parts = list(iter_parts(server.requests[0]))
    images = [
        (i, key(part["inlineData"], "mimeType", "mime_type"), part["inlineData"]["data"])
        for i, part in enumerate(parts)
        if "inlineData" in part
    ]
    # The SDK sends bytes as URL-safe base64.
    assert [(mime, base64.urlsafe_b64decode(data)) for _, mime, data in images] == [
        ("image/png", first.data),
        ("image/jpeg", second.data),
    ]
    # The anchor frame follows its step's text; the recent frame sits in the tail before the
    # question.
    text_before = "".join(part.get("text", "") for part in parts[: images[0][0]])
    assert text_before.endswith("### Step 1\ndid x\n")
    assert "## Question" in "".join(part.get("text", "") for part in parts[images[1][0] :])


async def test_without_vision_images_become_text_placeholders(
    server: GeminiServer, make_judge: Callable[..., GeminiJudge]
) -> None:
    frame = png()
    server.queue(letter_reply({"C": 0.0}), letter_reply({"C": 0.0}))
    judge = make_judge(vision=False)
    resp = await judge.grade(JudgeRequest(prompt((Step(1, "did x", frames=(frame, frame)),))))
    assert resp.images_dropped == 2  # a score computed without the step's frames says so
    assert (await judge.grade(JudgeRequest(prompt()))).images_dropped == 0

    parts = list(iter_parts(server.requests[0]))
    assert all("inlineData" not in part for part in parts)
    assert frame.describe() in "".join(part["text"] for part in parts)


# --- usage
# --------------------------------------------------------------------------------------------------


async def test_token_usage_is_carried_into_the_response(
    server: GeminiServer, make_judge: Callable[..., GeminiJudge]
) -> None:
    server.queue(
        response(candidate(step({"C": 0.0})), prompt=1234, cached=1000, output=1),
        response(candidate(step({"D": 0.0})), prompt=1300, cached=1200, output=1, thoughts=7),
    )
    judge = make_judge()
    first = await judge.grade(JudgeRequest(prompt()))
    second = await judge.grade(JudgeRequest(prompt()))

    assert first.usage == Usage(input_tokens=1234, cached_input_tokens=1000, output_tokens=1)
    # thinking is output
    assert second.usage == Usage(input_tokens=1300, cached_input_tokens=1200, output_tokens=8)
    assert judge.usage == Usage(2534, 2200, 9)


# --- repeats
# --------------------------------------------------------------------------------------------------


async def test_k_repeats_go_as_one_request_with_candidate_count(
    server: GeminiServer, make_judge: Callable[..., GeminiJudge]
) -> None:
    server.queue(
        response(
            candidate(step({"C": 0.0}), index=0),
            candidate(step({"D": 0.0}), index=1),
            candidate(step({"E": 0.0}), index=2),
            output=3,
        )
    )
    judge = make_judge()
    resp = await judge.grade(JudgeRequest(prompt(), repeats=3))

    assert len(server.requests) == 1 and config(server.requests[0])["candidateCount"] == 3
    assert [distribution(s).top for s in resp.samples if s is not None] == ["C", "D", "E"]
    assert judge.supports_candidates is True


async def test_a_server_returning_one_candidate_gets_the_rest_as_separate_requests(
    server: GeminiServer, make_judge: Callable[..., GeminiJudge]
) -> None:
    server.queue(*(letter_reply({letter: 0.0}, prompt=10) for letter in "CDE"))
    judge = make_judge()
    resp = await judge.grade(JudgeRequest(prompt(), repeats=3))

    assert len(resp.samples) == 3 and all(s is not None for s in resp.samples)
    assert sorted(distribution(s).top for s in resp.samples if s is not None) == ["C", "D", "E"]
    assert [config(r)["candidateCount"] for r in server.requests] == [3, 1, 1]
    assert resp.usage.input_tokens == 30
    assert judge.supports_candidates is False

    # Remembered: the next call does not ask for several candidates again.
    server.queue(*(letter_reply({"F": 0.0}) for _ in range(3)))
    await judge.grade(JudgeRequest(prompt(), repeats=3))
    assert [config(r)["candidateCount"] for r in server.requests[3:]] == [1, 1, 1]


async def test_a_rejected_candidate_count_falls_back_to_separate_requests(
    server: GeminiServer, make_judge: Callable[..., GeminiJudge]
) -> None:
    server.queue(error(400, f"Multiple candidates is not enabled for models/{MODEL}"))
    server.queue(*(letter_reply({"C": 0.0}) for _ in range(3)))
    judge = make_judge()
    resp = await judge.grade(JudgeRequest(prompt(), repeats=3))

    assert len(resp.samples) == 3 and all(s is not None for s in resp.samples)
    assert [config(r)["candidateCount"] for r in server.requests] == [3, 1, 1, 1]
    assert judge.supports_candidates is False and resp.attempts == 1


# --- without logprobs: sampled answers
# -------------------------------------------------------------------------

# The scripted model's answer distribution: 10% of answers are not a letter at all.
TRUE = {"E": 0.3, "K": 0.4, "R": 0.2, "Sure": 0.1}
LETTER_P = {k: v / 0.9 for k, v in TRUE.items() if k in LETTERS}
TRUE_MEAN = sum(p * LETTERS.index(t) / 19 for t, p in LETTER_P.items())
TRUE_STD = math.sqrt(sum(p * (LETTERS.index(t) / 19 - TRUE_MEAN) ** 2 for t, p in LETTER_P.items()))


def sampler(seed: int, *, max_candidates: int = 8) -> Callable[[Any], Reply]:
    """Answers drawn from TRUE, `candidateCount` of them (at most `max_candidates`), as text
    without logprobs."""
    rng = random.Random(seed)
    tokens, weights = zip(*TRUE.items(), strict=True)

    def answer(body: Any) -> Reply:
        n = int(body["generationConfig"].get("candidateCount", 1))
        if n > max_candidates:
            return error(400, f"Multiple candidates is not enabled for models/{MODEL}")
        draws = rng.choices(tokens, weights, k=n)
        return response(
            *(
                text_candidate(t + ("." if i % 3 == 0 else ""), index=i)
                for i, t in enumerate(draws)
            ),
            output=n,
        )

    return answer


@pytest.mark.parametrize("k", [10, 100])
async def test_sampled_expectation_converges_within_the_stated_error(
    server: GeminiServer, make_judge: Callable[..., GeminiJudge], k: int
) -> None:
    server.default = sampler(seed=k)
    # A long timeout: a retried call (on a loaded machine) would send its draws again and break the
    # count.
    judge = make_judge(logprobs=False, samples=k, timeout_s=60.0, max_retries=0)
    t = AsyncProgressTracker("task", judge=judge, min_mass=0.5)
    p = await t.update("did a thing")
    assert p.ok and p.score is not None
    c = p.criteria["task_progress"]
    assert c.source == "sampled"
    assert c.mass == pytest.approx(0.9, abs=4 * math.sqrt(0.09 / k) + 1e-9)
    stated = TRUE_STD / math.sqrt(0.9 * k)
    assert c.sampling_error == pytest.approx(stated, rel=0.5)
    assert abs(p.score - TRUE_MEAN) <= 4 * stated  # within the stated sampling error
    assert p.uncertainty == pytest.approx(
        math.sqrt(c.dispersion**2 + c.sampling_error**2), rel=1e-6
    )
    cfgs = [config(r) for r in server.requests]
    # No logprobs asked for (a model without them refuses the request), sampled at temperature 1.
    assert all(
        "responseLogprobs" not in c and "logprobs" not in c and c["temperature"] == 1.0
        for c in cfgs
    )
    # Draws go 8 candidates per request, the API's limit.
    assert sorted(c["candidateCount"] for c in cfgs) == sorted(
        [8] * (k // 8) + ([k % 8] if k % 8 else [])
    )
    assert p.usage.output_tokens == k and p.usage.input_tokens == 100 * len(cfgs)


async def test_sampled_repeats_each_get_their_own_draws(
    server: GeminiServer, make_judge: Callable[..., GeminiJudge]
) -> None:
    server.default = sampler(seed=3)
    judge = make_judge(logprobs=False, samples=8, timeout_s=60.0, max_retries=0)
    resp = await judge.grade(JudgeRequest(prompt(), repeats=3))
    assert resp.draws == 8 and len(resp.samples) == 3
    assert [config(r)["candidateCount"] for r in server.requests] == [8, 8, 8]


async def test_a_model_refusing_several_candidates_is_sampled_one_answer_per_request(
    server: GeminiServer, make_judge: Callable[..., GeminiJudge]
) -> None:
    # Gemini 2.0 and 3 models: 400 for candidateCount > 1
    server.default = sampler(seed=1, max_candidates=1)
    judge = make_judge(logprobs=False, samples=6)
    t = AsyncProgressTracker("task", judge=judge, min_mass=0.1)
    p = await t.update("x")
    assert p.ok and p.criteria["task_progress"].source == "sampled"
    assert judge.supports_candidates is False
    counts = [config(r)["candidateCount"] for r in server.requests]
    assert counts == [6] + [1] * 6
    # Remembered: the next scoring asks one answer per request from the start.
    await t.update("y")
    assert [config(r)["candidateCount"] for r in server.requests[len(counts) :]] == [1] * 6


async def test_sampled_answers_that_are_never_letters_fail_loudly(
    server: GeminiServer, make_judge: Callable[..., GeminiJudge]
) -> None:
    server.default = lambda body: response(
        *(
            text_candidate("The answer is K", index=i)
            for i in range(body["generationConfig"]["candidateCount"])
        )
    )
    t = AsyncProgressTracker("task", judge=make_judge(logprobs=False, samples=5))
    p = await t.update("x")
    assert not p.ok and p.score is None and p.reason == "no_letter"


async def test_sampled_reads_the_answer_not_the_thoughts(
    server: GeminiServer, make_judge: Callable[..., GeminiJudge]
) -> None:
    thinking = {
        "content": {
            "role": "model",
            "parts": [{"text": "Probably Q", "thought": True}, {"text": "C"}],
        },
        "finishReason": "STOP",
        "index": 0,
    }
    server.queue(response(thinking))
    resp = await make_judge(logprobs=False, samples=1).grade(JudgeRequest(prompt()))
    assert resp.samples == ({"C": 0.0},)


# --- errors and retries
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hint",
    [
        {"headers": {"Retry-After": "0.2"}},
        {"details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "0.2s"}]},
    ],
    ids=["retry-after-header", "retry-info-body"],
)
async def test_429_honours_the_servers_wait_hint_then_succeeds(
    server: GeminiServer, make_judge: Callable[..., GeminiJudge], hint: dict[str, Any]
) -> None:
    server.queue(
        error(429, "Resource has been exhausted (e.g. check quota).", **hint),
        letter_reply({"C": 0.0}),
    )
    judge = make_judge(max_retries=2, backoff_s=0.001)
    resp = await judge.grade(JudgeRequest(prompt()))

    assert resp.attempts == 2 and resp.samples[0] is not None
    first, second = server.requests
    assert second.at - first.at >= 0.2


async def test_repeated_5xx_fails_after_max_retries_with_no_sdk_retries(
    server: GeminiServer, make_judge: Callable[..., GeminiJudge]
) -> None:
    server.default = error(500, "An internal error has occurred.")
    judge = make_judge(max_retries=2)
    with pytest.raises(JudgeError) as exc:
        await judge.grade(JudgeRequest(prompt()))

    assert exc.value.reason == "server_error" and exc.value.retryable
    assert "HTTP 500" in str(exc.value) and "internal error" in str(exc.value)
    assert len(server.requests) == 3
    assert (judge.calls, judge.failures) == (1, 1)


async def test_an_injected_client_with_its_own_retries_still_gets_none(
    server: GeminiServer, make_judge: Callable[..., GeminiJudge]
) -> None:
    server.default = error(503, "The model is overloaded.")
    client = genai.Client(
        api_key="test",
        http_options=types.HttpOptions(
            base_url=server.url, retry_options=types.HttpRetryOptions(attempts=5)
        ),
    )
    try:
        judge = make_judge(client=client, max_retries=1)
        with pytest.raises(JudgeError) as exc:
            await judge.grade(JudgeRequest(prompt()))
        assert exc.value.reason == "server_error"
        assert len(server.requests) == 2  # BaseJudge's two attempts; the SDK added none
        await judge.aclose()  # leaves the caller's client open
        server.queue(letter_reply({"C": 0.0}))
        resp = await client.aio.models.generate_content(model=MODEL, contents="still open?")
        assert resp.candidates
    finally:
        await client.aio.aclose()


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        (error(401, "Request had invalid authentication credentials."), "auth"),
        (error(403, "Permission denied."), "auth"),
        (
            error(
                400,
                "API key not valid. Please pass a valid API key.",
                details=[{"reason": "API_KEY_INVALID"}],
            ),
            "auth",
        ),
        (error(404, f"models/{MODEL} is not found for API version v1beta"), "not_found"),
        (error(400, "Invalid value at 'generation_config.logprobs'"), "bad_request"),
    ],
    ids=["401", "403", "400-bad-key", "404", "400"],
)
async def test_client_errors_are_not_retried(
    server: GeminiServer, make_judge: Callable[..., GeminiJudge], reply: Reply, reason: str
) -> None:
    server.queue(reply)
    with pytest.raises(JudgeError) as exc:
        await make_judge(max_retries=3).grade(JudgeRequest(prompt()))
    assert exc.value.reason == reason and not exc.value.retryable
    assert len(server.requests) == 1


async def test_a_slow_server_times_out(
    server: GeminiServer, make_judge: Callable[..., GeminiJudge]
) -> None:
    server.queue(Reply(letter_reply({"C": 0.0}).body, delay_s=3.0))
    judge = make_judge(timeout_s=0.3, max_retries=0)
    start = time.perf_counter()
    with pytest.raises(JudgeError) as exc:
        await judge.grade(JudgeRequest(prompt()))
    assert exc.value.reason == "timeout" and exc.value.retryable
    assert time.perf_counter() - start < 2.0


async def test_an_unreachable_server_is_a_connection_error(
    make_judge: Callable[..., GeminiJudge],
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed on exit: nothing listens there
    judge = make_judge(base_url=f"http://127.0.0.1:{port}", max_retries=1)
    with pytest.raises(JudgeError) as exc:
        await judge.grade(JudgeRequest(prompt()))
    assert exc.value.reason == "connection" and exc.value.retryable


# --- construction
# ---------------------------------------------------------------------------------------------


def test_no_api_key_names_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("GEMINI_API_KEY", "GOOGLE_API_KEY", "GOOGLE_GENAI_USE_VERTEXAI"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=r"api_key=.*GEMINI_API_KEY"):
        GeminiJudge()


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="top_logprobs"):
        GeminiJudge(api_key="test", top_logprobs=21)
    with pytest.raises(ValueError, match="max_output_tokens"):
        GeminiJudge(api_key="test", max_output_tokens=0)
    with pytest.raises(ValueError, match="samples=0"):
        GeminiJudge(api_key="test", logprobs=False, samples=0)

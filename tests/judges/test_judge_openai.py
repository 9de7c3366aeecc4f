"""OpenAIJudge against a real HTTP server speaking the OpenAI protocol, with scripted logprobs."""

import time
from collections.abc import Iterator

import pytest

from agent_monitor import (
    AsyncProgressTracker,
    JudgeError,
    JudgeRequest,
    OpenAIJudge,
    load_criteria,
    load_image,
)
from agent_monitor.prompts import Step, build_prompt
from agent_monitor.scale import distribution
from tests.openai_server import (
    Reply,
    ScriptedServer,
    chat_choice,
    chat_reply,
    completion_reply,
    html_server,
    scripted_server,
)


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    with scripted_server() as s:
        yield s


def prompt(n: int = 2):  # type: ignore[no-untyped-def]
    rubric = load_criteria(None)
    steps = [Step(i, f"step {i}: ran tests") for i in range(1, n + 1)]
    return build_prompt("Fix the failing test.", rubric, steps, rubric.criteria[0])


LETTER_DIST = {"C": 0.5, "E": 0.25, " e": 0.25}
EXPECTED = 0.5 * 2 / 19 + 0.5 * 4 / 19


async def test_chat_exact_logprobs_to_exact_score_and_request_shape(server: ScriptedServer) -> None:
    server.add(chat_reply(chat_choice([("C", LETTER_DIST)]), prompt_tokens=321, cached=300))
    judge = OpenAIJudge(base_url=server.url)
    resp = await judge.grade(JudgeRequest(prompt()))
    assert resp.model == "scripted-model"  # read from /v1/models
    d = distribution(resp.samples[0])  # type: ignore[arg-type]
    assert d.expectation == pytest.approx(EXPECTED)
    assert (
        resp.usage.input_tokens == 321
        and resp.usage.cached_input_tokens == 300
        and resp.usage.output_tokens == 1
    )
    req = server.requests[0]
    assert req["max_tokens"] == 1 and req["logprobs"] is True and req["top_logprobs"] == 20
    assert req["temperature"] == 0.0 and "n" not in req
    assert (
        req["messages"][0]["role"] == "system"
        and "20-letter scale" in req["messages"][0]["content"]
    )
    assert "### Step 2\nstep 2: ran tests" in req["messages"][1]["content"]
    await judge.aclose()


async def test_tracker_end_to_end_scores_from_server(server: ScriptedServer) -> None:
    server.default = chat_reply(chat_choice([("C", LETTER_DIST)]))
    judge = OpenAIJudge(base_url=server.url, model="given-model")
    t = AsyncProgressTracker("Fix the failing test.", judge=judge)
    p = await t.update("ran pytest: 3 failed")
    assert p.ok and p.score == pytest.approx(EXPECTED) and p.model == "given-model"
    assert p.rubric == t.rubric.hash and p.step == 1 and p.error is None
    assert server.requests[0]["model"] == "given-model"
    await judge.aclose()


async def test_first_letter_token_is_read_not_the_first_character(server: ScriptedServer) -> None:
    # "The" first, then " K": the reader skips "The" (it is not the letter T) and reads at " K".
    server.add(
        chat_reply(chat_choice([("The", {"The": 0.9, "T": 0.1}), (" K", {" K": 0.8, " L": 0.2})]))
    )
    judge = OpenAIJudge(base_url=server.url, model="m", max_tokens=4)
    resp = await judge.grade(JudgeRequest(prompt()))
    d = distribution(resp.samples[0])  # type: ignore[arg-type]
    assert d.expectation == pytest.approx(0.8 * 10 / 19 + 0.2 * 11 / 19)
    assert server.requests[0]["max_tokens"] == 4


async def test_answer_without_letters_is_a_failure_not_half(server: ScriptedServer) -> None:
    server.default = chat_reply(chat_choice([("The", {"The": 0.7, "One": 0.2, "Based": 0.1})]))
    judge = OpenAIJudge(base_url=server.url, model="m")
    t = AsyncProgressTracker("task", judge=judge)
    p = await t.update("did something")
    assert not p.ok and p.score is None and p.reason == "no_letter"
    assert "scale letter" in (p.error or "")
    # Letters with a sliver of mass are not a score either.
    server.default = chat_reply(chat_choice([("The", {"The": 0.94, " B": 0.03, " S": 0.03})]))
    p2 = await t.update("did more")
    assert not p2.ok and p2.score is None and p2.reason == "low_mass"


async def test_missing_logprobs_is_a_failure(server: ScriptedServer) -> None:
    server.default = Reply(
        body={
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "K"},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
        }
    )
    t = AsyncProgressTracker("task", judge=OpenAIJudge(base_url=server.url, model="m"))
    p = await t.update("x")
    # A failed judge call naming the fix (not a passing "no answer" the judge call counted as ok).
    assert not p.ok and p.reason == "no_logprobs" and p.score is None
    assert "--max-logprobs 20" in (p.error or "") and "--judge-sampled" in (p.error or "")


async def test_429_then_success_honours_retry_after(server: ScriptedServer) -> None:
    server.add(
        Reply(
            429, {"error": {"message": "slow down", "type": "rate_limit"}}, {"Retry-After": "0.3"}
        ),
        chat_reply(chat_choice([("C", LETTER_DIST)])),
    )
    judge = OpenAIJudge(base_url=server.url, model="m", backoff_s=0.001)
    resp = await judge.grade(JudgeRequest(prompt()))
    assert resp.attempts == 2 and len(server.requests) == 2
    # waited for the server's hint, not the 1 ms backoff
    assert server.times[1] - server.times[0] >= 0.29
    assert distribution(resp.samples[0]).expectation == pytest.approx(EXPECTED)  # type: ignore[arg-type]


async def test_persistent_500_fails_after_bounded_retries(server: ScriptedServer) -> None:
    server.default = Reply(500, {"error": {"message": "boom"}})
    judge = OpenAIJudge(base_url=server.url, model="m", max_retries=2, backoff_s=0.001)
    with pytest.raises(JudgeError) as e:
        await judge.grade(JudgeRequest(prompt()))
    assert e.value.reason == "server_error" and len(server.requests) == 3
    t = AsyncProgressTracker("task", judge=judge)
    p = await t.update("x")
    assert (
        not p.ok
        and p.score is None
        and p.reason == "server_error"
        and "HTTP 500" in (p.error or "")
    )
    assert judge.failures == 2


async def test_400_is_not_retried(server: ScriptedServer) -> None:
    server.default = Reply(400, {"error": {"message": "logprobs not supported"}})
    judge = OpenAIJudge(base_url=server.url, model="m", backoff_s=0.001)
    with pytest.raises(JudgeError) as e:
        await judge.grade(JudgeRequest(prompt()))
    assert e.value.reason == "bad_request" and len(server.requests) == 1
    assert "logprobs not supported" in str(e.value)


async def test_timeout_is_a_retryable_failure(server: ScriptedServer) -> None:
    server.default = Reply(delay_s=1.0, body=chat_reply(chat_choice([("C", LETTER_DIST)])).body)
    judge = OpenAIJudge(
        base_url=server.url, model="m", timeout_s=0.2, max_retries=1, backoff_s=0.001
    )
    t0 = time.monotonic()
    with pytest.raises(JudgeError) as e:
        await judge.grade(JudgeRequest(prompt()))
    assert e.value.reason == "timeout"
    assert len(server.requests) == 2 and time.monotonic() - t0 < 1.5


async def test_connection_refused_is_a_connection_failure_naming_the_url() -> None:
    judge = OpenAIJudge(base_url="http://127.0.0.1:9/v1", model="m", max_retries=1, backoff_s=0.001)
    with pytest.raises(JudgeError) as e:
        await judge.grade(JudgeRequest(prompt()))
    assert e.value.reason == "connection" and e.value.retryable
    assert "cannot reach the judge server at http://127.0.0.1:9/v1 " in str(e.value)
    # The hook reports it with the URL, as the user's code would see it.
    p = await AsyncProgressTracker("t", judge=judge).update("s1")
    assert not p.ok and p.reason == "connection" and "http://127.0.0.1:9/v1" in (p.error or "")
    await judge.aclose()


@pytest.mark.parametrize("api", ["chat", "completions"])
async def test_a_web_page_instead_of_an_openai_server_is_a_clear_bad_response(api: str) -> None:
    with html_server() as url:
        judge = OpenAIJudge(base_url=url, model="m", api=api, max_retries=2, backoff_s=0.001)  # type: ignore[arg-type]
        with pytest.raises(JudgeError) as e:
            await judge.grade(JudgeRequest(prompt()))
        unprobed = OpenAIJudge(base_url=url)
        with pytest.raises(JudgeError) as listed:
            await unprobed.resolve_model()
        p = await AsyncProgressTracker("t", judge=unprobed).update("s1")
        await judge.aclose()
        await unprobed.aclose()
    path = "chat/completions" if api == "chat" else "completions"
    for err in (e.value, listed.value):
        # the same page comes back every time
        assert err.reason == "bad_response" and not err.retryable
        assert "answered HTTP 200 text/html '<html>hello</html>'" in str(err)
        assert f"{url} does not look like an OpenAI-compatible server" in str(err)
        assert "check base_url (it usually ends in /v1)" in str(err)
    assert f"{url}/{path} answered" in str(e.value) and f"{url}/models answered" in str(
        listed.value
    )
    assert judge.calls == 1  # not retried
    assert not p.ok and p.reason == "bad_response" and url in (p.error or "")


async def test_json_that_is_not_a_completion_is_a_bad_response(server: ScriptedServer) -> None:
    judge = OpenAIJudge(base_url=server.url, model="m")
    server.add(Reply(200, {"detail": "welcome"}), Reply(200, {"choices": [1, 2]}))
    with pytest.raises(
        JudgeError,
        match=r"without a `choices` list\): .* does not look like " r"an OpenAI-compatible",
    ):
        await judge.grade(JudgeRequest(prompt()))
    with pytest.raises(JudgeError, match="choices of an unexpected shape") as e:
        await judge.grade(JudgeRequest(prompt()))
    assert e.value.reason == "bad_response"
    server.models = ()
    with pytest.raises(JudgeError, match="lists no model; pass model="):
        await OpenAIJudge(base_url=server.url).resolve_model()
    await judge.aclose()


async def test_repeats_use_n_and_fall_back_when_server_ignores_it(server: ScriptedServer) -> None:
    dists = [{"A": 1.0}, {"K": 1.0}, {"T": 1.0}]
    server.add(chat_reply(*(chat_choice([(next(iter(d)), d)], i) for i, d in enumerate(dists))))
    judge = OpenAIJudge(base_url=server.url, model="m")
    resp = await judge.grade(JudgeRequest(prompt(), repeats=3))
    assert server.requests[0]["n"] == 3 and len(resp.samples) == 3 and judge.supports_n is True
    # A server that returns one choice whatever n says: the rest come from separate requests.
    server.requests.clear()
    server.add(*(chat_reply(chat_choice([(next(iter(d)), d)])) for d in dists))
    judge2 = OpenAIJudge(base_url=server.url, model="m")
    t = AsyncProgressTracker("task", judge=judge2, repeats=3)
    p = await t.update("x")
    assert len(server.requests) == 3 and judge2.supports_n is False
    assert p.ok and p.score == pytest.approx((0 + 10 / 19 + 1) / 3)
    c = p.criteria["task_progress"]
    assert c.repeats == 3 and c.spread > 0.3


async def test_completions_api_for_models_without_chat_template(server: ScriptedServer) -> None:
    server.add(completion_reply([{" C": 0.5, " E": 0.3, "E": 0.2}]))
    judge = OpenAIJudge(base_url=server.url, model="m", api="completions")
    resp = await judge.grade(JudgeRequest(prompt()))
    assert server.paths[0].endswith("/completions") and not server.paths[0].endswith(
        "chat/completions"
    )
    req = server.requests[0]
    assert req["logprobs"] == 20 and req["max_tokens"] == 1 and req["prompt"].endswith("Answer:")
    assert distribution(resp.samples[0]).expectation == pytest.approx(EXPECTED)  # type: ignore[arg-type]


async def test_vllm_prefill_and_constrained_choice(server: ScriptedServer) -> None:
    server.add(chat_reply(chat_choice([("C", LETTER_DIST)])))
    judge = OpenAIJudge(base_url=server.url, model="m", prefill="Progress letter: ", constrain=True)
    await judge.grade(JudgeRequest(prompt()))
    req = server.requests[0]
    assert req["messages"][-1] == {"role": "assistant", "content": "Progress letter: "}
    assert req["continue_final_message"] is True and req["add_generation_prompt"] is False
    assert req["guided_choice"] == list("ABCDEFGHIJKLMNOPQRST")


async def test_images_are_sent_as_data_urls_after_their_step(
    server: ScriptedServer, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    from PIL import Image

    path = tmp_path / "frame.png"
    Image.new("RGB", (64, 48), (200, 10, 10)).save(path)
    server.default = chat_reply(chat_choice([("C", LETTER_DIST)]))
    judge = OpenAIJudge(base_url=server.url, model="m")
    t = AsyncProgressTracker("Pick up the red block.", judge=judge)
    p = await t.update("moved gripper over the block", images=[path])
    assert p.ok
    content = server.requests[0]["messages"][1]["content"]
    kinds = [c["type"] for c in content]
    assert "image_url" in kinds
    i = kinds.index("image_url")
    assert content[i - 1]["text"].rstrip().endswith("moved gripper over the block")
    assert content[i]["image_url"]["url"].startswith("data:image/png;base64,")
    frame = load_image(path)
    assert t.steps[0].frames[0].digest == frame.digest  # loaded once, kept in memory


async def test_text_only_judge_gets_image_placeholders(server: ScriptedServer) -> None:
    from PIL import Image

    server.default = chat_reply(chat_choice([("C", LETTER_DIST)]))
    t = AsyncProgressTracker(
        "task", judge=OpenAIJudge(base_url=server.url, model="m", vision=False)
    )
    await t.update("look", images=[Image.new("RGB", (8, 8))])
    content = server.requests[0]["messages"][1]["content"]
    assert isinstance(content, str) and "[image 8x8 image/png" in content


async def test_wrong_key_and_wrong_url_get_clear_reasons(server: ScriptedServer) -> None:
    server.add(
        Reply(401, {"error": {"message": "bad key"}}),
        Reply(404, {"error": {"message": "no route"}}),
    )
    judge = OpenAIJudge(base_url=server.url, model="m")
    with pytest.raises(JudgeError, match="refused the API key"):
        await judge.grade(JudgeRequest(prompt()))
    with pytest.raises(JudgeError, match="check base_url"):
        await judge.grade(JudgeRequest(prompt()))


async def test_concurrency_limit_is_shared_by_trackers(server: ScriptedServer) -> None:
    import asyncio
    import threading

    active = 0
    peak = 0
    lock = threading.Lock()

    def slow(body):  # type: ignore[no-untyped-def]
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        time.sleep(0.05)
        with lock:
            active -= 1
        return chat_reply(chat_choice([("C", LETTER_DIST)]))

    server.default = slow
    judge = OpenAIJudge(base_url=server.url, model="m", concurrency=2)
    trackers = [AsyncProgressTracker(f"task {i}", judge=judge) for i in range(6)]
    results = await asyncio.gather(*(t.update("step") for t in trackers))
    assert all(p.ok for p in results) and len(server.requests) == 6
    assert peak == 2


async def test_server_refusing_n_gets_single_requests(server: ScriptedServer) -> None:
    def answer(body):  # type: ignore[no-untyped-def]
        if body.get("n", 1) > 1:
            return Reply(400, {"error": {"message": "n > 1 is not supported"}})
        return chat_reply(chat_choice([("K", {"K": 1.0})]))

    server.default = answer
    judge = OpenAIJudge(base_url=server.url, model="m")
    resp = await judge.grade(JudgeRequest(prompt(), repeats=2))
    assert len(resp.samples) == 2 and judge.supports_n is False
    assert [r.get("n", 1) for r in server.requests] == [2, 1, 1]
    await judge.grade(JudgeRequest(prompt(), repeats=2))
    # remembered: no batch asked again
    assert [r.get("n", 1) for r in server.requests][3:] == [1, 1]


async def test_text_only_server_refusing_images_gets_placeholders_for_a_while(
    server: ScriptedServer,
) -> None:
    from PIL import Image

    def answer(body):  # type: ignore[no-untyped-def]
        # what llama_cpp.server does without a vision model
        if isinstance(body["messages"][1]["content"], list):
            return Reply(
                500, {"error": {"message": 'can only concatenate str (not "list") to str'}}
            )
        return chat_reply(chat_choice([("C", LETTER_DIST)]))

    server.default = answer
    judge = OpenAIJudge(base_url=server.url, model="m", backoff_s=0.001)
    t = AsyncProgressTracker("task", judge=judge)
    p = await t.update("look", images=[Image.new("RGB", (8, 8))])
    assert p.ok and p.images_dropped == 1 and not judge.sends_images("m")
    assert [type(r["messages"][1]["content"]).__name__ for r in server.requests] == ["list", "str"]
    await t.update("again", images=[Image.new("RGB", (8, 8))])
    assert type(server.requests[-1]["messages"][1]["content"]) is str and len(server.requests) == 3
    # Asked for explicitly, images are never dropped: the refusal is the caller's failure to see.
    strict = AsyncProgressTracker(
        "task", judge=OpenAIJudge(base_url=server.url, model="m", vision=True)
    )
    q = await strict.update("look", images=[Image.new("RGB", (8, 8))])
    # not retried: it cannot help
    assert not q.ok and q.reason == "bad_request" and len(server.requests) == 4


async def test_run_key_goes_hashed_in_the_named_field_and_nowhere_by_default(
    server: ScriptedServer,
) -> None:
    from agent_monitor.judges.openai import run_hint

    server.default = chat_reply(chat_choice([("K", {"K": 0.9})]))
    async with OpenAIJudge(base_url=server.url, run_key_field="user") as judge:
        await judge.grade(JudgeRequest(prompt(), run_key="run-7"))
        await judge.grade(JudgeRequest(prompt(3), run_key="run-7"))
        await judge.grade(JudgeRequest(prompt()))  # no key: no field
    assert [r.get("user") for r in server.requests] == [run_hint("run-7"), run_hint("run-7"), None]
    assert "run-7" not in str(server.requests) and len(run_hint("run-7")) == 32
    async with OpenAIJudge(base_url=server.url) as judge:  # "auto": a local server gets no hint
        assert judge.run_key_field is None
        await judge.grade(JudgeRequest(prompt(), run_key="run-7"))
    assert not {"user", "prompt_cache_key"} & set(server.requests[-1])
    # Hosted OpenAI's chat API takes it as prompt_cache_key (no request made here: no key needed to
    # build one).
    assert OpenAIJudge(api_key="unused").run_key_field == "prompt_cache_key"
    assert OpenAIJudge(api_key="unused", api="completions").run_key_field is None
    with pytest.raises(ValueError, match="run_key_field"):
        OpenAIJudge(base_url=server.url, run_key_field="not a field")

"""When the judge sees the frames: images go off only when the server says the model takes none, per
model, for a while.

The real `openai` SDK talks to the scripted server of tests/openai_server.py; the refusals are the
messages real servers send (see `refuses_images`).
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from typing import Any

import pytest
from PIL import Image
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from agent_monitor import AsyncProgressTracker, JudgeError, JudgeRequest, OpenAIJudge
from agent_monitor.daemon import Monitor, MonitorConfig
from agent_monitor.images import Frame, load_image
from agent_monitor.judges.openai import refuses_images
from agent_monitor.prompts import ImagePart, Prompt, TextPart
from tests.openai_server import (
    Reply,
    ScriptedServer,
    chat_choice,
    chat_reply,
    completion_reply,
    scripted_server,
)

LETTER = chat_reply(chat_choice([("K", {"K": 1.0})]))
# vLLM serving a text-only model (studio-dots-ai/dots.ocr#61).
NOT_MULTIMODAL = Reply(
    400,
    {
        "object": "error",
        "message": "facebook/opt-125m is not a multimodal model None",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    },
)
# llama.cpp's llama-server started without --mmproj: a std::runtime_error, answered as 500.
NO_MMPROJ = Reply(
    500,
    {
        "error": {
            "code": 500,
            "message": "image input is not supported - hint: if this is unexpected, you may "
            "need to provide the mmproj",
            "type": "server_error",
        }
    },
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    with scripted_server() as s:
        yield s


def frame(i: int) -> Frame:
    return load_image(Image.new("RGB", (8, 8), (i * 40 % 256, 10, 10)))


def frames_prompt(n: int) -> Prompt:
    """A prompt with `n` image parts."""
    return Prompt(
        instructions="Grade.",
        prefix=(TextPart("### Step 1\nlooked\n"), *(ImagePart(frame(i)) for i in range(n))),
        tail=(TextPart("## Question\n"),),
        criterion="c",
        step=1,
    )


def images_sent(body: dict[str, Any]) -> int:
    content = body["messages"][1]["content"]
    return sum(p.get("type") == "image_url" for p in content) if isinstance(content, list) else 0


def refusing(refusal: Reply, *, models: tuple[str, ...] | None = None) -> Any:
    """A server answer: `refusal` for a request with images (for `models`, or any), else a
    letter."""

    def answer(body: dict[str, Any]) -> Reply:
        if images_sent(body) and (models is None or body["model"] in models):
            return refusal
        return LETTER

    return answer


@pytest.mark.parametrize(
    ("status", "message"),
    [
        (400, "Invalid content type. image_url is only supported by certain models."),  # OpenAI
        (400, "facebook/opt-125m is not a multimodal model None"),  # vLLM, text-only model
        # vLLM, --limit-mm-per-prompt image=0
        (400, "At most 0 image(s) may be provided in one prompt."),
        (500, NO_MMPROJ.body["error"]["message"]),  # llama-server without --mmproj
        (500, 'can only concatenate str (not "list") to str'),  # llama_cpp.server, text chat format
        (400, "This model does not support image input"),
        (422, "Images are not supported for this model"),
    ],
)
def test_refusals_of_images_are_recognised(status: int, message: str) -> None:
    assert refuses_images(status, message)


@pytest.mark.parametrize(
    ("status", "message"),
    [
        (503, "image input is not supported"),  # overload statuses never mean "no images"
        (502, "Bad gateway"),
        (504, "upstream timed out"),
        (429, "This model does not support images at this rate"),
        (408, "request timeout"),
        # a crash on a request with images says nothing about vision
        (500, "CUDA error: out of memory"),
        (400, "At most 1 image(s) may be provided in one prompt."),  # too many images, not none
        (400, "Invalid image: cannot identify image file"),
        (400, "This model's maximum context length is 4096 tokens."),
    ],
)
def test_other_errors_are_not_refusals_of_images(status: int, message: str) -> None:
    assert not refuses_images(status, message)


@pytest.mark.parametrize(
    "failure", [Reply(500, {"error": {"message": "CUDA error: out of memory"}}), Reply(503, {})]
)
async def test_a_5xx_on_a_request_with_images_is_retried_with_them_and_turns_nothing_off(
    server: ScriptedServer, failure: Reply
) -> None:
    server.add(failure)
    server.default = LETTER
    judge = OpenAIJudge(base_url=server.url, model="m", backoff_s=0.001)  # default retries
    resp = await judge.grade(JudgeRequest(frames_prompt(2)))
    assert resp.attempts == 2 and resp.images_dropped == 0
    assert [images_sent(b) for b in server.requests] == [2, 2]  # retried with its images
    again = await judge.grade(JudgeRequest(frames_prompt(2)))
    assert (
        again.images_dropped == 0
        and images_sent(server.requests[-1]) == 2
        and judge.sends_images("m")
    )
    await judge.aclose()


async def test_a_model_that_refuses_images_gets_placeholders_until_the_cool_down_then_is_asked_again(  # noqa: E501 (the test's name is its sentence)
    server: ScriptedServer,
) -> None:
    server.default = refusing(NOT_MULTIMODAL)
    clock = Clock()
    judge = OpenAIJudge(
        base_url=server.url, model="m", clock=clock, vision_retry_s=600, backoff_s=0.001
    )
    t = AsyncProgressTracker("Stack the blocks.", judge=judge)
    with capture_logs() as logs:
        p = await t.update(
            "looked at the table", images=[Image.new("RGB", (8, 8)), Image.new("RGB", (6, 6))]
        )
    # Refused, resent at once with placeholders: a score, which says it was computed without 2
    # frames.
    assert p.ok and p.images_dropped == 2
    assert [images_sent(b) for b in server.requests] == [2, 0]
    assert "[image 8x8 image/png" in server.requests[1]["messages"][1]["content"]
    (warning,) = [e for e in logs if e["event"] == "judge_refuses_images"]
    assert (
        warning["log_level"] == "warning"
        and warning["model"] == "m"
        and warning["retry_in_s"] == 600
    )
    assert warning["error"] == "facebook/opt-125m is not a multimodal model None"
    # During the cool-down, no request for this model carries images: one request per call, counted.
    clock.t += 599
    resp = await judge.grade(JudgeRequest(frames_prompt(3)))
    assert resp.images_dropped == 3 and [images_sent(b) for b in server.requests[2:]] == [0]
    # After it, images are tried again; refused again, they are off for another cool-down.
    clock.t += 1
    resp = await judge.grade(JudgeRequest(frames_prompt(3)))
    assert resp.images_dropped == 3 and [images_sent(b) for b in server.requests[3:]] == [3, 0]
    clock.t += 599
    await judge.grade(JudgeRequest(frames_prompt(1)))
    assert images_sent(server.requests[-1]) == 0
    # The server got a vision model meanwhile: after the next cool-down the frames are seen again,
    # and stay so.
    server.default = LETTER
    clock.t += 1
    resp = await judge.grade(JudgeRequest(frames_prompt(2)))
    assert resp.images_dropped == 0 and images_sent(server.requests[-1]) == 2
    p = await t.update("stacked one", images=[Image.new("RGB", (8, 8))])
    assert p.ok and p.images_dropped == 0 and images_sent(server.requests[-1]) > 0
    await judge.aclose()


async def test_images_are_turned_off_per_model_and_per_judge(server: ScriptedServer) -> None:
    server.default = refusing(NOT_MULTIMODAL, models=("text-model",))
    judge = OpenAIJudge(base_url=server.url, model="text-model")
    assert (await judge.grade(JudgeRequest(frames_prompt(2)))).images_dropped == 2
    assert not judge.sends_images("text-model") and judge.sends_images("vision-model")
    judge.model = "vision-model"  # the same judge pointed at another model
    assert (await judge.grade(JudgeRequest(frames_prompt(2)))).images_dropped == 0
    assert images_sent(server.requests[-1]) == 2
    judge.model = "text-model"
    assert (await judge.grade(JudgeRequest(frames_prompt(2)))).images_dropped == 2
    assert images_sent(server.requests[-1]) == 0  # still cooling down: not asked again
    # Another judge on the same model has learnt nothing from this one: it tries images first.
    other = OpenAIJudge(base_url=server.url, model="text-model")
    before = len(server.requests)
    assert (await other.grade(JudgeRequest(frames_prompt(1)))).images_dropped == 1
    assert [images_sent(b) for b in server.requests[before:]] == [1, 0]
    await judge.aclose()
    await other.aclose()


async def test_explicit_vision_never_falls_back_and_no_vision_never_sends_images(
    server: ScriptedServer,
) -> None:
    server.default = refusing(NO_MMPROJ)
    strict = OpenAIJudge(base_url=server.url, model="m", vision=True, backoff_s=0.001)
    with pytest.raises(JudgeError) as e:
        await strict.grade(JudgeRequest(frames_prompt(1)))
    # A refusal is the request's fault: not retried (a 500 otherwise would be), and it says what to
    # do.
    assert (
        e.value.reason == "bad_request" and not e.value.retryable and "vision model" in str(e.value)
    )
    assert len(server.requests) == 1 and strict.sends_images("m")
    t = AsyncProgressTracker("task", judge=strict)
    q = await t.update("look", images=[Image.new("RGB", (8, 8))])
    assert not q.ok and q.reason == "bad_request"

    blind = OpenAIJudge(base_url=server.url, model="m", vision=False)
    before = len(server.requests)
    resp = await blind.grade(JudgeRequest(frames_prompt(2)))
    assert resp.images_dropped == 2 and [images_sent(b) for b in server.requests[before:]] == [0]
    await strict.aclose()
    await blind.aclose()


async def test_the_completions_api_counts_the_frames_it_cannot_send(server: ScriptedServer) -> None:
    server.default = completion_reply([{"K": 1.0}])
    judge = OpenAIJudge(base_url=server.url, model="m", api="completions")
    resp = await judge.grade(JudgeRequest(frames_prompt(2)))
    assert resp.images_dropped == 2 and "[image 8x8 image/png" in server.requests[0]["prompt"]
    assert (await judge.grade(JudgeRequest(frames_prompt(0)))).images_dropped == 0
    await judge.aclose()


async def test_the_daemon_publishes_and_counts_the_frames_the_judge_did_not_see(
    server: ScriptedServer,
) -> None:
    server.default = refusing(NOT_MULTIMODAL)
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (0, 200, 0)).save(buf, format="PNG")
    png = base64.b64encode(buf.getvalue()).decode()
    reg = CollectorRegistry()
    judge = OpenAIJudge(base_url=server.url, model="m", backoff_s=0.001)
    async with Monitor(MonitorConfig(), judge=judge, registry=reg) as mon:
        assert reg.get_sample_value("agent_monitor_images_dropped_total") == 0
        await mon.handle("agents/r/start", json.dumps({"task": "stack"}).encode())
        await mon.handle(
            "agents/r/step", json.dumps({"index": 1, "text": "a", "images": [png]}).encode()
        )
        await mon.drain()
        await mon.handle("agents/r/step", json.dumps({"index": 2, "text": "b"}).encode())
        await mon.drain()
        published = []
        while (m := mon.outbox.get_nowait()) is not None:
            if m.topic.endswith("/progress"):
                published.append(json.loads(m.payload))
    # Step 1's frame is in both prompts (anchor after its step); the judge saw it in neither.
    assert [(p["step"], p["ok"], p["images_dropped"]) for p in published] == [
        (1, True, 1),
        (2, True, 1),
    ]
    assert reg.get_sample_value("agent_monitor_images_dropped_total") == 2
    await judge.aclose()

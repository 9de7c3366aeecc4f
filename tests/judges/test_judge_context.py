"""A judge's context: read from the server or a setting, learned from a context-length refusal,
never exceeded again.

Against a real HTTP server (tests/openai_server.py's scripted server) answering as vLLM, llama.cpp's
llama-server, OpenAI and Anthropic answer; requests are counted on the server's side.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent_monitor import AsyncProgressTracker, JudgeError, JudgeRequest, OpenAIJudge, load_criteria
from agent_monitor._runtime.tokens import estimate_tokens
from agent_monitor.daemon import Monitor, MonitorConfig
from agent_monitor.judges.circuit import CircuitJudge
from agent_monitor.prompts import Prompt, Step, build_prompt
from tests.openai_server import Reply, ScriptedServer, chat_choice, chat_reply, scripted_server

RUBRIC = load_criteria(None)


def prompt(chars: int) -> Prompt:
    """A prompt with one step of about `chars` characters."""
    return build_prompt("Fix the failing test.", RUBRIC, [Step(1, "x" * chars)], RUBRIC.criteria[0])


def ok() -> Reply:
    return chat_reply(chat_choice([("K", {"K": 1.0})]))


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    with scripted_server() as s:
        yield s


# -- from the server, or a setting --


async def test_context_is_read_from_vllm_s_models_entry() -> None:
    with scripted_server(model_info={"max_model_len": 8192, "root": "m"}) as s:
        # the model is read from /v1/models, and its context with it
        judge = OpenAIJudge(base_url=s.url)
        try:
            assert judge.context_tokens is None
            await judge.resolve_model()
            assert judge.context_tokens == 8192
            assert "/props" not in s.gets  # /v1/models said it: nothing more asked
        finally:
            await judge.aclose()
        # the model given: the context is still read
        given = OpenAIJudge(base_url=s.url, model="scripted-model")
        try:
            s.add(ok())
            await given.grade(JudgeRequest(prompt(100)))
            assert given.context_tokens == 8192
        finally:
            await given.aclose()


@pytest.mark.parametrize(
    "props",
    [{"default_generation_settings": {"n_ctx": 4096}, "total_slots": 1}, {"n_ctx": 4096}],
    ids=["default_generation_settings", "top_level"],
)
async def test_context_is_read_from_llama_server_props_when_models_says_nothing(
    props: dict[str, Any],
) -> None:
    with scripted_server(props=props) as s:
        judge = OpenAIJudge(base_url=s.url, model="scripted-model")
        try:
            s.add(ok())
            await judge.grade(JudgeRequest(prompt(100)))
            assert judge.context_tokens == 4096
            assert "/props" in s.gets  # at the server's root, where llama-server serves it
        finally:
            await judge.aclose()


async def test_a_server_that_says_no_context_leaves_it_unknown_and_still_grades(
    server: ScriptedServer,
) -> None:
    judge = OpenAIJudge(base_url=server.url, model="scripted-model")  # /props answers 404 here
    try:
        server.add(ok())
        resp = await judge.grade(JudgeRequest(prompt(100)))
        assert resp.samples and judge.context_tokens is None
    finally:
        await judge.aclose()


async def test_the_setting_wins_over_the_server() -> None:
    with scripted_server(model_info={"max_model_len": 8192}, props={"n_ctx": 4096}) as s:
        judge = OpenAIJudge(base_url=s.url, model="scripted-model", context_tokens=2048)
        try:
            s.add(ok())
            await judge.grade(JudgeRequest(prompt(100)))
            assert judge.context_tokens == 2048
            assert s.gets == []  # set: the server is not asked
        finally:
            await judge.aclose()
    with pytest.raises(ValueError, match="context_tokens"):
        OpenAIJudge(base_url="http://127.0.0.1:9/v1", context_tokens=0)


# -- learned from a refusal --

# What each server answers (HTTP 400) for a request over the model's context, as its code writes it.
REFUSALS: dict[str, tuple[dict[str, Any], int | None, int | None]] = {
    "openai": (
        {
            "error": {
                "message": "This model's maximum context length is 8192 tokens. However, "
                "your messages resulted in "
                "9000 tokens. Please reduce the length of the messages.",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
        },
        8192,
        9000,
    ),
    "vllm": (
        {
            "object": "error",
            "message": "This model's maximum context length is 8192 tokens. However, you "
            "requested 9001 tokens "
            "(9000 in the messages, 1 in the completion). Please reduce the length of the "
            "messages or completion.",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        },
        8192,
        9001,
    ),
    "vllm_v1": (
        {
            "object": "error",
            "message": "The prompt (total length 9000) is longer than the maximum model "
            "length of 8192. Make sure "
            "that `max_model_len` is no smaller than the number of text tokens.",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        },
        8192,
        9000,
    ),
    "llama_server": (
        {
            "error": {
                "code": 400,
                "message": "the request exceeds the available context size, try increasing it",
                "type": "exceed_context_size_error",
                "n_prompt_tokens": 9000,
                "n_ctx": 8192,
            }
        },
        8192,
        9000,
    ),
    "anthropic": (
        {
            "type": "error",
            "error": {
                "type": "invalid_request_error",
                "message": "prompt is too long: 210000 tokens > 200000 maximum",
            },
        },
        200000,
        210000,
    ),
    "no_numbers": (
        {
            "error": {
                "code": 400,
                "message": "the request exceeds the available context size, try increasing it",
            }
        },
        None,
        None,
    ),
}


@pytest.mark.parametrize("transport", ["lean", "sdk"])
@pytest.mark.parametrize("server_kind", list(REFUSALS))
async def test_a_context_refusal_is_context_overflow_learned_and_not_retried(
    server: ScriptedServer, server_kind: str, transport: str
) -> None:
    body, limit, needed = REFUSALS[server_kind]
    server.default = Reply(400, body)
    if transport == "sdk":
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=server.url, api_key="k", max_retries=0)
        judge = OpenAIJudge(model="scripted-model", client=client, max_retries=3)
    else:
        judge = OpenAIJudge(base_url=server.url, model="scripted-model", max_retries=3)
    big = JudgeRequest(prompt(40_000))
    try:
        with pytest.raises(JudgeError) as err:
            await judge.grade(big)
        assert err.value.reason == "context_overflow" and not err.value.retryable
        assert (err.value.limit, err.value.requested) == (limit, needed)
        assert server.posts == 1  # not retried: the same prompt cannot fit on a second try
        size = estimate_tokens(big.prompt.text()) + 1
        assert judge.context_tokens == (limit if limit else size - 1)
        # The same prompt is never sent again: refused here, counted, without a network call.
        with pytest.raises(JudgeError) as again:
            await judge.grade(big)
        assert again.value.reason == "context_overflow" and "not sent" in str(again.value)
        assert server.posts == 1 and judge.context_refused == 1 and judge.failures == 2
    finally:
        await judge.aclose()
        if transport == "sdk":
            await client.close()


async def test_other_400s_stay_bad_request(server: ScriptedServer) -> None:
    server.default = Reply(
        400, {"error": {"message": "temperature must be at most 2", "code": "invalid_value"}}
    )
    judge = OpenAIJudge(base_url=server.url, model="scripted-model")
    try:
        with pytest.raises(JudgeError) as err:
            await judge.grade(JudgeRequest(prompt(100)))
        assert err.value.reason == "bad_request" and judge.context_tokens is None
    finally:
        await judge.aclose()


def vllm_server(limit: int, refused: list[int]) -> Any:
    """A reply script that refuses, as vLLM, any request whose tokens (its content's characters /
    4) pass `limit`."""

    def answer(body: dict[str, Any]) -> Reply:
        chars = sum(len(m["content"]) for m in body["messages"])
        tokens = chars // 4 + body["max_tokens"]
        if tokens <= limit:
            return ok()
        refused.append(tokens)
        message = (
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{tokens} tokens "
            f"({tokens - 1} in the messages, 1 in the completion). Please reduce the length "
            "of the messages."
        )
        return Reply(
            400, {"object": "error", "message": message, "type": "BadRequestError", "code": 400}
        )

    return answer


async def test_no_request_over_the_learned_context_reaches_the_server(
    server: ScriptedServer,
) -> None:
    refused: list[int] = []
    server.default = vllm_server(2000, refused)
    judge = OpenAIJudge(base_url=server.url, model="scripted-model")
    # A run's prompts grow past the context, then (a budget, a new run) come back under it.
    prompts = [prompt(chars) for chars in [*range(2_000, 16_001, 1_000), 3_000, 4_000, 5_000]]
    fit = [
        sum(len(m["content"]) for m in judge._messages(p, images=False)) // 4 + 1 <= 2000
        for p in prompts
    ]
    try:
        failed = 0
        for p in prompts:
            try:
                await judge.grade(JudgeRequest(p))
            except JudgeError as e:
                assert e.reason == "context_overflow"
                failed += 1
        # the first too-long request taught the judge; no later one reached the server
        assert len(refused) == 1
        assert judge.context_tokens == 2000
        # Calibrated on the refusal's numbers (2000 of the 2,3xx tokens it needed), the estimate
        # still lets every prompt that fits through: the ones after the refusal too.
        assert 0 < sum(fit) < len(fit) and fit[-3:] == [True, True, True]
        assert server.posts == 1 + sum(fit) and failed == len(fit) - sum(fit)
        assert judge.context_refused == failed - 1
    finally:
        await judge.aclose()


async def test_a_context_refusal_does_not_open_the_circuit(server: ScriptedServer) -> None:
    server.default = Reply(400, REFUSALS["vllm"][0])
    circuit = CircuitJudge(OpenAIJudge(base_url=server.url, model="scripted-model"), threshold=2)
    try:
        # what a prompt budget reads through the daemon's circuit
        assert circuit.context_tokens is None
        for _ in range(5):
            with pytest.raises(JudgeError, match="context_overflow"):
                await circuit.grade(JudgeRequest(prompt(40_000)))
        assert not circuit.degraded and circuit.trips == 0 and circuit.calls_failed == 5
        assert circuit.context_tokens == 8192  # learned by the judge behind it
    finally:
        await circuit.aclose()


@pytest.mark.parametrize("task_chars", [1, 12_000])
async def test_context_overflow_is_counted_under_its_reason_in_the_metrics(
    server: ScriptedServer, task_chars: int
) -> None:
    refused: list[int] = []
    server.default = vllm_server(2000, refused)
    reg = CollectorRegistry()
    judge = OpenAIJudge(base_url=server.url, model="scripted-model")
    async with Monitor(MonitorConfig(), judge=judge, registry=reg) as mon:
        await mon.handle("agents/r/start", json.dumps({"task": "t" * task_chars}).encode())
        for i in range(1, 9):
            await mon.handle(
                "agents/r/step", json.dumps({"index": i, "text": f"s{i} " + "x" * 2_000}).encode()
            )
            await mon.drain()
    overflow = reg.get_sample_value(
        "agent_monitor_scoring_failures_total", {"reason": "context_overflow"}
    )
    bad = reg.get_sample_value("agent_monitor_scoring_failures_total", {"reason": "bad_request"})
    ok_ = reg.get_sample_value("agent_monitor_scorings_total", {"outcome": "ok"}) or 0
    assert len(refused) == 1 and judge.context_tokens == 2000 and bad == 0
    if task_chars == 1:
        # The refused prefix was laid out again under the learned budget and asked once more: no
        # step lost.
        assert ok_ == 8 and overflow == 0 and server.posts == 8 + 1
    else:
        # A task longer than the context: no budget can fit it, every scoring fails, counted as
        # context_overflow; only the first request reached the server.
        assert ok_ == 0 and overflow == 8 and server.posts == 1


# -- memory on the failed path --


def _retained_growth(server: ScriptedServer, calls: int) -> tuple[float, int]:
    """Bytes still allocated per failed call after `calls` failed scorings (the first 100
    excluded), and the calls."""

    async def run() -> tuple[float, int]:
        judge = OpenAIJudge(base_url=server.url, model="scripted-model", max_retries=0)
        tracker = AsyncProgressTracker("Fix the failing test.", judge=judge, run_id="long")
        await tracker.add("x" * 200_000)  # a 200 KB prompt: each call's request body is that big
        try:
            for _ in range(100):
                assert not (await tracker.score(1)).ok
            start = tracemalloc.get_traced_memory()[0]
            for _ in range(calls - 100):
                assert not (await tracker.score(1)).ok
            return (tracemalloc.get_traced_memory()[0] - start) / (calls - 100), server.posts
        finally:
            await judge.aclose()

    # The cyclic collector off, as a busy daemon runs it seldom (serve --gc-threshold): what a
    # failed call leaves behind must be freed by reference counting alone, not wait for a
    # collection.
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        return asyncio.run(run())
    finally:
        tracemalloc.stop()
        gc.enable()
        gc.collect()


@pytest.mark.parametrize("refusal", ["generic", "context"])
def test_memory_stays_flat_over_500_failed_calls(refusal: str) -> None:
    with scripted_server(record=False) as s:
        if refusal == "generic":  # every call reaches the server and fails
            s.default = Reply(
                400, {"error": {"message": "unsupported parameter", "code": "invalid_value"}}
            )
        else:  # the first teaches the judge its context; the others are refused unsent
            s.default = Reply(400, REFUSALS["vllm"][0])
        per_call, posts = _retained_growth(s, 500)
    # Context: the 200 KB prompt is refused and teaches 8,192 tokens; the tracker's window then
    # sends one prompt bounded to that context (this server refuses it too, and the judge learns
    # from it); the rest go unsent.
    assert posts == (500 if refusal == "generic" else 2)
    # A failed call that left its request behind would hold 200 KB or more; bounded state holds
    # nothing per call.
    assert per_call < 1_000, f"{per_call:.0f} bytes retained per failed call"
    assert math.isfinite(per_call)


# -- Gemini, and the in-process llama.cpp judge --


async def test_gemini_takes_the_model_s_input_token_limit_and_learns_from_its_refusal() -> None:
    from agent_monitor.judges.gemini import GeminiJudge
    from tests.gemini_server import GeminiServer, error, letter_reply

    info = {
        "name": "models/gemini-2.5-flash",
        "inputTokenLimit": 1048576,
        "outputTokenLimit": 65536,
    }
    server = GeminiServer(model_info=info).start()
    judge = GeminiJudge(
        "gemini-2.5-flash", api_key="test", base_url=server.url, backoff_s=0.001, max_retries=3
    )
    try:
        server.queue(letter_reply({"K": 1.0}))
        await judge.grade(JudgeRequest(prompt(100)))
        assert judge.context_tokens == 1048576 and len(server.gets) == 1
        server.queue(
            error(
                400,
                "The input token count (1200000) exceeds the maximum number of tokens "
                "allowed (1048576).",
            )
        )
        with pytest.raises(JudgeError) as err:
            await judge.grade(JudgeRequest(prompt(40_000)))
        assert err.value.reason == "context_overflow" and (
            err.value.limit,
            err.value.requested,
        ) == (1048576, 1200000)
        assert len(server.requests) == 2  # not retried
    finally:
        await judge.aclose()
        server.stop()
    # a proxy without the models endpoint: the context stays unknown
    unknown = GeminiServer().start()
    judge = GeminiJudge("gemini-2.5-flash", api_key="test", base_url=unknown.url)
    try:
        unknown.queue(letter_reply({"K": 1.0}))
        await judge.grade(JudgeRequest(prompt(100)))
        assert judge.context_tokens is None
    finally:
        await judge.aclose()
        unknown.stop()


@pytest.mark.slow
async def test_the_in_process_llama_judge_knows_its_n_ctx_and_learns_from_its_own_refusal() -> None:
    from agent_monitor.judges.llamacpp import LlamaCppJudge
    from tests.llama_models import gemma_path

    # its default n_ctx, the packaged judge's
    assert LlamaCppJudge(gemma_path()).context_tokens == 8192
    # a setting narrows
    assert LlamaCppJudge(gemma_path(), n_ctx=4096, context_tokens=2048).context_tokens == 2048
    judge = LlamaCppJudge(gemma_path(), n_ctx=512)
    try:
        assert judge.context_tokens == 512
        with pytest.raises(JudgeError) as err:
            await judge.grade(JudgeRequest(prompt(8_000)))
        assert err.value.reason == "context_overflow" and err.value.limit == 512
        evaluated = judge.tokens_evaluated
        with pytest.raises(JudgeError, match="not sent"):
            # refused before tokenizing, the second time
            await judge.grade(JudgeRequest(prompt(8_000)))
        assert judge.context_refused == 1 and judge.tokens_evaluated == evaluated
        resp = await judge.grade(JudgeRequest(prompt(100)))  # a prompt that fits is still graded
        assert resp.samples[0]
    finally:
        await judge.aclose()


# -- judge calls nobody reads --


async def test_a_prefix_superseded_before_it_starts_is_not_scored_and_one_superseded_in_flight_is_counted() -> (  # noqa: E501 (the test's name is its sentence)
    None
):
    from agent_monitor.testing import FakeJudge

    reg = CollectorRegistry()
    judge = FakeJudge(lambda p: "K", latency_s=0.3)
    async with Monitor(MonitorConfig(max_concurrency=4), judge=judge, registry=reg) as mon:
        await mon.handle("agents/r/start", json.dumps({"task": "t"}).encode())
        await mon.handle("agents/r/step", json.dumps({"index": 1, "text": "s1"}).encode())
        await asyncio.sleep(0.1)  # the prefix of step 1 is with the judge now
        # they supersede it in flight; 2 is superseded by 3 before its scoring starts
        for i in (2, 3):
            await mon.handle("agents/r/step", json.dumps({"index": i, "text": f"s{i}"}).encode())
        await mon.drain()
        scoring = mon.statistics().scoring
    assert len(judge.requests) == 2  # steps 1 and 3: no call was ever made for the prefix of 2
    assert [r.prompt.step for r in judge.requests] == [1, 3]
    assert scoring.superseded == 1 and scoring.coalesced == 1 and scoring.scorings == 2
    assert reg.get_sample_value("agent_monitor_scorings_superseded_total") == 1
    assert reg.get_sample_value("agent_monitor_coalesced_steps_total") == 1


async def test_the_judge_context_flag_its_environment_twin_and_the_hook_s_judge() -> None:
    import argparse

    from agent_monitor._compat import judge_from_env
    from agent_monitor.cli._flags import add_flags, build
    from agent_monitor.cli._main import CliError, JudgeOptions, build_judge

    given = ["--judge", "openai", "--judge-url", "http://127.0.0.1:9/v1", "--judge-model", "m"]
    for environ, argv, expected in [
        ({}, given, None),
        ({"AGENT_MONITOR_JUDGE_CONTEXT": "4096"}, given, 4096),
        # the flag wins
        ({"AGENT_MONITOR_JUDGE_CONTEXT": "4096"}, [*given, "--judge-context", "2048"], 2048),
    ]:
        parser = argparse.ArgumentParser()
        add_flags(parser, JudgeOptions, environ, title="judge")
        judge = build_judge(build(JudgeOptions, parser.parse_args(argv)))
        try:
            assert judge.context_tokens == expected
        finally:
            await judge.aclose()
    parser = argparse.ArgumentParser()
    add_flags(parser, JudgeOptions, {}, title="judge")
    with pytest.raises(CliError, match="--judge-context"):
        build_judge(build(JudgeOptions, parser.parse_args([*given, "--judge-context", "0"])))
    env = {
        "AGENT_MONITOR_JUDGE_URL": "http://127.0.0.1:9/v1",
        "AGENT_MONITOR_JUDGE_CONTEXT": "1024",
    }
    hook_judge = judge_from_env("m", environ=env)
    try:
        assert hook_judge.context_tokens == 1024
    finally:
        await hook_judge.aclose()
    with pytest.raises(ValueError, match="AGENT_MONITOR_JUDGE_CONTEXT"):
        judge_from_env("m", environ={**env, "AGENT_MONITOR_JUDGE_CONTEXT": "lots"})


async def test_no_scoring_starts_while_the_run_s_last_score_waits_to_be_published(
    broker: Any,
) -> None:
    from agent_monitor.testing import FakeJudge
    from agent_monitor.wire import BrokerSettings

    judge = FakeJudge(lambda p: "K")
    config = MonitorConfig(
        broker=BrokerSettings.from_url(broker.url), client_id=f"mon-{broker.port}"
    )
    async with Monitor(config, judge=judge) as mon:
        await mon.handle("agents/r/start", json.dumps({"task": "t"}).encode())
        await mon.handle("agents/r/step", json.dumps({"index": 1, "text": "s1"}).encode())
        await asyncio.wait_for(mon.drain(), 10)
        assert len(judge.requests) == 1 and len(mon.outbox) == 0  # scored and published
        broker.stop()  # nobody can read a score now
        await mon.handle("agents/r/step", json.dumps({"index": 2, "text": "s2"}).encode())
        for _ in range(200):  # step 2 is scored; its score waits in the outbox
            if mon.outbox.pending("r"):
                break
            await asyncio.sleep(0.01)
        assert len(judge.requests) == 2 and mon.outbox.pending("r")
        for i in (3, 4, 5):
            await mon.handle("agents/r/step", json.dumps({"index": i, "text": f"s{i}"}).encode())
            await asyncio.sleep(0.05)
        # held: a score for 3, 4 or 5 would only queue behind 2's, unread
        assert len(judge.requests) == 2
        held = mon.statistics().scoring.held
        assert held >= 1
        broker.start()  # the link reconnects, 2's score goes out, and one scoring covers 3-5
        await asyncio.wait_for(mon.drain(), 60)
        assert [r.prompt.step for r in judge.requests] == [1, 2, 5]
        assert mon.tracker("r") is not None and mon.tracker("r").latest.coalesced == 3  # type: ignore[union-attr]


# -- an LLM digest's summaries (--digest judge|MODEL) --


@pytest.mark.parametrize("api", ["chat", "completions"])
async def test_the_openai_judge_summarises_with_one_plain_completion(
    server: ScriptedServer, api: str
) -> None:
    text = "The agent installed the package and the tests pass."
    if api == "chat":
        reply = {
            "choices": [{"message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 900},
        }
    else:
        reply = {
            "choices": [{"text": text}],
            "usage": {"prompt_tokens": 900, "completion_tokens": 12},
        }
    server.default = Reply(200, reply)
    judge = OpenAIJudge(
        base_url=server.url,
        model="scripted-model",
        api=api,
        extra_body={"grammar": "root ::= [A-T]"},
    )
    try:
        said, usage = await judge.summarise(
            "Summarise these steps.", max_tokens=200, model="smaller-model"
        )
        assert said == text and usage.input_tokens == 900
        body = server.requests[-1]
        assert (
            body["model"] == "smaller-model"
            and body["max_tokens"] == 200
            and body["temperature"] == 0.0
        )
        # extra_body shapes grading answers, not summaries
        assert "grammar" not in body and "logprobs" not in body
        assert server.paths[-1].endswith("/chat/completions" if api == "chat" else "/completions")
        await judge.summarise("again", max_tokens=10)
        assert server.requests[-1]["model"] == "scripted-model"  # None: the judge's own model
        server.default = Reply(503, {"error": {"message": "overloaded"}})
        with pytest.raises(JudgeError):
            await judge.summarise("Summarise these steps.", max_tokens=200)
    finally:
        await judge.aclose()

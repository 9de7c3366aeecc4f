"""Real instrumentations into the OTLP receiver: OpenInference on the OpenAI Agents SDK and on plain
chat calls.

Both talk to a scripted OpenAI-compatible server (tests/openai_server.py); their spans go through
the SDK's OTLP/HTTP exporter to the receiver, which makes a run of each trace: every tool call a
step, the end with the root span.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

pytest.importorskip("openinference.instrumentation.openai_agents")
pytest.importorskip("openinference.instrumentation.openai")

from openai import AsyncOpenAI, OpenAI
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

from agent_monitor.daemon import RunOpened
from agent_monitor.testing import FakeJudge
from tests.daemon.sources.otlp.test_otlp_receiver import closed, receiving, until
from tests.openai_server import Reply, ScriptedServer, scripted_server

pytestmark = pytest.mark.timeout(120)

TASK = "What is the weather in Paris, in Celsius?"


def completion(message: dict[str, Any], finish: str) -> Reply:
    usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    return Reply(
        body={
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": "scripted-model",
            "choices": [
                {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
            ],
            "usage": usage,
        }
    )


def calls(name: str, arguments: dict[str, Any], call_id: str) -> Reply:
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }
    return completion({"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls")


def says(text: str) -> Reply:
    return completion({"role": "assistant", "content": text}, "stop")


@contextmanager
def model_server() -> Iterator[ScriptedServer]:
    with scripted_server(models=("scripted-model",)) as server:
        yield server


def run_ids(receiver: Any) -> list[str]:
    return list(receiver.traces.runs)


async def test_openinference_on_an_agents_sdk_agent_with_two_function_tools() -> None:
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool
    from openinference.instrumentation.openai_agents import OpenAIAgentsInstrumentor

    called: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city, in Fahrenheit."""
        called.append(f"get_weather {city}")
        return "68 F and sunny"

    @function_tool
    def to_celsius(fahrenheit: float) -> str:
        """Fahrenheit to Celsius."""
        called.append(f"to_celsius {fahrenheit}")
        return f"{(fahrenheit - 32) * 5 / 9:.0f} C"

    with model_server() as server:
        server.add(
            calls("get_weather", {"city": "Paris"}, "call_1"),
            calls("to_celsius", {"fahrenheit": 68}, "call_2"),
            says("It is 20 C and sunny in Paris."),
        )
        judge = FakeJudge()
        async with receiving(judge) as (_, receiver, events):
            provider = TracerProvider()
            # The batch processor exports from its own thread: the receiver shares this event loop.
            provider.add_span_processor(
                BatchSpanProcessor(
                    OTLPSpanExporter(endpoint=receiver.url), schedule_delay_millis=100
                )
            )
            instrumentor = OpenAIAgentsInstrumentor()
            instrumentor.instrument(tracer_provider=provider)
            try:
                model = OpenAIChatCompletionsModel(
                    model="scripted-model",
                    openai_client=AsyncOpenAI(base_url=server.url, api_key="test"),
                )
                agent = Agent(
                    name="weather",
                    instructions="Answer in Celsius.",
                    tools=[get_weather, to_celsius],
                    model=model,
                )
                result = await Runner.run(agent, TASK)
                assert result.final_output == "It is 20 C and sunny in Paris."
                await asyncio.to_thread(provider.force_flush)
                await until(
                    lambda: any(e for e in events if getattr(e, "outcome", None) is not None)
                )
            finally:
                instrumentor.uninstrument()
                await asyncio.to_thread(provider.shutdown)
    assert called == ["get_weather Paris", "to_celsius 68.0"]
    [opened] = [e for e in events if isinstance(e, RunOpened)]
    assert opened.start.task == TASK
    end = closed(events, opened.run_id)
    # 3 model turns, 2 tool calls
    assert end is not None and end.outcome == "unknown" and end.steps == 5
    prompt = judge.prompts[-1].prefix_text()
    steps = prompt[prompt.index("### Step 1") :]
    assert steps == (
        '### Step 1\nTool call: get_weather({"city": "Paris"})\n\n'
        '### Step 2\nTool call: get_weather({"city": "Paris"})\nResult: 68 F and sunny\n\n'
        '### Step 3\nTool call: to_celsius({"fahrenheit": 68})\n\n'
        '### Step 4\nTool call: to_celsius({"fahrenheit": 68})\nResult: 20 C\n\n'
        "### Step 5\nAssistant: It is 20 C and sunny in Paris.\n"
    )
    stats = receiver.statistics()
    assert stats.steps == 5 and stats.late == 0


async def test_openinference_on_plain_chat_calls_inside_an_agent_span() -> None:
    from openinference.instrumentation.openai import OpenAIInstrumentor

    with model_server() as server:
        server.add(calls("get_weather", {"city": "Paris"}, "call_1"), says("It is 20 C in Paris."))
        judge = FakeJudge()
        async with receiving(judge) as (_, receiver, events):
            provider = TracerProvider()
            provider.add_span_processor(
                SimpleSpanProcessor(OTLPSpanExporter(endpoint=receiver.url))
            )
            instrumentor = OpenAIInstrumentor()
            instrumentor.instrument(tracer_provider=provider)
            tracer = provider.get_tracer("my-agent")

            def agent() -> str:
                client = OpenAI(base_url=server.url, api_key="test")
                root = {
                    "openinference.span.kind": "AGENT",
                    "input.value": TASK,
                    "agent_monitor.outcome": "success",
                }
                with tracer.start_as_current_span("my agent", attributes=root) as span:
                    messages: list[Any] = [{"role": "user", "content": TASK}]
                    first = client.chat.completions.create(
                        model="scripted-model", messages=messages
                    )
                    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
                    with tracer.start_as_current_span(
                        "get_weather",
                        attributes={
                            "openinference.span.kind": "TOOL",
                            "tool.name": "get_weather",
                            "input.value": call.function.arguments,
                            "output.value": "68 F",
                        },  # type: ignore[union-attr]
                    ):
                        pass
                    messages += [
                        first.choices[0].message,
                        {"role": "tool", "tool_call_id": call.id, "content": "68 F"},
                    ]
                    client.chat.completions.create(model="scripted-model", messages=messages)
                    return f"{span.get_span_context().trace_id:032x}"

            try:
                run_id = await asyncio.to_thread(agent)
                await until(lambda: closed(events, run_id) is not None)
            finally:
                instrumentor.uninstrument()
                provider.shutdown()
    end = closed(events, run_id)
    assert end is not None and end.outcome == "success" and end.steps == 3
    opened = [e for e in events if type(e).__name__ == "RunOpened"]
    assert [o.start.task for o in opened] == [TASK]
    prompt = judge.prompts[-1].prefix_text()
    assert prompt[prompt.index("### Step 1") :] == (
        '### Step 1\nTool call: get_weather({"city": "Paris"})\n\n'
        '### Step 2\nTool call: get_weather({"city": "Paris"})\nResult: 68 F\n\n'
        "### Step 3\nAssistant: It is 20 C in Paris.\n"
    )

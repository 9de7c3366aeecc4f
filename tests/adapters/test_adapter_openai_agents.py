"""The OpenAI Agents SDK adapter with REAL `Runner.run` runs, driven by a scripted `Model` (no
network).

The scripted model wraps each answer in a generation span the way the SDK's Chat Completions model
does, so the runner makes real agent, turn, generation and function spans and calls the real hooks.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

agents = pytest.importorskip("agents")

import paho.mqtt.client as mqtt  # noqa: E402
from agents import Agent, RunConfig, Runner, function_tool  # noqa: E402
from agents.items import ModelResponse, TResponseInputItem, TResponseStreamEvent  # noqa: E402
from agents.models.interface import Model, ModelTracing  # noqa: E402
from agents.tracing import generation_span, handoff_span, response_span, set_trace_processors, trace  # noqa: E402
from agents.usage import Usage  # noqa: E402
from openai.types.responses import (  # noqa: E402
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion  # noqa: E402

from agent_monitor import ProgressTracker  # noqa: E402
from agent_monitor.adapters.openai_agents import (  # noqa: E402
    AgentMonitor,
    RunAborted,
    monitor_processor,
    span_step,
)
from agent_monitor.testing import FakeJudge  # noqa: E402
from agent_monitor.wire import MonitorClient  # noqa: E402
from tests.brokers import Mosquitto  # noqa: E402

WAIT = 10.0


# -- a scripted model at the SDK's Model boundary --


def say(text: str) -> ResponseOutputMessage:
    return ResponseOutputMessage(
        id=f"msg-{uuid.uuid4().hex[:8]}",
        type="message",
        role="assistant",
        status="completed",
        content=[ResponseOutputText(text=text, type="output_text", annotations=[])],
    )


def call(name: str, **arguments: Any) -> ResponseFunctionToolCall:
    cid = f"call-{uuid.uuid4().hex[:8]}"
    return ResponseFunctionToolCall(
        id=cid, call_id=cid, type="function_call", name=name, arguments=json.dumps(arguments)
    )


class ScriptedModel(Model):
    """Answers each model call with the next scripted output; `before` may await something first
    (e.g. a signal)."""

    def __init__(self, script: list[list[Any]], before: Callable[[int], Any] | None = None) -> None:
        self.script = script
        self.before = before
        self.calls = 0

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: Any,
        tools: list[Any],
        output_schema: Any,
        handoffs: list[Any],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: Any,
    ) -> ModelResponse:
        n = self.calls
        self.calls += 1
        if self.before is not None:
            await self.before(n)
        output = self.script[n]
        # Like OpenAIChatCompletionsModel: one generation span per call, its output in chat-message
        # form.
        with generation_span(model="scripted", disabled=tracing.is_disabled()) as span:
            if tracing.include_data():
                texts = [
                    c.text
                    for o in output
                    if isinstance(o, ResponseOutputMessage)
                    for c in o.content
                ]
                calls = [
                    {"name": o.name, "arguments": o.arguments}
                    for o in output
                    if o.type == "function_call"
                ]
                span.span_data.output = [
                    {"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls}
                ]
        return ModelResponse(output=output, usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[TResponseStreamEvent]:
        raise NotImplementedError("the tests run Runner.run, not run_streamed")


def shell_agent(model: Model, executed: list[str], name: str = "coder") -> Agent[Any]:
    @function_tool
    def run_shell(cmd: str) -> str:
        """Run a shell command and return its output."""
        executed.append(cmd)
        return f"ran `{cmd}`: ok"

    return Agent(name=name, instructions="Fix the repo.", model=model, tools=[run_shell])


@pytest.fixture(autouse=True)
def only_our_processor() -> Iterator[None]:
    # Keep the SDK's default exporter (to OpenAI's backend) out of tests: no network, no background
    # thread.
    set_trace_processors([monitor_processor()])
    yield
    set_trace_processors([monitor_processor()])


async def wait_for(pred: Callable[[], bool], what: str, within: float = WAIT) -> None:
    deadline = time.monotonic() + within
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {within}s")
        await asyncio.sleep(0.01)


# -- steps --


async def test_real_run_sends_messages_and_tool_steps_in_order_to_a_tracker() -> None:
    executed: list[str] = []
    model = ScriptedModel(
        [
            [say("I will look at the failing test."), call("run_shell", cmd="pytest -q")],
            [call("run_shell", cmd="sed -i s/-1/1/ calc.py")],
            [say("All tests pass now.")],
        ]
    )
    judge = FakeJudge()
    tracker = ProgressTracker("Make the failing test pass", judge=judge)
    try:
        with AgentMonitor(tracker) as monitor:
            result = await Runner.run(
                shell_agent(model, executed), "Make the failing test pass", hooks=monitor.hooks
            )
        assert result.final_output == "All tests pass now."
        assert executed == ["pytest -q", "sed -i s/-1/1/ calc.py"]
        assert monitor.steps == [
            "assistant: I will look at the failing test.",
            'tool run_shell {"cmd": "pytest -q"}\n-> ran `pytest -q`: ok',
            'tool run_shell {"cmd": "sed -i s/-1/1/ calc.py"}\n-> ran `sed -i s/-1/1/ calc.py`: ok',
            "assistant: All tests pass now.",
        ]
        last = await asyncio.to_thread(tracker.drain)
        assert last is not None and last.ok and last.step == 4
        assert [s.text for s in tracker.steps] == monitor.steps
        assert [s.meta for s in tracker.steps] == [
            {"span": "generation"},
            {"span": "function"},
            {"span": "function"},
            {"span": "generation"},
        ]
        assert monitor.signal == "continue" or monitor.signal is None
        assert not monitor.should_abort
    finally:
        tracker.close()
        judge.close()


async def test_concurrent_runs_each_reach_their_own_monitor() -> None:
    async def tick(_: int) -> None:
        await asyncio.sleep(0.01)  # interleave the two runs

    trackers, monitors, judges = [], [], []
    try:
        coros = []
        for who in ("alpha", "beta"):
            judge = FakeJudge()
            tracker = ProgressTracker(f"task {who}", judge=judge)
            monitor = AgentMonitor(tracker, messages=False)
            judges.append(judge)
            trackers.append(tracker)
            monitors.append(monitor)
            model = ScriptedModel(
                [[call("run_shell", cmd=f"{who} {i}")] for i in range(3)] + [[say("done")]],
                before=tick,
            )
            coros.append(
                Runner.run(shell_agent(model, [], name=who), f"task {who}", hooks=monitor.hooks)
            )
        await asyncio.gather(*coros)
        for who, monitor in zip(("alpha", "beta"), monitors, strict=True):
            assert [s.splitlines()[0] for s in monitor.steps] == [
                f'tool run_shell {{"cmd": "{who} {i}"}}' for i in range(3)
            ]
    finally:
        for m in monitors:
            m.close()
        for t in trackers:
            t.close()
        for j in judges:
            j.close()


async def test_explicit_trace_id_without_hooks_and_no_steps_when_tracing_is_disabled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    judge = FakeJudge()
    tracker = ProgressTracker("t", judge=judge)
    try:
        monitor = AgentMonitor(tracker)
        model = ScriptedModel([[call("run_shell", cmd="ls")], [say("ok")]])
        await Runner.run(
            shell_agent(model, []), "t", run_config=RunConfig(trace_id=monitor.trace_id)
        )
        assert monitor.steps == ['tool run_shell {"cmd": "ls"}\n-> ran `ls`: ok', "assistant: ok"]
        monitor.close()

        quiet = AgentMonitor(tracker)
        model = ScriptedModel([[call("run_shell", cmd="ls")], [say("ok")]])
        with caplog.at_level("WARNING", logger="agent_monitor.adapters.openai_agents"):
            await Runner.run(
                shell_agent(model, []),
                "t",
                hooks=quiet.hooks,
                run_config=RunConfig(tracing_disabled=True),
            )
        assert quiet.steps == [] and "tracing is disabled" in caplog.text
        quiet.close()
    finally:
        tracker.close()
        judge.close()


def test_span_step_reads_responses_api_handoffs_errors_and_clips() -> None:
    class FakeResponse:
        def __init__(self) -> None:
            self.output = [say("Here is the plan."), call("run_shell", cmd="ls")]

    with trace("unit"):
        with response_span() as r:
            r.span_data.response = FakeResponse()  # type: ignore[assignment]
        assert span_step(r) == "assistant: Here is the plan."
        assert span_step(r, messages=False) is None
        with handoff_span(from_agent="triage", to_agent="coder") as h:
            pass
        assert span_step(h) == "handoff: triage -> coder"
        with generation_span() as g:
            g.span_data.output = [
                {"role": "assistant", "content": None, "tool_calls": [{"name": "x"}]}
            ]
        assert span_step(g) is None  # a tool request alone: its function span is the step
        from agents.tracing import SpanError, function_span

        with function_span("deploy", input='{"env": "prod"}') as f:
            f.set_error(
                SpanError(message="Error running tool", data={"error": "permission denied"})
            )
        assert span_step(f) == (
            'tool deploy {"env": "prod"}\n-> error: Error running tool: permission denied'
        )
        with function_span("cat", input="{}", output="x" * 10_000) as big:
            pass
        text = span_step(big, max_chars=100)
        assert text is not None and len(text) < 200 and "characters cut" in text


def test_sink_must_be_a_tracker_or_run() -> None:
    with pytest.raises(TypeError, match="ProgressTracker"):
        AgentMonitor(object())  # type: ignore[arg-type]


# -- abort --


async def test_abort_from_an_in_process_tracker_stops_the_run_before_the_next_tool_call() -> None:
    executed: list[str] = []
    judge = FakeJudge()  # step 1 scores 1/19, far below abort_below
    tracker = ProgressTracker(
        "t", judge=judge, policy={"abort_below": 0.9, "min_steps": 1, "patience": 1}
    )
    monitor = AgentMonitor(tracker)

    async def slow_model(n: int) -> None:
        if n == 1:  # the model "thinks" while the monitor scores step 1
            await wait_for(lambda: monitor.should_abort, "abort signal")

    model = ScriptedModel(
        [[call("run_shell", cmd="ls")], [call("run_shell", cmd="rm -rf build")], [say("done")]],
        before=slow_model,
    )
    try:
        with pytest.raises(RunAborted, match=r"aborted this run at step 1 \(score 0\.05\)") as err:
            await Runner.run(shell_agent(model, executed), "t", hooks=monitor.hooks)
        assert executed == ["ls"]  # the second tool call never ran
        assert err.value.step == 1 and err.value.score == pytest.approx(1 / 19)
        assert monitor.steps == ['tool run_shell {"cmd": "ls"}\n-> ran `ls`: ok']
        assert monitor.should_abort and monitor.signal == "abort"
        with pytest.raises(RunAborted):
            monitor.check()  # for harnesses that check between turns
    finally:
        monitor.close()
        tracker.close()
        judge.close()


class FakeMonitor:
    """Plays the monitor daemon over plain paho: records steps, publishes a retained abort when
    told to."""

    def __init__(self, port: int, abort_after_step: int | None) -> None:
        self.steps: list[dict[str, Any]] = []
        self.abort_after_step = abort_after_step
        self.cond = threading.Condition()
        self.ready = threading.Event()
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=MQTTProtocolVersion.MQTTv311)
        self.c.on_subscribe = lambda *a: self.ready.set()
        self.c.on_message = self._on_message
        self.c.connect("127.0.0.1", port)
        self.c.subscribe("agents/+/step", qos=1)
        self.c.loop_start()
        assert self.ready.wait(WAIT)

    def _on_message(self, c: mqtt.Client, _u: Any, m: mqtt.MQTTMessage) -> None:
        step = json.loads(m.payload)
        run_id = m.topic.split("/")[1]
        with self.cond:
            self.steps.append(step)
            self.cond.notify_all()
        if self.abort_after_step is not None and step["index"] == self.abort_after_step:
            signal = {
                "run_id": run_id,
                "signal": "abort",
                "reason": "score below 0.2 for 1 step",
                "step": 1,
            }
            c.publish(
                f"agents/{run_id}/signal", json.dumps(signal | {"score": 0.1}), qos=1, retain=True
            )

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


async def test_abort_over_mqtt_stops_the_run_before_the_next_tool_call(broker: Mosquitto) -> None:
    fake = FakeMonitor(broker.port, abort_after_step=1)
    executed: list[str] = []
    try:
        with MonitorClient(broker.url, connect_timeout=5) as client:
            run = client.start_run(
                "agents-sdk-1", task="Clean the build", policy={"abort_below": 0.2}
            )
            monitor = AgentMonitor(run)

            async def slow_model(n: int) -> None:
                if n == 1:
                    await wait_for(lambda: monitor.should_abort, "abort signal over MQTT")

            model = ScriptedModel(
                [[call("run_shell", cmd="ls")], [call("run_shell", cmd="rm -rf /")], [say("done")]],
                before=slow_model,
            )
            with pytest.raises(
                RunAborted, match=r"at step 1 \(score 0\.10\): score below " r"0\.2 for 1 step"
            ):
                await Runner.run(
                    shell_agent(model, executed), "Clean the build", hooks=monitor.hooks
                )
            run.end("failure")
            monitor.close()
        assert executed == ["ls"]
        with fake.cond:
            assert fake.cond.wait_for(lambda: len(fake.steps) >= 1, WAIT)
        await asyncio.sleep(0.2)  # nothing else may arrive: the aborted call's span is not sent
        assert [(s["index"], s["text"]) for s in fake.steps] == [
            (1, 'tool run_shell {"cmd": "ls"}\n-> ran `ls`: ok')
        ]
        assert monitor.skipped in (0, 1) and fake.steps[0]["meta"] == {"span": "function"}
    finally:
        fake.close()

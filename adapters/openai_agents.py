"""OpenAI Agents SDK (`pip install openai-agents`): each tool call and message of a run becomes a
monitor step, and the run stops when the monitor says abort.

    from agents import Agent, Runner
    from agent_monitor.adapters.openai_agents import AgentMonitor, RunAborted
    from agent_monitor.wire import MonitorClient

    with MonitorClient("mqtt://127.0.0.1:1883") as client:
        run = client.start_run("run-1", task=task, policy={"abort_below": 0.2}) with
        AgentMonitor(run) as monitor: # or AgentMonitor(ProgressTracker(task, judge=...))
            try:
                result = await Runner.run(agent, task, hooks=monitor.hooks)
                run.end("success")
            except RunAborted as e: # raised before the next model call or tool call
                run.end("failure")

How it works, in the SDK's own terms:

- Steps come from tracing. A process-wide `TracingProcessor` (registered once with
  `add_trace_processor`) receives every span when it ends and hands it to the `AgentMonitor` bound
  to its trace: a function span (any local tool: function tools, shell, computer, apply-patch) is
  one step, `tool NAME INPUT` then `-> OUTPUT` (or `-> error: ...`); a generation span (Chat
  Completions, LiteLLM models) or a response span (Responses API models) with assistant text is one
  step `assistant: TEXT`; a handoff is one step. Tool-call requests inside a model's output are not
  sent twice: the function span that runs them is the step. Steps go out without waiting:
  `ProgressTracker.submit` / `AsyncProgressTracker.submit` (scored in the background, newest prefix
  first) or `Run.step` (MQTT QoS 1, no wait for the broker).
- The monitor is bound to a run's trace by its hooks (`on_agent_start` reads the current trace), so
  concurrent runs in one process each reach their own monitor. Without the hooks, pass `trace_id=`
  and run with `RunConfig(trace_id=monitor.trace_id)`.
- Stopping: `TracingProcessor` callbacks cannot stop a run (the SDK catches and logs their
  exceptions, in `SynchronousMultiTracingProcessor`), so the stop goes through `RunHooks`:
  `monitor.hooks` raises `RunAborted` from `on_llm_start` and `on_tool_start` once the monitor's
  latest signal is `abort`. It is an `agents.exceptions.AgentsException`, which the SDK re-raises as
  it is (any other exception raised in a tool hook comes out wrapped in a `UserError`), so
  `Runner.run` raises `RunAborted` before the tool runs. With your own hooks, call `monitor.check()`
  in them instead, or check `monitor.should_abort` between turns.
- Tracing must be on for the run (it is by default). With `RunConfig(tracing_disabled=True)` or
  `OPENAI_AGENTS_DISABLE_TRACING=1` no span is made and the monitor sees nothing (a warning says
  so); with `trace_include_sensitive_data=False` tool inputs and outputs and model text are left out
  of spans, so the steps carry tool names only.
- `set_trace_processors([...])` replaces every processor, this one included: put
  `monitor_processor()` in the list you pass.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, cast

from agents import Agent, RunContextWrapper, RunHooks, Tool
from agents.exceptions import AgentsException
from agents.run_context import AgentHookContext
from agents.tracing import (
    FunctionSpanData,
    GenerationSpanData,
    HandoffSpanData,
    ResponseSpanData,
    Span,
    Trace,
    TracingProcessor,
    add_trace_processor,
    gen_trace_id,
    get_current_trace,
)

from .atif import clip

if TYPE_CHECKING:
    from agent_monitor import AsyncProgressTracker, ProgressTracker
    from agent_monitor.wire import Run

    Sink = ProgressTracker | AsyncProgressTracker | Run

log = logging.getLogger("agent_monitor.adapters.openai_agents")

DEFAULT_MAX_CHARS = 4000
"""A tool's input and its output are each clipped to this many characters (head and tail kept)."""


class RunAborted(AgentsException):
    """The progress monitor's signal for this run is `abort`: the run was stopped before its next
    step."""

    def __init__(self, reason: str, *, step: int | None = None, score: float | None = None) -> None:
        where = f" at step {step}" if step is not None else ""
        how = f" (score {score:.2f})" if score is not None else ""
        super().__init__(f"the progress monitor aborted this run{where}{how}: {reason}")
        self.reason = reason
        self.step = step
        self.score = score


def _text_of(value: object) -> str:
    """Text of a span payload: strings as they are, anything else as JSON (or its str)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def _message_texts(output: Iterable[Any]) -> list[str]:
    """Assistant text in a model's output: chat messages (dicts) or Responses output items
    (objects or dicts)."""
    texts: list[str] = []

    def get(obj: Any, key: str) -> Any:
        return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)

    for item in output:
        kind, role = get(item, "type"), get(item, "role")
        if kind not in (None, "message") or role not in (None, "assistant"):
            continue  # function calls, reasoning, tool results: the function span is the step
        content = get(item, "content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, Iterable):
            for part in content:
                if isinstance(part, str):
                    texts.append(part)
                elif get(part, "type") in ("output_text", "text") and isinstance(
                    get(part, "text"), str
                ):
                    texts.append(get(part, "text"))
                elif get(part, "type") == "refusal" and get(part, "refusal"):
                    texts.append(f"[refusal] {get(part, 'refusal')}")
        if isinstance(get(item, "refusal"), str) and get(item, "refusal"):
            texts.append(f"[refusal] {get(item, 'refusal')}")
    return [t.strip() for t in texts if t and t.strip()]


def span_step(
    span: Span[Any], *, max_chars: int = DEFAULT_MAX_CHARS, messages: bool = True
) -> str | None:
    """The monitor step for a finished span, or None for spans that are not agent steps."""
    data = span.span_data
    if isinstance(data, FunctionSpanData):
        lines = [f"tool {data.name}" + (f" {clip(data.input, max_chars)}" if data.input else "")]
        error = span.error
        if error is not None:
            detail = error.get("data") or {}
            why = detail.get("error") if isinstance(detail, Mapping) else None
            lines.append(
                f"-> error: {error.get('message', 'failed')}" + (f": {why}" if why else "")
            )
        elif data.output is not None:
            lines.append("-> " + clip(_text_of(data.output), max_chars))
        return "\n".join(lines)
    if not messages:
        return None
    texts: list[str] = []
    if isinstance(data, GenerationSpanData) and data.output:
        texts = _message_texts(data.output)
    elif isinstance(data, ResponseSpanData) and data.response is not None:
        texts = _message_texts(getattr(data.response, "output", None) or [])
    elif isinstance(data, HandoffSpanData):
        return f"handoff: {data.from_agent or '?'} -> {data.to_agent or '?'}"
    if not texts:
        return None
    return "assistant: " + clip("\n".join(texts), max_chars)


class MonitorTracingProcessor(TracingProcessor):
    """Routes each finished span to the AgentMonitor bound to its trace. One per process:
    `monitor_processor()`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_trace: dict[str, AgentMonitor] = {}
        # A processor given to set_trace_processors after add_trace_processor would see each span
        # twice.
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()

    def bind(self, trace_id: str, monitor: AgentMonitor) -> None:
        with self._lock:
            self._by_trace[trace_id] = monitor

    def unbind(self, monitor: AgentMonitor) -> None:
        with self._lock:
            for tid in [t for t, m in self._by_trace.items() if m is monitor]:
                del self._by_trace[tid]

    def monitor_for(self, trace_id: str) -> AgentMonitor | None:
        with self._lock:
            return self._by_trace.get(trace_id)

    def on_trace_start(self, trace: Trace) -> None:
        pass

    def on_trace_end(self, trace: Trace) -> None:
        # the run is over: forget its binding (a monitor used again rebinds in its hooks)
        with self._lock:
            self._by_trace.pop(trace.trace_id, None)

    def on_span_start(self, span: Span[Any]) -> None:
        pass

    def on_span_end(self, span: Span[Any]) -> None:
        with self._lock:
            monitor = self._by_trace.get(span.trace_id)
            if monitor is None or span.span_id in self._seen:
                return
            self._seen[span.span_id] = None
            if len(self._seen) > 4096:
                self._seen.popitem(last=False)
        monitor._on_span_end(span)

    def shutdown(self) -> None:
        pass

    def force_flush(self) -> None:
        pass


_PROCESSOR = MonitorTracingProcessor()
_installed = False
_install_lock = threading.Lock()


def monitor_processor() -> MonitorTracingProcessor:
    """The process-wide processor; include it when you call `agents.set_trace_processors([...])`."""
    return _PROCESSOR


def install() -> MonitorTracingProcessor:
    """Register the processor with the SDK (`add_trace_processor`), once per process; return it."""
    global _installed
    with _install_lock:
        if not _installed:
            add_trace_processor(_PROCESSOR)
            _installed = True
    return _PROCESSOR


class MonitorRunHooks(RunHooks[Any]):
    """Run hooks that bind the monitor to the run's trace and raise RunAborted before the next
    model or tool call."""

    def __init__(self, monitor: AgentMonitor) -> None:
        self.monitor = monitor

    async def on_agent_start(self, context: AgentHookContext[Any], agent: Agent[Any]) -> None:
        self.monitor.bind_current_trace()
        self.monitor.check()

    async def on_llm_start(
        self,
        context: RunContextWrapper[Any],
        agent: Agent[Any],
        system_prompt: str | None,
        input_items: list[Any],
    ) -> None:
        self.monitor.check()

    async def on_tool_start(
        self, context: RunContextWrapper[Any], agent: Agent[Any], tool: Tool
    ) -> None:
        self.monitor.check()


class AgentMonitor:
    """One agent run's link to the progress monitor: its steps go out, its abort comes back as
    RunAborted."""

    def __init__(
        self,
        sink: Sink,
        *,
        trace_id: str | None = None,
        messages: bool = True,
        max_chars: int = DEFAULT_MAX_CHARS,
        stop_on_abort: bool = True,
        register: bool = True,
    ) -> None:
        """`sink`: a ProgressTracker or AsyncProgressTracker (in-process scoring) or a MonitorClient
        Run (MQTT).

        `messages=False` sends tool calls only. `stop_on_abort=False` watches without ever raising.
        `register=False` leaves processor registration to you
        (`set_trace_processors([monitor_processor()])`).
        """
        if not (hasattr(sink, "submit") or hasattr(sink, "step")):
            raise TypeError(
                "sink must be a ProgressTracker, AsyncProgressTracker or client "
                f"Run, not {type(sink)}"
            )
        self.sink = sink
        self.messages = messages
        self.max_chars = max_chars
        self.stop_on_abort = stop_on_abort
        self.steps: list[str] = []
        """Every step sent to the monitor, in order."""
        self.skipped = 0
        """Steps not sent because the run had already been aborted (the monitor no longer judges
        them)."""
        self.hooks = MonitorRunHooks(self)
        """Pass as `Runner.run(..., hooks=monitor.hooks)`."""
        self._lock = threading.Lock()
        self._warned_no_trace = False
        self._processor = install() if register else _PROCESSOR
        self.trace_id = trace_id or gen_trace_id()
        """The trace this monitor follows; `RunConfig(trace_id=monitor.trace_id)` makes a run use
        it."""
        self._processor.bind(self.trace_id, self)

    def __repr__(self) -> str:
        return (
            f"AgentMonitor(trace_id={self.trace_id!r}, steps={len(self.steps)}, "
            f"signal={self.signal!r})"
        )

    # -- signals --

    def _decision(self) -> tuple[str | None, str, int | None, float | None]:
        """(signal, reason, step, score) from the sink's latest signal."""
        if hasattr(self.sink, "submit"):
            latest = self.sink.latest  # type: ignore[union-attr]
            d = latest.signal if latest is not None else None
        else:
            d = self.sink.signal  # type: ignore[union-attr]
        if d is None:
            return None, "", None, None
        return str(d.signal), str(d.reason), d.step, d.score

    @property
    def signal(self) -> str | None:
        """The monitor's latest signal for this run: `continue`, `abort`, `resample`, or None
        (none yet)."""
        return self._decision()[0]

    @property
    def should_abort(self) -> bool:
        """Whether the monitor's latest signal is `abort` (final for the run)."""
        return self.signal == "abort"

    def check(self) -> None:
        """Raise RunAborted if the monitor said abort (and `stop_on_abort`); call it between
        turns or in hooks."""
        signal, reason, step, score = self._decision()
        if signal == "abort" and self.stop_on_abort:
            raise RunAborted(reason or "abort", step=step, score=score)

    # -- steps --

    def bind_current_trace(self) -> None:
        """Follow the trace of the run in progress (called by the hooks when an agent starts)."""
        trace = get_current_trace()
        if trace is None or trace.trace_id in ("", "no-op"):
            if not self._warned_no_trace:
                self._warned_no_trace = True
                log.warning(
                    "tracing is disabled for this agent run: the progress monitor receives no steps"
                )
            return
        if trace.trace_id != self.trace_id:
            self._processor.unbind(self)
            self.trace_id = trace.trace_id
            self._processor.bind(self.trace_id, self)

    def _on_span_end(self, span: Span[Any]) -> None:
        text = span_step(span, max_chars=self.max_chars, messages=self.messages)
        if not text:
            return
        self.send(text, meta={"span": span.span_data.type})

    def send(self, text: str, *, meta: Mapping[str, Any] | None = None) -> int | None:
        """Send one step now (what the processor does per span); None if skipped after an abort
        or on error."""
        with self._lock:  # keeps steps in order when spans end on several threads
            if self.should_abort:
                self.skipped += 1
                return None
            try:
                if hasattr(self.sink, "submit"):
                    index: int = self.sink.submit(text, meta=meta)
                else:
                    index = cast("Run", self.sink).step(text, meta=meta)
            except Exception as e:  # never break the agent run because the monitor is away
                log.warning("could not send a step to the progress monitor: %s", e)
                return None
            self.steps.append(text)
            return index

    def close(self) -> None:
        """Stop following the run (the sink stays open: end the run and close the tracker
        yourself)."""
        self._processor.unbind(self)

    def __enter__(self) -> AgentMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "AgentMonitor",
    "MonitorRunHooks",
    "MonitorTracingProcessor",
    "RunAborted",
    "install",
    "monitor_processor",
    "span_step",
]

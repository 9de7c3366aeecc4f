"""The LLM API proxy's pure half: API requests and responses to conversations, turns, steps and run
keys.

Three wire formats are read: OpenAI chat completions (`/v1/chat/completions`), OpenAI responses
(`/v1/responses`) and Anthropic messages (`/v1/messages`). A request's history becomes a list of
`Item`s (user, assistant, tool; the system prompt aside), with consecutive assistant items merged
into one turn. Each assistant turn and everything the next request brings back after it (the tool
results, a user's follow-up) is a step; a turn is complete when a later item follows it. A turn
without tool calls looks final but, from a text-only (ReAct) agent, is followed by its observation
in the next request: it is held for a grace time and sent complete when that request comes, or
sent as it is after the grace (provisional) and amended by index (`step.amend`) when the
conversation goes on: the step then holds the turn and what followed it, and the steps before it
keep their prompts' prefix.

Run keys (no `X-Agent-Monitor-Run` header): `px-` and 16 hex digits of the BLAKE2b digest of the
system prompt and the first user message, so every request of one conversation (and a proxy
restarted in the middle of it) lands on the same run. Two agents on one key share it until their
histories diverge; `Conversations` then splits the second into a run of its own (`px-...-2`).

Nothing here does I/O: `_proxy` feeds it bodies, events and the time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ....extractors import clip_middle
from ....wire import MAX_STEP_CHARS, MAX_TASK_CHARS
from .._chat import Api, Item, Request, Turn, anthropic_turn, args_text, text_of
from .._protocol import Inbound

__all__ = [
    "API_OF_PATH",
    "Conversation",
    "Conversations",
    "SseParser",
    "StreamTurn",
    "error_body",
    "majority",
    "run_key",
    "sse_of",
    "steps_of",
    "turn_of_response",
    "with_turn",
]

MAX_BRANCHES = 64
"""Runs one key may split into (agents sharing a system prompt and first message); more are not
watched."""

API_OF_PATH: dict[str, Api] = {
    "/v1/chat/completions": "chat",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}


def run_key(system: str, first_user: str) -> str:
    """The stable run id of a conversation without an `X-Agent-Monitor-Run` header."""
    h = hashlib.blake2b(digest_size=8)
    h.update(json.dumps([system, first_user], ensure_ascii=False).encode())
    return f"px-{h.hexdigest()}"


def _digest(item: Item) -> bytes:
    return hashlib.blake2b(f"{item.role}\0{item.text}".encode(), digest_size=8).digest()


def _parts_of(items: Sequence[Item]) -> list[list[str]]:
    """Each assistant turn's text, then what followed it (tool results; a user's follow-up marked
    `[user]`)."""
    steps: list[list[str]] = []
    for it in items:
        if it.role == "assistant":
            steps.append([it.text])
        elif steps:
            steps[-1].append(it.text if it.role == "tool" else f"[user] {it.text}")
    return steps


def steps_of(items: Sequence[Item]) -> list[tuple[str, bool]]:
    """Each assistant turn with what follows it: (the step's text, complete: something followed
    it)."""
    return [
        (clip_middle("\n".join(s), MAX_STEP_CHARS, room=20), len(s) > 1) for s in _parts_of(items)
    ]


@dataclass(slots=True)
class Conversation:
    """One watched conversation: its run, the digests of the history seen, what was sent to the
    monitor."""

    run_id: str
    digests: list[bytes]
    explicit: bool
    started: bool = False
    sent: int = 0
    """Steps handed to the monitor (the highest index)."""
    last: float = 0.0
    stopped: str | None = None
    """Why the proxy refuses this run's requests (--enforce), once it did."""
    size: int = 0
    task: str = ""
    """The run's task and start labels (for a provisional answer sent on its own)."""
    labels: dict[str, str] = field(default_factory=dict)
    provisional: tuple[int, str, float] | None = None
    """A final-looking answer held back: (its step index, its text, when it is sent as it is)."""
    short: int = 0
    """The index of a step sent without what followed it (sent when its grace ran out, or at once
    with no grace): once the conversation goes on, it is amended to hold what followed it."""


@dataclass(slots=True)
class Conversations:
    """The live conversations: requests to runs (by header or key), splits on divergence, bounded
    and idle-expired."""

    max_conversations: int = 10_000
    idle_s: float = 3600.0
    live: OrderedDict[str, Conversation] = field(default_factory=OrderedDict)
    branches: dict[str, list[str]] = field(default_factory=dict)
    splits: int = 0
    full: int = 0

    def match(self, req: Request, header: str | None, now: float) -> Conversation | None:
        """The conversation `req` continues (a new one when none; None when the table is full)."""
        digests = [_digest(i) for i in req.items]
        if header is not None:
            conv = self.live.get(header)
            if conv is None:
                conv = self._new(header, header, digests, explicit=True, now=now)
            else:
                conv.digests = digests  # the caller says it is one run, whatever its history did
        else:
            base = run_key(req.system, req.task)
            best: Conversation | None = None
            for rid in self.branches.get(base, []):
                c = self.live[rid]
                extends = len(digests) >= len(c.digests) and digests[: len(c.digests)] == c.digests
                if extends and (best is None or len(c.digests) > len(best.digests)):
                    best = c
            if best is None:
                known = self.branches.get(base, [])
                if len(known) >= MAX_BRANCHES:
                    self.full += 1  # one key's many agents: each request compares with every branch
                    return None
                rid = base if not known else f"{base}-{self._next_branch(base)}"
                if known:
                    self.splits += 1
                conv = self._new(base, rid, digests, explicit=False, now=now)
            else:
                conv = best
                conv.digests = digests
        if conv is None:
            return None
        conv.last = now
        conv.size = 8 * len(digests)
        self.live.move_to_end(conv.run_id)
        return conv

    def _next_branch(self, base: str) -> int:
        n = 2
        while f"{base}-{n}" in self.live:
            n += 1
        return n

    def _new(
        self, base: str, rid: str, digests: list[bytes], *, explicit: bool, now: float
    ) -> Conversation | None:
        if len(self.live) >= self.max_conversations:
            self.full += 1
            return None
        conv = Conversation(rid, digests, explicit, last=now)
        self.live[rid] = conv
        self.branches.setdefault(base, []).append(rid)
        return conv

    def expire(self, now: float) -> list[Conversation]:
        """Forget conversations idle for `idle_s` (oldest first); their runs end."""
        gone: list[Conversation] = []
        while self.live:
            rid, conv = next(iter(self.live.items()))
            if now - conv.last < self.idle_s:
                break
            del self.live[rid]
            for base, rids in list(self.branches.items()):
                if rid in rids:
                    rids.remove(rid)
                    if not rids:
                        del self.branches[base]
            gone.append(conv)
        return gone

    def events(
        self,
        conv: Conversation,
        req: Request,
        final: Turn | None = None,
        *,
        now: float = 0.0,
        grace_s: float = 0.0,
    ) -> list[Inbound]:
        """The start (once, with the first step) and the steps of `req`'s history not yet sent.

        A step is an assistant turn with what followed it, sent once it is complete (something
        followed it). `final`, the response's turn when it has no tool call, looks like a final
        answer, but a text-only agent (ReAct) gets its observation in the next request: it is held
        back (provisional) for `grace_s` seconds from `now`, and sent then as it is (`due`) unless
        the next request has made it a complete step first. Its index is the history's turns + 1, so
        a retried request's answer is the same step. A step sent as it is stays provisional: when a
        request shows what followed it, an amendment replaces its text with the complete step (by
        index, before any later step), so each step holds what the agent saw and none is sent twice.
        """
        out: list[Inbound] = []
        parts = _parts_of(req.items)
        steps = [clip_middle("\n".join(p), MAX_STEP_CHARS, room=20) for p in parts if len(p) > 1]
        if conv.provisional is not None and conv.provisional[0] <= len(steps):
            conv.provisional = None  # the conversation went on: the turn is a complete step below
        # A step went out without what followed it: once a request shows that, the step is amended
        # to hold it.
        if conv.short and len(parts) >= conv.short and len(parts[conv.short - 1]) > 1:
            self._amend(conv, conv.short, steps[conv.short - 1], out)
        for index in range(conv.sent + 1, len(steps) + 1):
            self._send(conv, req, index, steps[index - 1], out)
        if final is not None and len(steps) == req.turns and conv.sent == req.turns:
            text = clip_middle(final.render(), MAX_STEP_CHARS, room=20)
            if grace_s <= 0:
                self._send(conv, req, req.turns + 1, text, out)
                conv.short = req.turns + 1
            else:
                conv.provisional = (req.turns + 1, text, now + grace_s)
                conv.task = (
                    conv.task
                    or clip_middle(req.task, MAX_TASK_CHARS, room=20)
                    or "(no user message)"
                )
                conv.labels = conv.labels or _labels(req)
        return out

    def due(self, now: float) -> list[Inbound]:
        """The provisional answers whose grace ran out, sent as they are (the conversation did
        not go on)."""
        out: list[Inbound] = []
        for conv in self.live.values():
            held = conv.provisional
            if held is not None and held[2] <= now:
                conv.provisional = None
                self._send_held(conv, held[0], held[1], out)
        return out

    def flush(self, conv: Conversation) -> list[Inbound]:
        """A conversation's provisional answer, sent now (its run is ending)."""
        out: list[Inbound] = []
        held, conv.provisional = conv.provisional, None
        if held is not None:
            self._send_held(conv, held[0], held[1], out)
        return out

    def _send_held(self, conv: Conversation, index: int, text: str, out: list[Inbound]) -> None:
        if index == conv.sent + 1:
            self._open(conv, conv.task, conv.labels, out)
            self._step(conv, index, text, out)
            conv.short = index

    def _send(
        self, conv: Conversation, req: Request, index: int, text: str, out: list[Inbound]
    ) -> None:
        self._open(
            conv,
            clip_middle(req.task, MAX_TASK_CHARS, room=20) or "(no user message)",
            _labels(req),
            out,
        )
        self._step(conv, index, text, out)

    @staticmethod
    def _step(conv: Conversation, index: int, text: str, out: list[Inbound]) -> None:
        out.append(
            Inbound(
                conv.run_id, "step", {"index": index, "text": text}, key=f"{conv.run_id}:{index}"
            )
        )
        conv.sent = index

    @staticmethod
    def _amend(conv: Conversation, index: int, text: str, out: list[Inbound]) -> None:
        """Step `index`, sent without what followed it, replaced by the complete step (its text
        by index)."""
        data = {"index": index, "text": text, "amend": True}
        digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
        out.append(Inbound(conv.run_id, "step", data, key=f"{conv.run_id}:{index}:amend:{digest}"))
        conv.short = 0

    @staticmethod
    def _open(conv: Conversation, task: str, labels: Mapping[str, str], out: list[Inbound]) -> None:
        if not conv.started:
            out.append(
                Inbound(
                    conv.run_id,
                    "start",
                    {"task": task, "labels": dict(labels)},
                    key=f"{conv.run_id}:start",
                )
            )
            conv.started = True


def _labels(req: Request) -> dict[str, str]:
    labels = {"source": "proxy", "api": req.api}
    if req.model:
        labels["model"] = req.model
    return labels


# Responses.


def turn_of_response(api: Api, body: Any, choice: int = 0) -> Turn | None:
    """The assistant turn of a non-streamed response (its `choice`-th for chat); None when it has
    none."""
    if not isinstance(body, Mapping):
        return None
    if api == "chat":
        choices = body.get("choices")
        if (
            not isinstance(choices, list)
            or len(choices) <= choice
            or not isinstance(choices[choice], Mapping)
        ):
            return None
        m = choices[choice].get("message") or {}
        chat_calls = tuple(
            (
                str((c.get("function") or {}).get("name", "")),
                args_text((c.get("function") or {}).get("arguments", "")),
            )
            for c in m.get("tool_calls") or []
            if isinstance(c, Mapping)
        )
        return Turn(text_of(m.get("content")), chat_calls)
    if api == "messages":
        content = body.get("content")
        return anthropic_turn(content) if isinstance(content, list) else None
    output = body.get("output")
    if not isinstance(output, list):
        return None
    text: list[str] = []
    calls: list[tuple[str, str]] = []
    for it in output:
        if not isinstance(it, Mapping):
            continue
        if it.get("type") == "message":
            text.append(text_of(it.get("content")))
        elif it.get("type") == "function_call":
            calls.append((str(it.get("name", "")), args_text(it.get("arguments", ""))))
    return Turn("\n".join(t for t in text if t), tuple(calls))


class SseParser:
    """Server-sent events from byte chunks as they come: (event name, data) per complete event."""

    def __init__(self, max_event_bytes: int = 16 * 1024 * 1024) -> None:
        self._buf = b""
        self.max_event_bytes = max_event_bytes
        self.overflow = False

    def feed(self, chunk: bytes) -> list[tuple[str, str]]:
        """The events `chunk` completes."""
        self._buf += chunk.replace(b"\r\n", b"\n") if b"\r" in chunk else chunk
        out: list[tuple[str, str]] = []
        while (end := self._buf.find(b"\n\n")) >= 0:
            raw, self._buf = self._buf[:end], self._buf[end + 2 :]
            name, data = "message", []
            for line in raw.decode("utf-8", "replace").split("\n"):
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].removeprefix(" "))
            if data:
                out.append((name, "\n".join(data)))
        if len(self._buf) > self.max_event_bytes:
            # one event past the bound: the turn is not read, the stream flows
            self._buf, self.overflow = b"", True
        return out


class StreamTurn:
    """The assistant turn a streamed response builds, from its server-sent events."""

    def __init__(self, api: Api, max_bytes: int = 16 * 1024 * 1024) -> None:
        self.api = api
        self.parser = SseParser(max_bytes)
        self.max_bytes = max_bytes
        self.size = 0
        self._text: list[str] = []
        self._calls: dict[int, list[str]] = {}
        self._names: dict[int, str] = {}
        self._done: Turn | None = None
        self.bad = False

    def feed(self, chunk: bytes) -> None:
        """Read the events `chunk` completes (past `max_bytes` of stream, nothing more: the turn
        is not read)."""
        self.size += len(chunk)
        if self.bad or self.size > self.max_bytes:
            self.bad = True
            return
        for name, data in self.parser.feed(chunk):
            if data == "[DONE]":
                continue
            try:
                event = json.loads(data)
            except ValueError:
                self.bad = True
                continue
            if isinstance(event, Mapping):
                self._event(name, event)

    def _event(self, name: str, e: Mapping[str, Any]) -> None:
        if self.api == "chat":
            choices = e.get("choices") or []
            for c in choices:
                if not isinstance(c, Mapping) or c.get("index", 0) != 0:
                    continue
                d = c.get("delta") or {}
                if isinstance(d.get("content"), str):
                    self._text.append(d["content"])
                for tc in d.get("tool_calls") or []:
                    i = int(tc.get("index", 0))
                    f = tc.get("function") or {}
                    if f.get("name"):
                        self._names[i] = self._names.get(i, "") + str(f["name"])
                    self._calls.setdefault(i, []).append(str(f.get("arguments") or ""))
        elif self.api == "messages":
            kind = e.get("type", name)
            if kind == "content_block_start":
                b = e.get("content_block") or {}
                if b.get("type") in ("tool_use", "server_tool_use"):
                    i = int(e.get("index", 0))
                    self._names[i] = str(b.get("name", ""))
                    self._calls[i] = []
                elif b.get("type") == "text" and b.get("text"):
                    self._text.append(str(b["text"]))
            elif kind == "content_block_delta":
                d = e.get("delta") or {}
                if d.get("type") == "text_delta":
                    self._text.append(str(d.get("text", "")))
                elif d.get("type") == "input_json_delta":
                    self._calls.setdefault(int(e.get("index", 0)), []).append(
                        str(d.get("partial_json", ""))
                    )
        elif e.get("type", name) in ("response.completed", "response.incomplete"):
            self._done = turn_of_response("responses", e.get("response"))

    def turn(self) -> Turn | None:
        """The turn read so far (None: an unreadable stream)."""
        if self.parser.overflow or self.bad:
            return None
        if self.api == "responses":
            return self._done
        calls = []
        for i in sorted(self._calls):
            args = "".join(self._calls[i])
            if self.api == "messages":
                # Anthropic streams the input as JSON pieces; the history sends it back as an
                # object.
                with contextlib.suppress(ValueError):
                    args = args_text(json.loads(args or "{}"))
            calls.append((self._names.get(i, ""), args))
        return Turn("".join(self._text), tuple(calls))


# Errors and best-of shapes.


def error_body(api: Api, message: str, kind: str = "conflict") -> bytes:
    """An error body in the API's own format (OpenAI's `{"error": ...}`, Anthropic's `{"type":
    "error", ...}`)."""
    if api == "messages":
        body: dict[str, Any] = {
            "type": "error",
            "error": {"type": f"{kind}_error", "message": message},
        }
    else:
        body = {
            "error": {
                "message": message,
                "type": f"{kind}_error",
                "param": None,
                "code": f"agent_monitor_{kind}",
            }
        }
    return json.dumps(body).encode()


def majority(turns: Sequence[Turn | None]) -> int | None:
    """The first candidate of a strict majority of identical turns (whitespace aside); None when
    there is none."""
    keys = [None if t is None else (" ".join(t.text.split()), t.calls) for t in turns]
    for i, k in enumerate(keys):
        if k is not None and sum(k == o for o in keys) * 2 > len(keys):
            return i
    return None


def with_turn(api: Api, candidates: Sequence[Mapping[str, Any]], winner: int) -> dict[str, Any]:
    """The response the client gets: the winning candidate in the API's normal shape (chat: as
    choice 0)."""
    if api == "chat" and len(candidates) == 1:
        body = dict(candidates[0])
        chosen = dict(body["choices"][winner])
        chosen["index"] = 0
        body["choices"] = [chosen]
        return body
    return dict(candidates[winner])


def _sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def sse_of(api: Api, body: Mapping[str, Any]) -> Iterator[bytes]:
    """A complete response replayed as its API's stream of server-sent events (best-of, streamed
    after the choice)."""
    if api == "chat":
        base = {
            k: body.get(k) for k in ("id", "created", "model", "system_fingerprint") if k in body
        }
        base["object"] = "chat.completion.chunk"
        choice = body["choices"][0]
        m = choice.get("message") or {}
        delta: dict[str, Any] = {"role": "assistant", "content": m.get("content")}
        if m.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(m["tool_calls"])]
        yield _sse({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
        yield _sse(
            {
                **base,
                "choices": [
                    {"index": 0, "delta": {}, "finish_reason": choice.get("finish_reason")}
                ],
            }
        )
        if body.get("usage") is not None:
            yield _sse({**base, "choices": [], "usage": body["usage"]})
        yield b"data: [DONE]\n\n"
    elif api == "messages":
        start = {
            k: v for k, v in body.items() if k not in ("content", "stop_reason", "stop_sequence")
        }
        yield _sse(
            {
                "type": "message_start",
                "message": {**start, "content": [], "stop_reason": None, "stop_sequence": None},
            },
            "message_start",
        )
        for i, b in enumerate(body.get("content") or []):
            if b.get("type") == "tool_use":
                head = {**b, "input": {}}
                delta = {"type": "input_json_delta", "partial_json": json.dumps(b.get("input", {}))}
            elif b.get("type") == "text":
                head = {**b, "text": ""}
                delta = {"type": "text_delta", "text": b.get("text", "")}
            else:
                head, delta = dict(b), {}
            yield _sse(
                {"type": "content_block_start", "index": i, "content_block": head},
                "content_block_start",
            )
            if delta:
                yield _sse(
                    {"type": "content_block_delta", "index": i, "delta": delta},
                    "content_block_delta",
                )
            yield _sse({"type": "content_block_stop", "index": i}, "content_block_stop")
        yield _sse(
            {
                "type": "message_delta",
                "delta": {
                    "stop_reason": body.get("stop_reason"),
                    "stop_sequence": body.get("stop_sequence"),
                },
                "usage": {"output_tokens": (body.get("usage") or {}).get("output_tokens", 0)},
            },
            "message_delta",
        )
        yield _sse({"type": "message_stop"}, "message_stop")
    else:
        seq = iter(range(1 << 30))
        pending = {**body, "status": "in_progress", "output": []}
        yield _sse(
            {"type": "response.created", "sequence_number": next(seq), "response": pending},
            "response.created",
        )
        for i, item in enumerate(body.get("output") or []):
            yield _sse(
                {
                    "type": "response.output_item.added",
                    "sequence_number": next(seq),
                    "output_index": i,
                    "item": item,
                },
                "response.output_item.added",
            )
            if item.get("type") == "message":
                for j, part in enumerate(item.get("content") or []):
                    if part.get("type") == "output_text":
                        yield _sse(
                            {
                                "type": "response.output_text.delta",
                                "sequence_number": next(seq),
                                "item_id": item.get("id", ""),
                                "output_index": i,
                                "content_index": j,
                                "delta": part.get("text", ""),
                                "logprobs": [],
                            },
                            "response.output_text.delta",
                        )
            yield _sse(
                {
                    "type": "response.output_item.done",
                    "sequence_number": next(seq),
                    "output_index": i,
                    "item": item,
                },
                "response.output_item.done",
            )
        yield _sse(
            {"type": "response.completed", "sequence_number": next(seq), "response": body},
            "response.completed",
        )

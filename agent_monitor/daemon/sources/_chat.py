"""Chat conversations as the doors read them: the three LLM APIs' request bodies as role-tagged
items.

OpenAI chat completions, OpenAI responses and Anthropic messages: a request's history becomes a list
of `Item`s (user, assistant, tool; the system prompt aside), with consecutive assistant items merged
into one turn. The LLM proxy reads every request so; the reward door reads a trainer's chat messages
so.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ...wire import MAX_LABEL_VALUE_CHARS

__all__ = [
    "Api",
    "FormatError",
    "Item",
    "Request",
    "Role",
    "Turn",
    "anthropic_turn",
    "args_text",
    "parse_request",
    "text_of",
]

Api = Literal["chat", "responses", "messages"]
Role = Literal["user", "assistant", "tool"]


@dataclass(frozen=True, slots=True)
class Item:
    """One message of a conversation as text: who said it and what (tool calls and results
    rendered)."""

    role: Role
    text: str


@dataclass(frozen=True, slots=True)
class Turn:
    """One assistant turn: its text and its tool calls (name, arguments as JSON text)."""

    text: str
    calls: tuple[tuple[str, str], ...] = ()

    @property
    def final(self) -> bool:
        """A turn without tool calls: the agent waits for no tool result, so it is a step at
        once."""
        return not self.calls

    def render(self) -> str:
        """The turn as a step's text (and as a history item's, so both digest alike)."""
        lines = [self.text] if self.text else []
        lines += [f"[tool call] {name}({args})" for name, args in self.calls]
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Request:
    """What the proxy reads from one API request."""

    api: Api
    system: str
    items: tuple[Item, ...]
    model: str
    stream: bool
    n: int

    @property
    def task(self) -> str:
        """The first user message (the run's task); empty when there is none."""
        return next((i.text for i in self.items if i.role == "user"), "")

    @property
    def turns(self) -> int:
        """Assistant turns in the history: the response's turn is the next one."""
        return sum(i.role == "assistant" for i in self.items)


class FormatError(ValueError):
    """A request body that cannot be read as its API's (the proxy forwards it anyway, unwatched)."""


def text_of(content: Any) -> str:
    """Text of a message's content: a string, or the text of its parts (images as a placeholder)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Mapping):
        content = [content]
    if not isinstance(content, list):
        return str(content)
    out: list[str] = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, Mapping):
            kind = part.get("type")
            if isinstance(part.get("text"), str):
                out.append(part["text"])
            elif kind in ("image", "image_url", "input_image"):
                out.append("[image]")
            elif kind == "tool_result":
                out.append(text_of(part.get("content")))
            elif isinstance(part.get("content"), (str, list)):
                out.append(text_of(part["content"]))
    return "\n".join(s for s in out if s)


def args_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _merge(items: list[Item]) -> tuple[Item, ...]:
    """Consecutive assistant items are one turn (responses' message then function calls)."""
    out: list[Item] = []
    for it in items:
        if it.role == "assistant" and out and out[-1].role == "assistant":
            out[-1] = Item("assistant", f"{out[-1].text}\n{it.text}" if out[-1].text else it.text)
        elif it.text or it.role == "assistant":
            out.append(it)
    return tuple(out)


def _chat_items(body: Mapping[str, Any]) -> tuple[str, list[Item]]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise FormatError("messages is not a list")
    system: list[str] = []
    items: list[Item] = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise FormatError("a message is not an object")
        role = m.get("role")
        if role in ("system", "developer"):
            system.append(text_of(m.get("content")))
        elif role == "user":
            items.append(Item("user", text_of(m.get("content"))))
        elif role == "assistant":
            calls = []
            for c in m.get("tool_calls") or []:
                f = c.get("function") or {} if isinstance(c, Mapping) else {}
                calls.append((str(f.get("name", "")), args_text(f.get("arguments", ""))))
            if isinstance(m.get("function_call"), Mapping):
                f = m["function_call"]
                calls.append((str(f.get("name", "")), args_text(f.get("arguments", ""))))
            items.append(Item("assistant", Turn(text_of(m.get("content")), tuple(calls)).render()))
        elif role in ("tool", "function"):
            items.append(Item("tool", f"[tool result] {text_of(m.get('content'))}"))
    return "\n".join(system), items


def _messages_items(body: Mapping[str, Any]) -> tuple[str, list[Item]]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise FormatError("messages is not a list")
    items: list[Item] = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise FormatError("a message is not an object")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise FormatError("a message's content is neither text nor a list of blocks")
        if m.get("role") == "assistant":
            items.append(Item("assistant", anthropic_turn(blocks).render()))
            continue
        said = [
            b for b in blocks if not (isinstance(b, Mapping) and b.get("type") == "tool_result")
        ]
        for b in blocks:
            if isinstance(b, Mapping) and b.get("type") == "tool_result":
                items.append(Item("tool", f"[tool result] {text_of(b.get('content'))}"))
        if said:
            items.append(Item("user", text_of(said)))
    return text_of(body.get("system")), items


def anthropic_turn(blocks: Sequence[Any]) -> Turn:
    text: list[str] = []
    calls: list[tuple[str, str]] = []
    for b in blocks:
        if not isinstance(b, Mapping):
            continue
        if b.get("type") == "text":
            text.append(str(b.get("text", "")))
        elif b.get("type") in ("tool_use", "server_tool_use"):
            calls.append((str(b.get("name", "")), args_text(b.get("input", {}))))
    return Turn("\n".join(t for t in text if t), tuple(calls))


def _responses_items(body: Mapping[str, Any]) -> tuple[str, list[Item]]:
    system = [text_of(body.get("instructions"))]
    raw = body.get("input")
    if isinstance(raw, str):
        return system[0], [Item("user", raw)]
    if not isinstance(raw, list):
        raise FormatError("input is neither text nor a list of items")
    items: list[Item] = []
    for it in raw:
        if not isinstance(it, Mapping):
            raise FormatError("an input item is not an object")
        kind, role = it.get("type"), it.get("role")
        if role in ("system", "developer"):
            system.append(text_of(it.get("content")))
        elif role == "user":
            items.append(Item("user", text_of(it.get("content"))))
        elif role == "assistant":
            items.append(Item("assistant", text_of(it.get("content"))))
        elif kind == "function_call":
            items.append(
                Item(
                    "assistant",
                    Turn(
                        "", ((str(it.get("name", "")), args_text(it.get("arguments", ""))),)
                    ).render(),
                )
            )
        elif kind == "function_call_output":
            items.append(Item("tool", f"[tool result] {text_of(it.get('output'))}"))
    return "\n".join(s for s in system if s), items


def parse_request(api: Api, body: Any) -> Request:
    """The conversation a request body carries; FormatError when it is not that API's request."""
    if not isinstance(body, Mapping):
        raise FormatError("the body is not a JSON object")
    reader = {"chat": _chat_items, "messages": _messages_items, "responses": _responses_items}[api]
    system, items = reader(body)
    n = body.get("n", 1)
    return Request(
        api=api,
        system=system,
        items=_merge(items),
        model=str(body.get("model", ""))[:MAX_LABEL_VALUE_CHARS],
        stream=body.get("stream") is True,
        n=n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1,
    )

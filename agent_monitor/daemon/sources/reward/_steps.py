"""The reward endpoints' pure half: a trainer's finished rollout (template text or chat messages) to
a task and steps.

The rules, one per shape a trainer sends (docs/rl.md, "Steps"):

- **Chat messages** (slime's `prompt` as a list, the native endpoint's `messages`): read as the LLM
  proxy reads a chat completions request (`sources._chat.parse_request`); the first user message is
  the task, each assistant turn with the tool results and user messages after it is a step (as the
  proxy's `steps_of` makes them).
- **Template text** (OpenRLHF's `query`: the prompt and the response decoded with their special
  tokens; slime's `prompt` as a string and its `response`): the text is cut into chat-template turns
  at ChatML (`<|im_start|>role ... <|im_end|>`), Llama 3 (`<|start_header_id|>role<|end_header_id|>
  ... <|eot_id|>`) and Gemma (`<start_of_turn>role ... <end_of_turn>`) markers; the first user turn
  is the task; each assistant turn with what follows it is a step, as for chat messages.
- **Tool-call blocks**: an assistant turn (or a response with no markers at all) holding several
  `<tool_call>...</tool_call>` blocks (Hermes / Qwen style) is cut after each block, the
  `<tool_response>` / `<tool_result>` / `<observation>` block after it joining its step: one step
  per tool call, and the text after the last one a step of its own.
- Anything else is one step: the whole response.

More than `max_steps` steps: the ones past it are joined into the last (the judge still reads all of
it; the work one rollout causes stays bounded).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ....extractors import clip_middle
from ....wire import MAX_STEP_CHARS, MAX_TASK_CHARS
from .._chat import Item, Role, parse_request

__all__ = ["Rollout", "RolloutError", "from_messages", "from_text", "split_response"]

_TURN = re.compile(
    r"<\|im_start\|>(?P<a>[a-z_]+)\n?"  # ChatML (Qwen, many others)
    r"|<\|start_header_id\|>(?P<b>[a-z_]+)<\|end_header_id\|>\n*"  # Llama 3
    r"|<start_of_turn>(?P<c>[a-z_]+)\n?"  # Gemma
)
_END = re.compile(
    r"<\|im_end\|>|<\|eot_id\|>|<end_of_turn>|<\|endoftext\|>|<\|end_of_text\|>|<eos>|</s>"
)
_BOS = re.compile(r"<\|begin_of_text\|>|<bos>|<s>")
_CALL = re.compile(r"<tool_call>.*?</tool_call>", re.S)
_RESULT = re.compile(r"\s*<(tool_response|tool_result|observation)>.*?</\1>", re.S)
# A template's role names as the proxy's roles; None: the system prompt, which is not the
# trajectory.
_ROLES: dict[str, Role | None] = {
    "system": None,
    "developer": None,
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "model": "assistant",
    "gpt": "assistant",
    "tool": "tool",
    "ipython": "tool",
    "function": "tool",
}


class RolloutError(ValueError):
    """A rollout that cannot be read as a task and steps: what was wrong (the endpoint answers
    400/422 with it)."""


@dataclass(frozen=True, slots=True)
class Rollout:
    """A finished rollout as a run: its task and its steps' texts, in order."""

    task: str
    steps: tuple[str, ...]
    rule: str
    """Which rule split it ("messages", "template", "tool_calls", "whole"): said in the answer's
    extra logs."""


def _bounded(steps: Sequence[str], max_steps: int) -> tuple[str, ...]:
    steps = [s for s in steps if s.strip()]
    if len(steps) > max_steps:
        steps = [*steps[: max_steps - 1], "\n".join(steps[max_steps - 1 :])]
    return tuple(clip_middle(s, MAX_STEP_CHARS, room=20) for s in steps)


def _turns(text: str) -> list[Item] | None:
    """The chat-template turns of a text, or None when it has no turn markers."""
    marks = list(_TURN.finditer(text))
    if not marks:
        return None
    items: list[Item] = []
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        body = _END.sub("", text[m.end() : end]).strip()
        role = _ROLES.get(m.group("a") or m.group("b") or m.group("c") or "", "user")
        if role == "user" and body.startswith("<tool_response>"):
            role = "tool"  # Qwen's template sends tool results back in a user turn
        if role is not None:  # the system prompt is not the trajectory
            items.append(Item(role, body if role != "tool" else f"[tool result] {body}"))
    return items


def split_response(text: str) -> tuple[list[str], str]:
    """One assistant response's steps: one per tool-call block (its result with it), else the
    whole text."""
    text = _END.sub("", text).strip()
    calls = list(_CALL.finditer(text))
    if not calls:
        return ([text] if text else []), "whole"
    steps, at = [], 0
    for m in calls:
        end = m.end()
        if (r := _RESULT.match(text, end)) is not None:
            end = r.end()
        steps.append(text[at:end].strip())
        at = end
    if text[at:].strip():
        steps.append(text[at:].strip())
    return steps, "tool_calls"


def _steps_of_items(items: Sequence[Item]) -> tuple[list[str], str]:
    """Steps of turns: each assistant turn (cut at its tool calls) with what follows it, as the
    proxy's."""
    steps: list[list[str]] = []
    rule = "template"
    for it in items:
        if it.role == "assistant":
            parts, how = split_response(it.text)
            rule = "tool_calls" if how == "tool_calls" else rule
            steps += [[p] for p in parts] or [["(an empty turn)"]]
        # what comes back after a turn (tool results, the user's follow-up) is part of its step
        elif steps:
            steps[-1].append(it.text if it.role == "tool" else f"[user] {it.text}")
    return ["\n".join(s) for s in steps], rule


def from_text(text: str, *, prompt: str | None = None, max_steps: int) -> Rollout:
    """A rollout given as template text: `text` the whole query (prompt and response) or, with
    `prompt`, the response."""
    if not isinstance(text, str):
        raise RolloutError(f"expected the rollout as a string, got {type(text).__name__}")
    text = _BOS.sub("", text)
    if prompt is not None:
        prompt = _BOS.sub("", prompt)
        if text.startswith(prompt):
            text = text[len(prompt) :]  # OpenRLHF's query: the prompt's text, then the response's
        whole = f"{prompt}{text}"
    else:
        whole = text
    items = _turns(whole)
    if items is not None and any(i.role == "assistant" for i in items):
        task = next((i.text for i in items if i.role == "user"), "")
        steps, rule = _steps_of_items(items)
        # A response after the last marker without its own (a template whose generation prompt was
        # cut) is a step.
        if not steps and (tail := text.strip()):
            steps, rule = split_response(tail)
    else:
        # No assistant turn marked: the prompt (its user turn when marked) is the task, the rest the
        # response.
        ptext = prompt if prompt is not None else ""
        pitems = _turns(ptext) if ptext else None
        task = (
            next((i.text for i in pitems if i.role == "user"), "")
            if pitems
            else _END.sub("", ptext).strip()
        )
        steps, rule = split_response(text)
    if not task.strip():
        task = "(the prompt gave no user message)"
    if not steps:
        raise RolloutError("the rollout has no response text to score (an empty generation?)")
    return Rollout(clip_middle(task, MAX_TASK_CHARS, room=20), _bounded(steps, max_steps), rule)


def from_messages(messages: Any, *, response: str | None = None, max_steps: int) -> Rollout:
    """A rollout given as chat messages (OpenAI chat form), with an optional last response as
    text."""
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        raise RolloutError("expected messages as a list of {role, content} objects")
    body: dict[str, Any] = {"messages": list(messages)}
    if response:
        body["messages"].append({"role": "assistant", "content": response})
    try:
        request = parse_request("chat", body)
    except ValueError as e:
        raise RolloutError(f"the messages cannot be read as chat messages: {e}") from None
    task = request.task or "(the messages hold no user message)"
    steps, rule = _steps_of_items(request.items)
    if not steps:
        raise RolloutError("the messages hold no assistant turn to score")
    return Rollout(
        clip_middle(task, MAX_TASK_CHARS, room=20),
        _bounded(steps, max_steps),
        "messages" if rule == "template" else rule,
    )

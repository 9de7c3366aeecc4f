"""judge-server's parts that need no model: the slot queue, the answer shapes as OpenAIJudge reads
them, crash reports.

The server with a real model is tested in test_judge_server (slow); these pin the logic around it.
"""

from __future__ import annotations

import asyncio
import math
import signal

import pytest

from agent_monitor.daemon.judge_server._server import (
    BadRequest,
    _chat_logprobs,
    _completion_logprobs,
    _messages,
    _Slots,
)
from agent_monitor.daemon.judge_server._slots import TopToken
from agent_monitor.judges.llamacpp import crash_explanation
from agent_monitor.judges.openai import _chat_sample, _completion_sample


class FakeSlot:
    """Stands in for a Slot in the queue: the tokens it holds and when it was last used."""

    def __init__(self, held: list[int], last_used: float = 0.0) -> None:
        self._held = held
        self.last_used = last_used

    def held(self) -> list[int]:
        return self._held


async def test_a_request_takes_the_free_slot_with_the_longest_shared_prefix() -> None:
    a, b, c = FakeSlot([1, 2, 3], 5.0), FakeSlot([1, 9], 1.0), FakeSlot([], 0.0)
    slots = _Slots([a, b, c], queue=0)  # type: ignore[list-item]
    assert await slots.take([1, 2, 3, 4]) is a
    assert await slots.take([7]) is c  # no prefix shared anywhere: the least recently used
    assert await slots.take([7]) is b


async def test_requests_wait_up_to_the_queue_then_get_503_and_a_leaving_waiter_passes_its_turn_on() -> (  # noqa: E501 (the test's name is its sentence)
    None
):
    only = FakeSlot([])
    slots = _Slots([only], queue=2)  # type: ignore[list-item]
    taken = await slots.take([1])
    first = asyncio.create_task(slots.take([1]))
    second = asyncio.create_task(slots.take([1]))
    await asyncio.sleep(0)
    with pytest.raises(BadRequest) as busy:
        await slots.take([1])
    assert busy.value.status == 503 and "every slot is busy and 2 requests are waiting" in str(
        busy.value
    )
    slots.give(taken)  # wakes the first waiter ...
    first.cancel()  # ... which leaves before it runs: the slot must go to the second
    assert await asyncio.wait_for(second, 1.0) is only
    assert first.cancelled() and not slots.waiting


def test_the_answer_shapes_read_back_as_the_openai_judge_reads_them() -> None:
    chosen = [TopToken(" K", b" K", -0.5)]
    top = [[TopToken(" K", b" K", -0.5), TopToken(" L", b" L", -1.5), TopToken(" K", b" K", -9.0)]]
    sample = _completion_sample({"logprobs": _completion_logprobs(chosen, top)})
    # Two ids spelled alike keep the likelier logprob (listed first), as a {token: logprob} map
    # must.
    assert sample == {" K": -0.5, " L": -1.5}
    chat = _chat_sample({"logprobs": {"content": _chat_logprobs(chosen, top)}})
    assert chat is not None and math.isclose(chat[" L"], -1.5) and chat[" K"] == -0.5


def test_chat_content_parts_are_text_or_a_clear_refusal() -> None:
    assert _messages(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ]
    ) == [("user", "ab")]
    with pytest.raises(BadRequest, match="image input is not supported"):
        _messages(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
        )
    with pytest.raises(BadRequest, match="non-empty list"):
        _messages([])
    with pytest.raises(BadRequest, match=r"messages\[0\] must be an object"):
        _messages([{"content": "no role"}])


def test_a_crash_report_names_the_signal_the_cause_and_the_way_around() -> None:
    for code in (-signal.SIGSEGV, 128 + signal.SIGSEGV):
        why = crash_explanation(code, "the judge")
        assert why is not None and why.startswith("the judge died from SIGSEGV (signal 11)")
        assert "weight repacking" in why and "agent-monitor judge-server" in why
    assert "SIGILL" in (crash_explanation(-signal.SIGILL, "x") or "")
    assert "SIGBUS" in (crash_explanation(-signal.SIGBUS, "x") or "")
    # An ordinary exit, a stop on request or a still running process is no crash.
    for code in (None, 0, 1, 2, -signal.SIGTERM, 128 + signal.SIGTERM, -signal.SIGKILL):
        assert crash_explanation(code, "x") is None

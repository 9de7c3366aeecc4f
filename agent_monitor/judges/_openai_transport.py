"""How `OpenAIJudge`'s requests go out: pooled keep-alive HTTP/1.1 (lean) or the `openai` SDK,
behind one seam.

The judge decides what to ask (the request body) and how to read the answer; a transport sends one
body to one path and hands back the reply as it came (`WireReply`: status, headers, body, URL), or
raises: `StatusError` for an HTTP error status (the judge first asks whether it refuses images),
`JudgeError` for a timeout or a connection that failed. Both transports send the same JSON body.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any, Protocol, cast

import openai
from openai import AsyncOpenAI

from .._runtime.http_client import WireConnectionError, WirePool, WireReply, WireTimeout
from .base import JudgeError, context_refusal, retry_after_seconds

__all__ = ["LeanTransport", "Limits", "SdkTransport", "StatusError", "Transport", "sdk_error"]


class Transport(Protocol):
    """Sends one request body and returns the reply as it came; `StatusError` for an HTTP error
    status."""

    async def send(self, path: str, body: Mapping[str, Any] | None) -> WireReply:
        """POST `body` as JSON to `path` (under the base URL), or GET `path` when `body` is None."""
        ...

    async def aclose(self) -> None:
        """Release what this transport holds (connections)."""
        ...


class Limits(Protocol):
    """The judge's limits, read when used: the CLI may set `concurrency` after the judge is
    built."""

    timeout_s: float
    concurrency: int


class StatusError(Exception):
    """An HTTP error status, before it is known whether it is an image refusal.

    `server_message` is what the server wrote (an image refusal is read from it); `message` is what
    the JudgeError says (the SDK's own wording on the SDK path, the server's on the lean path).
    """

    def __init__(
        self,
        status: int,
        server_message: str,
        headers: Mapping[str, str],
        message: str | None = None,
    ) -> None:
        super().__init__(f"HTTP {status}: {server_message}")
        self.status = status
        self.server_message = server_message
        self.headers = headers
        self.message = server_message if message is None else message

    def judge_error(self) -> JudgeError:
        """The JudgeError for this status: its reason, whether it is retried, and the server's hint.

        A context-length refusal is read from what the server wrote (with its fields, which the
        SDK's wording lacks).
        """
        return context_refusal(self.status, self.server_message) or _status_error(
            self.status, self.message, self.headers
        )


class LeanTransport:
    """One JSON body over pooled keep-alive HTTP/1.1 connections (h11 on asyncio streams), the
    reply as it came."""

    def __init__(self, base_url: str, api_key: str | None, limits: Limits) -> None:
        self.base_url = base_url
        self._headers = {
            "Content-Type": "application/json",
            "Accept": "application/json",
            "User-Agent": "agent-monitor",
        }
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._limits = limits
        self.pool: WirePool | None = None
        """The keep-alive connections, made on first use in the event loop that uses them."""
        self._pool_loop: asyncio.AbstractEventLoop | None = None

    def _wire(self) -> WirePool:
        """The keep-alive connections of this event loop (a judge serves one loop at a time: see
        BaseJudge)."""
        loop = asyncio.get_running_loop()
        if self.pool is None or self._pool_loop is not loop:
            # Twice the judge's concurrency: repeats fall back to single requests side by side.
            self.pool = WirePool(
                self.base_url, headers=self._headers, max_connections=2 * self._limits.concurrency
            )
            self._pool_loop = loop
        return self.pool

    async def send(self, path: str, body: Mapping[str, Any] | None) -> WireReply:
        """One request; a transport failure is a JudgeError, an error status a StatusError."""
        data = None if body is None else json.dumps(body, ensure_ascii=False).encode()
        try:
            reply = await self._wire().request(
                "GET" if data is None else "POST", path, data, timeout_s=self._limits.timeout_s
            )
        except WireTimeout:
            raise JudgeError(
                "timeout",
                f"the judge server at {self.base_url} did not answer in time",
                retryable=True,
            ) from None
        except WireConnectionError as e:
            raise JudgeError(
                "connection",
                f"cannot reach the judge server at {self.base_url} ({e}); is it running there?",
                retryable=True,
            ) from None
        if reply.status >= 400:
            raise StatusError(reply.status, _reply_message(reply), reply.headers)
        return reply

    async def aclose(self) -> None:
        """Close the pooled connections."""
        if self.pool is not None:
            pool, self.pool = self.pool, None
            await pool.aclose()


class SdkTransport:
    """The same body through the `openai` SDK's endpoints (its HTTP client, settings, Azure
    routing), read raw.

    The body's model and messages (or prompt) go as the endpoint's arguments and every other field
    as `extra_body`, which the SDK merges into the JSON it sends: the body on the wire is the lean
    path's. The reply is taken raw (`with_raw_response`) and read as JSON by the judge, not parsed
    into the SDK's models.
    """

    def __init__(self, client: AsyncOpenAI, base_url: str) -> None:
        self.client = client
        self.base_url = base_url

    async def send(self, path: str, body: Mapping[str, Any] | None) -> WireReply:
        """One request through the SDK; its errors become a StatusError or a JudgeError."""
        try:
            if body is None:
                if path != "/models":
                    raise ValueError(f"the SDK transport reads only /models, not {path}")
                raw: Any = await self.client.models.with_raw_response.list()
            else:
                fields = dict(body)
                model = fields.pop("model")
                if path == "/completions":
                    raw = await self.client.completions.with_raw_response.create(
                        model=model, prompt=fields.pop("prompt"), extra_body=fields
                    )
                elif path == "/chat/completions":
                    raw = await self.client.chat.completions.with_raw_response.create(
                        model=model, messages=cast(Any, fields.pop("messages")), extra_body=fields
                    )
                else:
                    raise ValueError(
                        f"the SDK transport posts to /completions or /chat/completions, not {path}"
                    )
        except openai.APIStatusError as e:
            said = _message_in(e.body)
            raise StatusError(
                e.status_code, said or _bounded(e.message), e.response.headers, _bounded(e.message)
            ) from None
        except openai.OpenAIError as e:
            raise sdk_error(e, self.base_url) from None
        response = raw.http_response
        return WireReply(
            response.status_code,
            dict(response.headers),
            response.content,
            str(response.request.url),
        )

    async def aclose(self) -> None:
        """Nothing of its own to release: the client belongs to the judge (or to whoever passed
        it in)."""


def sdk_error(e: openai.OpenAIError, where: str) -> JudgeError:
    """The JudgeError for an SDK failure: a timeout, a connection, an HTTP error status, or
    another client error."""
    if isinstance(e, openai.APITimeoutError):
        return JudgeError(
            "timeout", f"the judge server at {where} did not answer in time", retryable=True
        )
    if isinstance(e, openai.APIConnectionError):
        return JudgeError(
            "connection",
            f"cannot reach the judge server at {where} ({str(e).rstrip('.')}); is it running "
            "there?",
            retryable=True,
        )
    if isinstance(e, openai.APIStatusError):
        return _status_error(e.status_code, e.message, e.response.headers)
    return JudgeError("client_error", str(e))


def _status_error(status: int, message: str, headers: Mapping[str, str]) -> JudgeError:
    """The JudgeError for an HTTP error status, with the server's message (both transports)."""
    hint = retry_after_seconds(headers)
    if status == 429:
        return JudgeError("rate_limited", f"HTTP 429: {message}", retryable=True, retry_after=hint)
    if status >= 500 or status == 408:
        return JudgeError(
            "server_error", f"HTTP {status}: {message}", retryable=True, retry_after=hint
        )
    if (overflow := context_refusal(status, message)) is not None:
        return overflow
    if status in (401, 403):
        return JudgeError(
            "auth",
            f"HTTP {status}: the judge server refused the API key; check api_key / OPENAI_API_KEY",
        )
    if status == 404:
        return JudgeError(
            "not_found", f"HTTP 404: {message}; check base_url (it usually ends in /v1) and model"
        )
    return JudgeError("bad_request", f"HTTP {status}: {message}")


MAX_MESSAGE_CHARS = 1000
"""The most of a server's error message kept: some servers echo the request (the whole prompt) in
it, and the message lives on in the failed result, its log line and the run store."""


def _message_in(body: object) -> str | None:
    """The error message a server wrote in its JSON body (OpenAI's `{"error": {"message": ...}}`,
    vLLM's flat form).

    A context-length refusal's fields beside the message (OpenAI's `code`, llama-server's
    `n_prompt_tokens` and `n_ctx`) are added to it, so the refusal is told from any other 400 and
    its numbers are read. At most `MAX_MESSAGE_CHARS`.
    """
    if isinstance(body, Mapping):
        inner = body.get("error")
        for where in (body, inner if isinstance(inner, Mapping) else {}):
            if isinstance(msg := where.get("message"), str) and msg:
                return _bounded(msg + _context_fields(where))
        if isinstance(inner, str) and inner:
            return _bounded(inner)
    return None


def _context_fields(error: Mapping[str, Any]) -> str:
    """A context refusal's machine-readable fields, as text to add to its message ("" for other
    errors)."""
    said = [
        str(error[k])
        for k in ("code", "type")
        if error.get(k) in ("context_length_exceeded", "exceed_context_size_error")
    ]
    said += [
        f"{k}={error[k]}" for k in ("n_prompt_tokens", "n_ctx") if isinstance(error.get(k), int)
    ]
    return f" ({', '.join(said)})" if said else ""


def _bounded(message: str) -> str:
    """At most `MAX_MESSAGE_CHARS` of a server's message, saying how much was cut."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[:MAX_MESSAGE_CHARS]}... ({len(message) - MAX_MESSAGE_CHARS} more characters)"


def _reply_message(reply: WireReply) -> str:
    """The error message a server wrote (OpenAI's `{"error": {"message": ...}}`, vLLM's flat
    form), else its body."""
    try:
        body = json.loads(reply.body)
    except ValueError:
        body = None
    if (msg := _message_in(body)) is not None:
        return msg
    text = reply.body[:300].decode("utf-8", errors="replace").strip()
    return text or f"no message ({reply.url})"

"""`agent-monitor judge-server`: a local GGUF judge behind an OpenAI-compatible HTTP API, on the
sources' h11 door.

Routes: `GET /v1/models` (with `max_model_len`, the context size, as vLLM lists it), `GET /props`
(`n_ctx` and the slot count, as llama.cpp's llama-server answers), `GET /health`, `POST /tokenize`
(llama-server's: `{"content": text}` -> `{"tokens": [...]}`), and `POST /v1/completions` and
`POST /v1/chat/completions` with OpenAI's `logprobs` / `top_logprobs` answers, `max_tokens`, `n`,
`temperature` and `seed`. A chat is rendered with the model's chat template (messages' content as
plain text, so an agent that prints a control token's spelling cannot open a turn); content parts
other than text are refused with "image input is not supported" (what `OpenAIJudge` reads as a
text-only model, then sends text placeholders). `usage.prompt_tokens_details.cached_tokens` says how
much of each prompt a slot kept from its last request.

Each slot is one llama.cpp context (built as `LlamaCppJudge` builds its own); a request takes the
free slot whose cached tokens share the longest prefix with its prompt, and its model work runs in a
worker thread, never on the event loop. While every slot is busy up to `queue` requests wait; one
more is answered 503 with Retry-After. A malformed request is a 400 that says what was wrong.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import h11
import structlog

from ...judges.base import JudgeError
from ...judges.llamacpp import common_prefix
from ..http import H11Conn, H11Server, judge_server_door
from ._slots import Ask, Completion, LoadedModel, Slot, TopToken

__all__ = ["JudgeServer", "JudgeServerSettings"]

log = structlog.get_logger("agent_monitor.judge_server")

_JSON = [(b"content-type", b"application/json")]
_MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class JudgeServerSettings:
    """Where `judge-server` listens, which model it loads and how many requests it takes at once."""

    model: str | None = field(
        default=None,
        metadata={
            "help": "a GGUF model file; none: the packaged Gemma 3 270M",
            "env": "JUDGE_SERVER_MODEL",
        },
    )
    host: str = field(
        default="127.0.0.1", metadata={"help": "address to listen on", "env": "JUDGE_SERVER_HOST"}
    )
    port: int = field(
        default=8080,
        metadata={"help": "port to listen on (0: any free one)", "env": "JUDGE_SERVER_PORT"},
    )
    n_ctx: int = field(
        default=8192,
        metadata={
            "help": "context size in tokens of each slot (prompt and answer)",
            "env": "JUDGE_SERVER_N_CTX",
        },
    )
    slots: int = field(
        default=1,
        metadata={
            "help": "llama.cpp contexts, each keeping its own prompt prefix; requests beyond "
            "them wait (on 2 cores "
            "one slot is as fast: the slots share the CPU)",
            "env": "JUDGE_SERVER_SLOTS",
        },
    )
    queue: int = field(
        default=32,
        metadata={
            "help": "requests that may wait for a slot; one more is answered 503",
            "env": "JUDGE_SERVER_QUEUE",
        },
    )
    threads: int | None = field(
        default=None,
        metadata={
            "help": "CPU threads per slot; none: llama.cpp's choice",
            "env": "JUDGE_SERVER_THREADS",
        },
    )
    max_body_bytes: int = field(
        default=16 * 1024 * 1024,
        metadata={
            "help": "largest request body; a bigger one is answered 413",
            "env": "JUDGE_SERVER_MAX_BODY_BYTES",
        },
    )
    max_connections: int = field(
        default=64,
        metadata={
            "help": "open connections at once; one more is answered 503",
            "env": "JUDGE_SERVER_MAX_CONNECTIONS",
        },
    )

    def __post_init__(self) -> None:
        if self.slots < 1 or self.queue < 0 or self.n_ctx < 64:
            raise ValueError(
                f"judge-server needs --slots >= 1, --queue >= 0 and --n-ctx >= 64 "
                f"(got {self.slots}, {self.queue}, {self.n_ctx})"
            )


class BadRequest(Exception):
    """A request the server cannot answer as asked: its HTTP status and what to change."""

    def __init__(
        self, message: str, status: int = 400, code: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class _Slots:
    """The free slots and the requests waiting for one (at most `queue`)."""

    def __init__(self, slots: Sequence[Slot], queue: int) -> None:
        self.free = list(slots)
        self.queue = queue
        self.waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    async def take(self, tokens: list[int]) -> Slot:
        """The free slot sharing the longest prefix with `tokens` (least recently used on a tie);
        waits for one."""
        while not self.free:
            if len(self.waiting) >= self.queue:
                raise BadRequest(
                    f"every slot is busy and {len(self.waiting)} requests are waiting; retry "
                    "shortly "
                    "(or start judge-server with more --queue)",
                    503,
                    "server_busy",
                )
            waiter = asyncio.get_running_loop().create_future()
            self.waiting.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # woken but leaving: pass the free slot on
                with contextlib.suppress(ValueError):
                    self.waiting.remove(waiter)
                raise
        slot = max(self.free, key=lambda s: (common_prefix(s.held(), tokens), -s.last_used))
        self.free.remove(slot)
        return slot

    def give(self, slot: Slot) -> None:
        """Return a slot (when its worker thread is done with it) and wake the first waiter."""
        self.free.append(slot)
        self._wake()

    def _wake(self) -> None:
        while self.waiting:
            waiter = self.waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


@dataclass(frozen=True, slots=True)
class JudgeServerStatistics:
    """What judge-server answered (its /props `statistics`)."""

    requests: int
    """Completions answered."""
    refused: int
    """Requests refused: 4xx, and 503 when every connection was taken."""
    failed: int
    """Requests that failed (500)."""
    prompt_tokens: int
    """Prompt tokens of the completions answered."""
    cached_tokens: int
    """Of those, tokens a slot had kept from an earlier prompt (not evaluated again)."""


class JudgeServer:
    """The HTTP side: routes, request checks, OpenAI's answer shapes; the model work goes to slot
    threads."""

    def __init__(self, settings: JudgeServerSettings, model: LoadedModel) -> None:
        self.settings = settings
        self.model = model
        self.http = H11Server(
            "judge-server",
            self._request,
            judge_server_door(
                max_connections=settings.max_connections, max_body_bytes=settings.max_body_bytes
            ),
            busy=self._busy,
            failed=lambda _: log.exception("judge_server_connection_failed"),
        )
        self._slots = _Slots(model.slots, settings.queue)
        self._stats = collections.Counter[str]()

    @classmethod
    def load(cls, settings: JudgeServerSettings) -> JudgeServer:
        """Load the settings' model into its slots (blocking: seconds) and make the server;
        `close` frees it."""
        model = LoadedModel.load(
            settings.model, n_ctx=settings.n_ctx, slots=settings.slots, threads=settings.threads
        )
        return cls(settings, model)

    def close(self) -> None:
        """Free the model (after serving)."""
        self.model.close()

    def statistics(self) -> JudgeServerStatistics:
        """Requests answered, refused (4xx and 503), failed (500), prompt tokens and the prompt
        tokens slots kept."""
        n = self._stats
        return JudgeServerStatistics(
            requests=n["requests"],
            refused=n["refused"],
            failed=n["failed"],
            prompt_tokens=n["prompt_tokens"],
            cached_tokens=n["cached_tokens"],
        )

    @property
    def url(self) -> str:
        """The base URL, once bound (clients add /v1)."""
        bound = self.http.sockname
        assert bound is not None, "judge-server is not bound"
        host = self.settings.host
        return f"http://{f'[{host}]' if ':' in host else host}:{bound[1]}"

    async def open(self) -> None:
        """Bind the address; OSError when it cannot."""
        await self.http.open(self.settings.host, self.settings.port, start_serving=False)

    async def serve(self) -> None:
        """Answer requests until cancelled."""
        await self.open()
        try:
            async with self.http.serving():
                await asyncio.Event().wait()
        finally:
            await self.http.close()

    # -- HTTP --

    async def _busy(self, conn: H11Conn) -> None:
        self._stats["refused"] += 1
        if isinstance(await conn.next_event(10.0), h11.Request):
            err = BadRequest("too many open connections; retry shortly", 503, "server_busy")
            await self._answer(conn, err.status, _error_body(err), close=True)

    async def _request(self, conn: H11Conn, request: h11.Request) -> None:
        method = request.method.decode()
        path = request.target.decode("latin-1").split("?")[0].rstrip("/")
        limit = self.http.settings.max_body_bytes
        body = await conn.body(limit, timeout_s=self.http.settings.body_timeout_s)
        try:
            if body is None:
                raise BadRequest(f"the request body is over {limit} bytes (--max-body-bytes)", 413)
            status, answer = await self._route(method, path, body)
        except BadRequest as e:
            self._stats["refused"] += 1
            status, answer = e.status, _error_body(e)
        # a bug or a llama.cpp failure: one 500 that names it, and the server goes on
        except Exception as e:
            log.exception("judge_server_request_failed", path=path)
            self._stats["failed"] += 1
            status, answer = (
                500,
                _error_body(
                    BadRequest(f"judge-server failed: {type(e).__name__}: {e}", 500, "server_error")
                ),
            )
        await self._answer(conn, status, answer, close=body is None)

    async def _answer(
        self, conn: H11Conn, status: int, answer: Mapping[str, Any], *, close: bool = False
    ) -> None:
        headers = [*_JSON, (b"retry-after", b"1")] if status == 503 else _JSON
        await conn.respond(
            status, json.dumps(answer, ensure_ascii=False).encode(), headers, close=close
        )

    async def _route(self, method: str, path: str, body: bytes) -> tuple[int, Mapping[str, Any]]:
        gets: dict[str, Callable[[], Mapping[str, Any]]] = {
            "/v1/models": self._models,
            "/props": self._props,
            "/health": lambda: {"status": "ok"},
        }
        posts: dict[str, Callable[[Mapping[str, Any]], Awaitable[Mapping[str, Any]]]] = {
            "/v1/completions": self._completions,
            "/v1/chat/completions": self._chat,
            "/tokenize": self._tokenize,
        }
        if path in gets:
            if method != "GET":
                raise BadRequest(f"use GET {path}", 405)
            return 200, gets[path]()
        if path in posts:
            if method != "POST":
                raise BadRequest(f"use POST {path}", 405)
            return 200, await posts[path](_json_object(body))
        known = ", ".join([*(f"GET {p}" for p in gets), *(f"POST {p}" for p in posts)])
        raise BadRequest(
            f"no route {method} {path[:100]}; this server has {known}", 404, "not_found"
        )

    def _models(self) -> Mapping[str, Any]:
        entry = {
            "id": self.model.model_id,
            "object": "model",
            "created": 0,
            "owned_by": "agent-monitor",
            "max_model_len": self.model.n_ctx,
        }
        return {"object": "list", "data": [entry]}

    def _props(self) -> Mapping[str, Any]:
        return {
            "default_generation_settings": {"n_ctx": self.model.n_ctx},
            "n_ctx": self.model.n_ctx,
            "total_slots": len(self.model.slots),
            "model_path": self.model.path,
            "chat_template": self.model.text.template or "",
            "statistics": dataclasses.asdict(self.statistics()),
        }

    async def _tokenize(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        content = body.get("content")
        if not isinstance(content, str):
            raise BadRequest('POST /tokenize takes {"content": "text"}')
        return {"tokens": await asyncio.to_thread(self.model.prompt_tokens, content)}

    async def _completions(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            tokens = await asyncio.to_thread(self.model.prompt_tokens, prompt)
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            tokens = list(prompt)
        else:
            raise BadRequest("`prompt` must be a string (or a list of one string, or of token ids)")
        logprobs = body.get("logprobs")
        if logprobs is not None and not (_is_int(logprobs) and 0 <= logprobs <= _MAX_LOGPROBS):
            raise BadRequest(
                f"`logprobs` must be an integer 0..{_MAX_LOGPROBS} (the top tokens to list) or null"
            )
        done = await self._complete(body, tokens, top=logprobs or 0, default_max=16)
        choices = [
            {
                "index": i,
                "text": c.text,
                "logprobs": None if logprobs is None else _completion_logprobs(c.tokens, c.top),
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(done.choices)
        ]
        return self._reply("cmpl", "text_completion", choices, done)

    async def _chat(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        messages = _messages(body.get("messages"))
        for name in (
            "continue_final_message",
            "guided_choice",
            "guided_regex",
            "response_format",
            "tools",
        ):
            if body.get(name):
                raise BadRequest(f"`{name}` is not supported by judge-server; leave it out")
        wants = body.get("logprobs")
        if wants is not None and not isinstance(wants, bool):
            raise BadRequest("`logprobs` must be true or false")
        top = body.get("top_logprobs", 0) or 0
        if not (_is_int(top) and 0 <= top <= _MAX_LOGPROBS):
            raise BadRequest(f"`top_logprobs` must be an integer 0..{_MAX_LOGPROBS}")
        try:
            tokens = await asyncio.to_thread(self.model.chat_tokens, messages)
        except (ValueError, JudgeError) as e:
            raise BadRequest(str(e)) from None
        done = await self._complete(body, tokens, top=top if wants else 0, default_max=None)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": {"content": _chat_logprobs(c.tokens, c.top)} if wants else None,
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(done.choices)
        ]
        return self._reply("chatcmpl", "chat.completion", choices, done)

    async def _complete(
        self, body: Mapping[str, Any], tokens: list[int], *, top: int, default_max: int | None
    ) -> Completion:
        if body.get("stream"):
            raise BadRequest("`stream` is not supported by judge-server; leave it out or false")
        n_ctx = self.model.n_ctx
        room = n_ctx - len(tokens)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = default_max if default_max is not None else room
        if not (_is_int(max_tokens) and max_tokens >= 1):
            raise BadRequest("`max_tokens` must be an integer >= 1")
        if not tokens or len(tokens) + max_tokens > n_ctx:
            raise BadRequest(
                f"This model's maximum context length is {n_ctx} tokens. However, you requested "
                f"{len(tokens) + max_tokens} tokens ({len(tokens)} in the prompt, "
                f"{max_tokens} in the completion). "
                "Please reduce the prompt or max_tokens (or start judge-server with a larger "
                "--n-ctx).",
                code="context_length_exceeded",
            )
        n = body.get("n", 1)
        temperature = body.get("temperature", 1.0)
        seed = body.get("seed")
        if not (_is_int(n) and 1 <= n <= 128):
            raise BadRequest("`n` must be an integer 1..128")
        if not (
            isinstance(temperature, int | float)
            and not isinstance(temperature, bool)
            and 0 <= temperature <= 2
        ):
            raise BadRequest("`temperature` must be a number 0..2")
        if seed is not None and not _is_int(seed):
            raise BadRequest("`seed` must be an integer")
        ask = Ask(tokens, max_tokens, top, float(temperature), n, seed)
        slot = await self._slots.take(tokens)
        # The slot goes back when its thread is done, not when this request is: a client that leaves
        # mid-call cancels this task, but the thread still uses the context until it returns.
        work = asyncio.ensure_future(asyncio.to_thread(slot.complete, ask))
        work.add_done_callback(lambda _: self._slots.give(slot))
        try:
            done = await asyncio.shield(work)
        except RuntimeError as e:
            raise BadRequest(
                f"llama.cpp failed to evaluate the prompt: {e}", 500, "server_error"
            ) from None
        self._stats["requests"] += 1
        self._stats["prompt_tokens"] += done.prompt_tokens
        self._stats["cached_tokens"] += done.cached_tokens
        return done

    def _reply(
        self, prefix: str, kind: str, choices: list[dict[str, Any]], done: Completion
    ) -> Mapping[str, Any]:
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model.model_id,
            "choices": choices,
            "usage": {
                "prompt_tokens": done.prompt_tokens,
                "completion_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
            },
        }


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_object(body: bytes) -> Mapping[str, Any]:
    try:
        data = json.loads(body)
    except ValueError as e:
        raise BadRequest(f"the request body is not valid JSON ({e}); send a JSON object") from None
    if not isinstance(data, dict):
        raise BadRequest(
            f"the request body is JSON {type(data).__name__}, not an object; send a JSON object"
        )
    return data


def _messages(raw: object) -> list[tuple[str, str]]:
    """A chat's messages as (role, text); content parts other than text are refused (a text-only
    model)."""
    if not isinstance(raw, list) or not raw:
        raise BadRequest("`messages` must be a non-empty list of {role, content} objects")
    out: list[tuple[str, str]] = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string `role`")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                elif kind in ("image_url", "input_image", "image"):
                    raise BadRequest(
                        "image input is not supported: judge-server runs a text-only model; "
                        "send the frames as text (OpenAIJudge does, after this answer)"
                    )
                else:
                    raise BadRequest(
                        f"messages[{i}] has a content part of type {kind!r}; use text parts"
                    )
            content = "".join(texts)
        elif content is None:
            content = ""
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts")
        out.append((m["role"], content))
    return out


def _completion_logprobs(tokens: list[TopToken], tops: list[list[TopToken]]) -> Mapping[str, Any]:
    """OpenAI's legacy completions shape: token lists, their logprobs, the top alternatives as
    {token: logprob}."""
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t.token)
    top_maps = []
    for alts in tops:
        top_map: dict[str, float] = {}
        for a in alts:
            # two ids spelled alike: the likelier one (listed first)
            top_map.setdefault(a.token, a.logprob)
        top_maps.append(top_map)
    return {
        "tokens": [t.token for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": top_maps,
        "text_offset": offsets,
    }


def _chat_logprobs(tokens: list[TopToken], tops: list[list[TopToken]]) -> list[Mapping[str, Any]]:
    """OpenAI's chat shape: one entry per generated token, its top alternatives with their bytes."""
    return [
        {
            "token": t.token,
            "logprob": t.logprob,
            "bytes": list(t.raw),
            "top_logprobs": [
                {"token": a.token, "logprob": a.logprob, "bytes": list(a.raw)} for a in alts
            ],
        }
        for t, alts in zip(tokens, tops, strict=True)
    ]


def _error_body(e: BadRequest) -> Mapping[str, Any]:
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    return {"error": {"message": str(e), "type": kind, "code": e.code}}

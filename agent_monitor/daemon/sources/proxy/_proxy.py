"""The LLM API proxy: a source of the monitor that forwards an agent's API calls and watches every
turn.

An agent points its base URL at the proxy (`OPENAI_BASE_URL=http://127.0.0.1:8888/v1`,
`ANTHROPIC_BASE_URL=http://127.0.0.1:8888`); every request is forwarded to the upstream with
the client's own headers (its API key included: forwarded, never logged, never stored), every
response comes back unchanged, streams chunk by chunk. `POST /v1/chat/completions`,
`/v1/responses` and `/v1/messages` are also read: each conversation is a run, each assistant turn
with the tool results that come back after it a step (`_turns`), handed to the monitor's ingest
like any other source's events. With `enforce`, a run whose signal is abort gets a 409 in its
API's own error format at its next request; with `best_of` N, the judge's pivot tournament picks
the returned turn from N candidates.

One task (`source-proxy`) owns everything: the HTTP/1.1 server (the sources' `_h11` door:
keep-alive, chunked responses, its connections its own tasks), the feeder that hands events to
ingest (a bounded queue: a request never waits for the journal) and the sweeper that ends idle
conversations. Best of N is `_BestOf`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import structlog

from ....criteria import CriteriaSpec
from ....judges.base import Judge
from ....progress import Usage
from ....selection import compare, tournament
from ..._config import ProxySettings
from ..._events import Sink
from ...http import H11Conn, H11Server, declared_length, proxy_door
from .._chat import Api, Request, Turn, parse_request
from .._protocol import Inbound, RunsView, SourceInput, statistics_json
from ._turns import (
    API_OF_PATH,
    Conversation,
    Conversations,
    StreamTurn,
    error_body,
    majority,
    sse_of,
    steps_of,
    turn_of_response,
    with_turn,
)

try:
    import h11
    import httpx2
except ImportError as e:  # pragma: no cover - the extra names what to install
    raise ImportError(
        f"the LLM API proxy needs pip install -e '.[proxy]' in the agent-monitor checkout ({e})"
    ) from None

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

__all__ = ["ProxySource"]

log = structlog.get_logger("agent_monitor.proxy")

QUEUE_SIZE = 10_000
"""Events waiting for ingest; past it new ones are dropped (counted in events_dropped)."""
_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
    }
)
# The client's accept-encoding is not forwarded: httpx asks for what it can decode, and the proxy
# reads the stream.
_REQUEST_DROP = _HOP | {b"accept-encoding"}
_RESPONSE_DROP = _HOP | {b"content-encoding"}
_RUN_HEADER = b"x-agent-monitor-run"
# A refused body still on its way is read and dropped this long, so the client reads its 413 (not a
# reset).
_LINGER_BYTES = 1024 * 1024
_LINGER_S = 2.0


class _Watch:
    """What the proxy knows about one watched request while it is in flight."""

    __slots__ = ("conv", "req")

    def __init__(self, conv: Conversation, req: Request) -> None:
        self.conv = conv
        self.req = req


@dataclass(frozen=True, slots=True)
class ProxySourceStatistics:
    """The proxy's counters and gauges (`agent_monitor_proxy_*`; counters end in _total)."""

    counts: Mapping[str, int]
    """Counters by name, only the ones that happened: `requests`, `forwarded`, `watched`,
    `unwatched_{reason}`, `upstream_status_{code}`, `{kind}s_sent`, `best_of_*`, ..."""
    splits: int
    """Conversations split into a run of their own when their history diverged (a counter)."""
    live_conversations: int
    """Conversations followed now."""
    inflight: int
    """Requests being forwarded now."""
    connections: int
    """Connections open now."""
    queued_events: int
    """Events waiting to be handed to ingest."""


class ProxySource:
    """The LLM API proxy as a source: `Monitor(config, judge=judge,
    sources=[ProxySource(settings)])`.

    Enter it (`async with`) to bind the port before the monitor starts (the CLI does, so a taken
    port is one line); otherwise `run` binds it. `url` is where agents point their base URL.
    """

    name = "proxy"
    sink: Sink | None = None
    """No sink: the proxy reads the signals it needs through the RunsView, at each request."""

    def __init__(
        self,
        settings: ProxySettings,
        *,
        judge: Judge | None = None,
        criteria: CriteriaSpec = None,
        registry: CollectorRegistry | None = None,
        transport: httpx2.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if settings.upstream is None:
            raise ValueError(
                "the proxy needs an upstream; pass "
                "ProxySettings(upstream='https://api.openai.com/v1')"
            )
        if settings.best_of > 1 and judge is None:
            raise ValueError(
                f"best_of={settings.best_of} needs a judge to pick the candidates: pass judge="
            )
        self.settings = settings
        self.judge = judge
        self.criteria = criteria
        self.clock = clock
        self.upstream = settings.upstream.rstrip("/")
        self._transport = transport
        self.conversations = Conversations(settings.max_conversations, settings.conversation_idle_s)
        self.counts: Counter[str] = Counter()
        self.inflight = 0
        self._queue: asyncio.Queue[Inbound] = asyncio.Queue(QUEUE_SIZE)
        self.http = H11Server(
            "proxy",
            self._handle,
            proxy_door(settings),
            on_refused=lambda: self.counts.update(("connections_refused",)),
            on_shed=lambda: self.counts.update(("connections_shed",)),
            bad_request=self._bad_http,
            failed=self._failed,
        )
        self._client: httpx2.AsyncClient | None = None
        self._best = (
            _BestOf(settings.best_of, judge, criteria, self.counts)
            if settings.best_of > 1
            else None
        )
        self._runs: RunsView | None = None
        self._owned = False
        if registry is not None:
            registry.register(_ProxyCollector(self))

    # Life cycle.

    async def __aenter__(self) -> ProxySource:
        host, port = self.settings.address
        t = self.settings.upstream_timeout_s
        self._client = httpx2.AsyncClient(
            timeout=httpx2.Timeout(t, connect=min(t, 30.0)),
            limits=httpx2.Limits(max_connections=None, max_keepalive_connections=64),
            transport=self._transport,
            follow_redirects=False,
        )
        try:
            await self.http.open(host, port, start_serving=False)
        except BaseException:
            await self._client.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.close()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    @property
    def url(self) -> str:
        """The proxy's base URL (bound: the real port when listening on port 0)."""
        host, port = self.http.sockname or self.settings.address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    async def run(self, ingest: SourceInput, runs: RunsView) -> None:
        """Serve until cancelled: connections, the feeder to ingest, the sweeper of idle
        conversations."""
        self._runs = runs
        if not self.http.bound:
            await self.__aenter__()
            self._owned = True
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._feed(ingest), name="proxy-feed")
                tg.create_task(self._sweep(), name="proxy-sweep")
                tg.create_task(self._provisional(), name="proxy-provisional")
                async with self.http.serving():
                    log.info("proxy_listening", url=self.url, upstream=self.upstream)
                    await asyncio.Event().wait()
        finally:
            if self._owned:
                await self.__aexit__()

    def statistics(self) -> ProxySourceStatistics:
        """Counters (requests, watched, unwatched by reason, refused, steps, best-of calls) and
        gauges."""
        return ProxySourceStatistics(
            counts=dict(self.counts),
            splits=self.conversations.splits,
            live_conversations=len(self.conversations.live),
            inflight=self.inflight,
            connections=self.http.connections,
            queued_events=self._queue.qsize(),
        )

    # The feeder and the sweeper.

    def _emit(self, events: Sequence[Inbound]) -> None:
        for e in events:
            try:
                self._queue.put_nowait(e)
            except asyncio.QueueFull:
                self.counts["events_dropped"] += 1
            else:
                self.counts["amendments_sent" if e.data.get("amend") else f"{e.kind}s_sent"] += 1

    async def _feed(self, ingest: SourceInput) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < 256 and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            for attempt in range(3):
                try:
                    errors = await ingest.events(batch)
                except Exception as e:  # the monitor's bug must not stop the proxy forwarding
                    log.error("proxy_ingest_failed", error=f"{type(e).__name__}: {e}")
                    errors = [e] * len(batch)
                batch = [ev for ev, err in zip(batch, errors, strict=True) if err is not None]
                if not batch:
                    break
                await asyncio.sleep(0.2 * (attempt + 1))
            if batch:
                self.counts["events_lost"] += len(batch)
                log.warning("proxy_events_lost", events=len(batch), run_id=batch[0].run_id)

    async def _sweep(self) -> None:
        every = min(30.0, self.settings.conversation_idle_s / 4)
        while True:
            await asyncio.sleep(every)
            for conv in self.conversations.expire(self.clock()):
                self.counts["conversations_ended"] += 1
                self._emit(self.conversations.flush(conv))
                if conv.started:
                    self._emit([Inbound(conv.run_id, "end", {}, key=f"{conv.run_id}:end")])

    async def _provisional(self) -> None:
        """Send the held final answers whose conversation did not go on within --final-grace."""
        every = min(1.0, max(0.05, self.settings.final_grace_s / 4))
        while True:
            await asyncio.sleep(every)
            self._emit(self.conversations.due(self.clock()))

    # HTTP.

    async def _handle(self, conn: H11Conn, request: h11.Request) -> None:
        """One request: its path checked, its body read (bounded, each part within the
        deadlines), then forwarded."""
        if (why := _bad_target(request.target)) is not None:
            # Dot segments would be resolved once joined to the upstream's base: refused, never
            # sent.
            self.counts["bad_path"] += 1
            await _respond(
                conn,
                400,
                json.dumps({"error": {"message": f"agent-monitor proxy: {why}"}}).encode(),
            )
            return
        bounds = self.http.settings
        length = declared_length(request)
        if length is not None and length > bounds.max_body_bytes:
            # Answered at once, the body unread: the connection closes (the client may be sending it
            # still).
            self.counts["too_large"] += 1
            await _respond(conn, 413, b'{"error":{"message":"request body too large"}}', close=True)
            await conn.linger(_LINGER_BYTES, _LINGER_S)
            return
        body = await conn.body(bounds.max_body_bytes, timeout_s=bounds.body_timeout_s)
        if body is None:
            self.counts["too_large"] += 1
            await _respond(conn, 413, b'{"error":{"message":"request body too large"}}', close=True)
            return
        await self._request(conn, request, body)

    async def _bad_http(self, conn: H11Conn, e: h11.RemoteProtocolError) -> None:
        self.counts["bad_http"] += 1
        with contextlib.suppress(Exception):
            if conn.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                await _respond(
                    conn, e.error_status_hint, b'{"error":{"message":"bad HTTP request"}}'
                )

    def _failed(self, e: Exception) -> None:
        self.counts["proxy_errors"] += 1
        log.error("proxy_connection_failed", error=f"{type(e).__name__}: {e}")

    async def _request(self, conn: H11Conn, req: h11.Request, body: bytes) -> None:
        self.counts["requests"] += 1
        method, target = req.method.decode(), req.target.decode("latin-1")
        path = target.split("?", 1)[0].rstrip("/")
        api = API_OF_PATH.get(path) if method == "POST" else None
        header = next(
            (v.decode("latin-1") for k, v in req.headers if k.lower() == _RUN_HEADER), None
        )
        watch, parsed = (await self._watch(api, body, header)) if api is not None else (None, None)
        if watch is None:
            await self._forward(conn, method, target, req.headers, body, api, None)
            return
        assert api is not None and parsed is not None
        refusal = self._refusal(watch.conv) if self.settings.enforce else None
        if refusal is not None:
            self.counts["refused"] += 1
            log.info("proxy_refused", run_id=watch.conv.run_id, api=api)
            await _respond(
                conn, 409, error_body(api, refusal), extra=[(b"x-should-retry", b"false")]
            )
            return
        self.inflight += 1
        try:
            if self._best is not None and watch.req.n == 1:
                assert self._client is not None
                url, hdrs = self._url(target), self._headers(req.headers)
                answered = await self._best.answer(conn, self._client, url, hdrs, parsed, watch.req)
                if answered is not None:
                    self._answered(watch, answered[0])
            else:
                await self._forward(conn, method, target, req.headers, body, api, watch)
        finally:
            self.inflight -= 1

    async def _watch(
        self, api: Api, body: bytes, header: str | None
    ) -> tuple[_Watch | None, dict[str, Any] | None]:
        """The request's conversation (its history's new steps handed to ingest), or None:
        forwarded, not watched."""
        if len(body) > self.settings.max_conversation_bytes:
            return self._unwatched("too_large")
        if self.inflight >= self.settings.max_upstream_requests:
            return self._unwatched("busy")
        try:
            # A long history is megabytes of JSON: parsed off the loop, so other streams keep
            # flowing.
            data = (
                json.loads(body)
                if len(body) < 262_144
                else await asyncio.to_thread(json.loads, body)
            )
            req = parse_request(api, data)
        except ValueError:
            return self._unwatched("unreadable")
        if isinstance(data, dict) and data.get("previous_response_id"):
            # The history is kept by the provider: this request holds only the new items, no
            # conversation to read.
            return self._unwatched("server_history")
        if header is not None:
            from ....wire import TopicError, check_run_id

            try:
                check_run_id(header)
            except TopicError:
                return self._unwatched("bad_run_header")
        conv = self.conversations.match(req, header, self.clock())
        if conv is None:
            return self._unwatched("conversations")
        self.counts["watched"] += 1
        self._emit(self.conversations.events(conv, req, now=self.clock()))
        return _Watch(conv, req), data

    def _unwatched(self, reason: str) -> tuple[None, None]:
        self.counts[f"unwatched_{reason}"] += 1
        return None, None

    def _refusal(self, conv: Conversation) -> str | None:
        """Why the run's requests are refused (its signal is abort, now or before), or None."""
        if (
            conv.stopped is None
            and self._runs is not None
            and self._runs.signal(conv.run_id) == "abort"
        ):
            p = self._runs.latest(conv.run_id)
            decision = p.signal if p is not None else None
            score = decision.score if decision is not None else (p.score if p is not None else None)
            shown = "unknown" if score is None else f"{score:.3f}"
            why = decision.reason if decision is not None else "abort"
            step = p.step if p is not None else 0
            conv.stopped = (
                f"agent-monitor stopped run {conv.run_id}: its progress score is {shown} at "
                f"step {step} "
                f"({why}); the monitor's policy aborted it, so the proxy refuses its requests"
            )
        return conv.stopped

    def _url(self, target: str) -> str:
        # `--proxy-upstream https://api.openai.com/v1` and the client's /v1/... share one /v1.
        if self.upstream.endswith("/v1") and (
            target == "/v1" or target.startswith(("/v1/", "/v1?"))
        ):
            return self.upstream + target[3:]
        return self.upstream + target

    def _headers(self, headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        return [
            (k, v)
            for k, v in headers
            if k.lower() not in _REQUEST_DROP and not k.lower().startswith(b"x-agent-monitor-")
        ]

    async def _forward(
        self,
        conn: H11Conn,
        method: str,
        target: str,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
        api: Api | None,
        watch: _Watch | None,
    ) -> None:
        assert self._client is not None
        self.counts["forwarded"] += 1
        request = self._client.build_request(
            method, self._url(target), headers=self._headers(headers), content=body
        )
        try:
            resp = await self._client.send(request, stream=True)
        except httpx2.HTTPError as e:
            self.counts["upstream_unreachable"] += 1
            log.warning(
                "proxy_upstream_failed", path=target.split("?", 1)[0], error=type(e).__name__
            )
            message = f"agent-monitor proxy: the upstream API did not answer ({type(e).__name__})"
            await _respond(conn, 502, error_body(api or "chat", message, "upstream"))
            return
        try:
            if resp.status_code >= 400:
                self.counts[f"upstream_status_{resp.status_code}"] += 1
            out = [(k, v) for k, v in resp.headers.raw if k.lower() not in _RESPONSE_DROP]
            streamed = resp.headers.get("content-type", "").startswith("text/event-stream")
            reading = watch is not None and resp.status_code < 300
            turn = (
                StreamTurn(watch.req.api, self.settings.max_conversation_bytes)
                if reading and streamed and watch
                else None
            )
            kept: bytearray | None = bytearray() if reading and not streamed else None
            conn.send(
                h11.Response(
                    status_code=resp.status_code, headers=out, reason=resp.reason_phrase.encode()
                )
            )
            try:
                async for chunk in resp.aiter_bytes():
                    # The client first; reading the turn comes after, off the chunk's path.
                    conn.send(h11.Data(data=chunk))
                    await conn.drain()
                    if turn is not None:
                        turn.feed(chunk)
                    elif kept is not None:
                        kept += chunk
                        if len(kept) > self.settings.max_conversation_bytes:
                            kept = None
            except httpx2.HTTPError as e:
                # The upstream broke off mid-response: the client sees its connection close, as it
                # would upstream.
                self.counts["upstream_broken"] += 1
                log.warning(
                    "proxy_upstream_broke_off", path=target.split("?", 1)[0], error=type(e).__name__
                )
                raise ConnectionAbortedError from None
            conn.send(h11.EndOfMessage())
            await conn.drain()
        finally:
            await resp.aclose()
        if watch is not None and reading:
            got: Turn | None = None
            if turn is not None:
                got = turn.turn()
            elif kept is not None:
                with contextlib.suppress(ValueError):
                    got = turn_of_response(watch.req.api, json.loads(kept))
            self._answered(watch, got)

    def _answered(self, watch: _Watch, turn: Turn | None) -> None:
        if turn is None:
            self.counts["unreadable_responses"] += 1
            return
        if turn.final:
            # Held back a moment: a text-only agent's next request may bring what its words did (a
            # ReAct loop).
            grace = self.settings.final_grace_s
            self._emit(
                self.conversations.events(
                    watch.conv, watch.req, turn, now=self.clock(), grace_s=grace
                )
            )


class _BestOf:
    """Best of N: N candidate turns from the upstream, the judge's pick returned; `counts` are
    the proxy's."""

    def __init__(
        self, n: int, judge: Judge | None, criteria: CriteriaSpec, counts: Counter[str]
    ) -> None:
        self.n = n
        self.judge = judge
        self.criteria = criteria
        self.counts = counts

    async def answer(
        self,
        conn: H11Conn,
        client: httpx2.AsyncClient,
        url: str,
        hdrs: Sequence[tuple[bytes, bytes]],
        data: dict[str, Any],
        req: Request,
    ) -> tuple[Turn | None] | None:
        """Answer the request with the picked candidate: (its turn, None if unreadable); None
        when every one failed."""
        api, n = req.api, self.n
        self.counts["best_of_requests"] += 1
        body = {k: v for k, v in data.items() if k not in ("stream", "stream_options")}

        async def post(payload: dict[str, Any]) -> httpx2.Response | httpx2.HTTPError:
            try:
                return await client.post(url, headers=hdrs, content=json.dumps(payload).encode())
            except httpx2.HTTPError as e:
                return e

        # One request with n where the API has it (chat); the rest in parallel when the upstream
        # gave fewer.
        first = await post({**body, "n": n}) if api == "chat" else None
        answers: list[httpx2.Response | httpx2.HTTPError] = [first] if first is not None else []
        cands: list[tuple[dict[str, Any], int]] = []  # (response body, choice)
        if isinstance(first, httpx2.Response) and first.status_code < 300:
            with contextlib.suppress(ValueError):
                got = first.json()
                cands += [(got, i) for i in range(len(got.get("choices") or []))][:n]
        more = n - len(cands)
        answers += await asyncio.gather(*(post(body) for _ in range(more)))
        for a in answers[1 if first is not None else 0 :]:
            if isinstance(a, httpx2.Response) and a.status_code < 300:
                with contextlib.suppress(ValueError):
                    cands.append((a.json(), 0))
        self.counts["best_of_upstream_calls"] += len(answers)
        self.counts["best_of_candidates"] += len(cands)
        for got, i in cands:
            usage = got.get("usage") if i == 0 else None
            if isinstance(usage, Mapping):
                ins = usage.get("prompt_tokens", usage.get("input_tokens", 0))
                outs = usage.get("completion_tokens", usage.get("output_tokens", 0))
                self.counts["best_of_upstream_input_tokens"] += int(ins or 0)
                self.counts["best_of_upstream_output_tokens"] += int(outs or 0)
        if not cands:
            # Every candidate failed: the upstream's own first answer goes back unchanged.
            self.counts["best_of_failed"] += 1
            if answers and isinstance(a := answers[0], httpx2.Response):
                out = [(k, v) for k, v in a.headers.raw if k.lower() not in _RESPONSE_DROP]
                await _respond(conn, a.status_code, a.content, headers=out)
            else:
                message = "agent-monitor proxy: the upstream API did not answer"
                await _respond(conn, 502, error_body(api, message, "upstream"))
            return None
        turns = [turn_of_response(api, got, i) for got, i in cands]
        winner = await self._pick(req, turns)
        chosen_body, chosen = cands[winner]
        result = with_turn(api, [chosen_body], chosen) if api == "chat" else chosen_body
        if req.stream:
            hdr = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
            conn.send(h11.Response(status_code=200, headers=hdr))
            for event in sse_of(api, result):
                conn.send(h11.Data(data=event))
            conn.send(h11.EndOfMessage())
            await conn.drain()
        else:
            await _respond(conn, 200, json.dumps(result).encode())
        return (turns[winner],)

    async def _pick(self, req: Request, turns: Sequence[Turn | None]) -> int:
        """The winning candidate: a strict majority's, else the pivot tournament's; 0 when the
        judge fails."""
        readable = [i for i, t in enumerate(turns) if t is not None]
        if len(readable) <= 1:
            return readable[0] if readable else 0
        if (m := majority(turns)) is not None:
            self.counts["best_of_majority"] += 1
            return m
        assert self.judge is not None
        history = [text for text, _ in steps_of(req.items)]
        task = req.task or "(no user message)"
        judge = self.judge

        async def judged(i: int, j: int) -> Any:
            ti, tj = turns[i], turns[j]
            assert ti is not None and tj is not None
            return await compare(
                task,
                [*history, ti.render()],
                [*history, tj.render()],
                judge=judge,
                criteria=self.criteria,
            )

        try:
            t = await tournament(readable, judged)
        except Exception as e:  # a judge's bug is a failed pick, never a failed request
            log.warning("proxy_best_of_judge_failed", error=f"{type(e).__name__}: {e}")
            self.counts["best_of_judge_failed"] += 1
            return readable[0]
        usage = sum((r.usage for r in t.results.values()), Usage())
        self.counts["best_of_judge_calls"] += sum(r.calls for r in t.results.values())
        self.counts["best_of_judge_input_tokens"] += usage.input_tokens
        self.counts["best_of_judge_output_tokens"] += usage.output_tokens
        if t.winner is None:
            self.counts["best_of_judge_failed"] += 1
            return readable[0]
        self.counts["best_of_judged"] += 1
        return t.winner


async def _respond(
    conn: H11Conn,
    status: int,
    body: bytes,
    *,
    headers: Sequence[tuple[bytes, bytes]] | None = None,
    extra: Sequence[tuple[bytes, bytes]] = (),
    close: bool = False,
) -> None:
    """A whole response: `headers` (a JSON content type without), then `extra`, then its length."""
    await conn.respond(
        status,
        body,
        [*(headers if headers is not None else [(b"content-type", b"application/json")]), *extra],
        close=close,
    )


def _bad_target(target: bytes) -> str | None:
    """Why a request target may not be joined to the upstream's base (a dot segment, plain or
    encoded), or None."""
    path = target.split(b"?", 1)[0].decode("latin-1")
    if not path.startswith("/"):
        return "the request target must be a path starting with /"
    # Decoded twice: an upstream (or a server behind it) that decodes %2e or %252e must not see a
    # dot segment.
    decoded = unquote(unquote(path))
    if any(seg in (".", "..") for seg in decoded.replace("\\", "/").split("/")):
        return "the request path has a . or .. segment; send a normalised path"
    return None


class _ProxyCollector:
    """`agent_monitor_proxy_*`: the proxy's counters and gauges, read at scrape time."""

    _GAUGES = frozenset({"live_conversations", "inflight", "connections", "queued_events"})

    def __init__(self, proxy: ProxySource) -> None:
        self.proxy = proxy

    def collect(self) -> Iterator[Metric]:
        """One family per statistic (counters end in _total)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for key, value in sorted(statistics_json(self.proxy.statistics()).items()):
            name = f"agent_monitor_proxy_{key}"
            if key in self._GAUGES:
                yield GaugeMetricFamily(
                    name, f"LLM API proxy: {key.replace('_', ' ')}", value=value
                )
            else:
                yield CounterMetricFamily(
                    name, f"LLM API proxy: {key.replace('_', ' ')}", value=value
                )

    def describe(self) -> Iterator[Metric]:
        """Nothing up front: the families depend on what happened."""
        return iter(())

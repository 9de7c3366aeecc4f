"""The board's and the run pages' routes: what the metrics port serves besides /metrics, handed to
its server.

`BoardSite(board, pages)` is the `Site` an `HttpServer` is built with (`HttpServer(registry,
site=BoardSite(board, pages))`):

- `/`: the board, one static HTML file with its CSS and script inline (no external resources: it
  works air-gapped), sent with a Content-Security-Policy that allows exactly that script and style;
- `/events`: server-sent events, a snapshot of the board on connect, then one event per change (each
  browser's queue bounded: a slow one is dropped, never waited for; see `Board`);
- `/api/runs`: the board's snapshot as JSON; with a query (`?outcome=failure&limit=20`...), a page
  of the history of ended runs from the run store (`RunPages`);
- `/runs/<run_id>` and `/api/runs/<run_id>`: a run's page (its task, steps, curve and decisions) and
  its JSON; `/runs`: the history, browsable; `/api/frames/<sha256>`: a stored camera frame (the
  page's thumbnails).

Its task (`run`, while the server serves) prunes the board every second and drops its browsers at
the end.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import importlib.resources
import json
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import unquote

import structlog

from ..http import GET_HEAD, HttpRequest, HttpResponse, Route, text
from ._board import Board, BoardClient, sse
from ._runpages import QueryError, RunPages

__all__ = ["BoardSite"]

log = structlog.get_logger("agent_monitor.daemon")

_PAGE_HEADERS = {"X-Frame-Options": "DENY"}


def _page(name: str = "board.html", *, img: str = "data:") -> tuple[bytes, str]:
    """A page (the board, the run pages) and its Content-Security-Policy: only its own inline
    script and style run."""
    html = importlib.resources.files("agent_monitor.daemon.sinks").joinpath(name).read_bytes()
    page = html.decode()

    def hashes(tag: str) -> str:
        found = re.findall(rf"<{tag}>(.*?)</{tag}>", page, flags=re.S)
        return " ".join(
            f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'"
            for b in found
        )

    csp = (
        f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
        f"connect-src 'self'; img-src {img}; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )
    return html, csp


class BoardSite:
    """The board's pages and the run pages (`pages`, None: /runs is 404), as routes of an
    `HttpServer`."""

    def __init__(self, board: Board, pages: RunPages | None = None) -> None:
        self.board = board
        self.pages = pages
        """What answers /runs, /runs/<id> and their JSON (with the run store)."""
        self._board_page, self._board_csp = _page()
        self._runs_page, self._runs_csp = _page("runs.html", img="'self' data:")

        def get(handler: Any, *, prefix: bool = False) -> Route:
            return Route(handler, GET_HEAD, max_body_bytes=0, prefix=prefix)

        self.routes: Mapping[str, Route] = {
            "/": get(self._index),
            "/index.html": get(self._index),
            "/events": get(self._events),
            "/api/runs": get(self._api_runs),
            "/runs": get(self._runs),
            "/runs/": get(self._runs, prefix=True),
            "/api/runs/": get(self._run_json, prefix=True),
            "/api/frames/": get(self._frame, prefix=True),
        }

    async def run(self) -> None:
        """Prune the board every second while served; drop its browsers when the server stops."""
        try:
            while True:
                await asyncio.sleep(1.0)
                try:
                    self.board.prune()
                except Exception:
                    log.exception("board_prune_failed")
        finally:
            self.board.close()

    async def _index(self, _: HttpRequest) -> HttpResponse:
        headers = {"Content-Security-Policy": self._board_csp, **_PAGE_HEADERS}
        return HttpResponse(200, self._board_page, "text/html; charset=utf-8", headers)

    async def _runs(self, req: HttpRequest) -> HttpResponse:
        """The history page and a run's page (one HTML page; its script reads the JSON)."""
        if self.pages is None:
            return text(404, f"no {req.path[:100]} here: this server has no run pages; see /")
        if req.path.startswith("/runs/") and not unquote(req.path[len("/runs/") :]):
            return text(404, "no run id in the path: /runs lists the ended runs")
        headers = {"Content-Security-Policy": self._runs_csp, **_PAGE_HEADERS}
        return HttpResponse(200, self._runs_page, "text/html; charset=utf-8", headers)

    async def _api_runs(self, req: HttpRequest) -> HttpResponse:
        """The board's snapshot; with a query, a page of the history of ended runs."""
        if not req.query:
            return HttpResponse(200, await asyncio.to_thread(_json, self.board.snapshot()))
        if self.pages is None:
            return text(404, "no /api/runs here: this server has no run pages; see /")
        try:
            data = await self.pages.history(req.query)
        except QueryError as e:
            return text(400, f"/api/runs?{req.query[:100]}: {e}")
        except LookupError as e:
            return text(404, str(e))
        return HttpResponse(200, await asyncio.to_thread(_json, data))

    async def _run_json(self, req: HttpRequest) -> HttpResponse:
        if self.pages is None:
            return text(404, f"no {req.path[:100]} here: this server has no run pages; see /")
        run_id = unquote(req.path[len("/api/runs/") :])
        found = await self.pages.run(run_id) if run_id else None
        if found is None:
            return text(
                404, f"no run {run_id[:100]!r} here (never seen, or dropped by --retention)"
            )
        return HttpResponse(200, await asyncio.to_thread(_json, found))

    async def _frame(self, req: HttpRequest) -> HttpResponse:
        if self.pages is None:
            return text(404, f"no {req.path[:100]} here: this server has no run pages; see /")
        frame = await self.pages.frame(req.path[len("/api/frames/") :])
        if frame is None:
            return text(404, "no such frame here (never stored, or pruned by the frame budget)")
        # Content-addressed: a digest's bytes never change, so a browser may keep them.
        return HttpResponse(200, frame[1], frame[0], {"Cache-Control": "private, max-age=86400"})

    async def _events(self, req: HttpRequest) -> HttpResponse:
        """Server-sent events: the snapshot, then the board's updates, keep-alive comments while
        idle."""
        content_type = "text/event-stream; charset=utf-8"
        if req.method == "HEAD":
            return HttpResponse(200, b"", content_type)
        joined = self.board.subscribe(on_drop=req.abort)
        if joined is None:
            return text(
                503,
                f"{self.board.settings.max_clients} browsers already follow the board "
                "(--board-clients); retry later",
                {"Retry-After": "10"},
            )
        client, snap = joined
        return HttpResponse(
            200, b"", content_type, {"X-Accel-Buffering": "no"}, stream=self._follow(client, snap)
        )

    async def _follow(self, client: BoardClient, snap: dict[str, Any]) -> AsyncIterator[bytes]:
        try:
            # A full board is a megabyte of JSON (tens of milliseconds): encoded off the loop.
            snapshot = await asyncio.to_thread(sse, "snapshot", snap)
            # retry: how long a browser's EventSource waits before reconnecting (to a fresh
            # snapshot).
            yield b"retry: 2000\n\n" + snapshot
            keepalive = self.board.settings.keepalive_s
            while not client.dropped:
                batch = await client.take(keepalive)
                if client.dropped:
                    break
                yield b"".join(batch) if batch else b": keep-alive\n\n"
        finally:
            self.board.unsubscribe(client)
            client.drop()


def _json(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()

"""Headless Chromium (Debian's `chromium`) driven over the DevTools protocol: the web board's
browser test.

`Browser` starts a private Chromium (own profile in a temporary folder, DevTools on a port it picks
and writes to DevToolsActivePort), connects to its page over a websocket and offers the few calls
the tests need: navigate, evaluate JavaScript, wait for a condition, take a screenshot.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Self

import websockets
from websockets.asyncio.client import ClientConnection

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = (
    "--headless",
    # root in CI containers: Chromium's sandbox needs user namespaces it may not have
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


class Browser:
    """One headless Chromium with one page; an async context manager."""

    def __init__(self, width: int = 1280, height: int = 800) -> None:
        if CHROMIUM is None:
            raise RuntimeError("chromium is not installed; `apt-get install chromium`")
        self.width, self.height = width, height
        self._profile = tempfile.TemporaryDirectory(prefix="agent-monitor-chromium-")
        self._log = Path(self._profile.name) / "chromium.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.console: list[str] = []
        """Console messages and log entries of the page (CSP violations show up here)."""

    def _launch(self) -> None:
        assert CHROMIUM is not None
        with self._log.open("wb") as log:
            self._proc = subprocess.Popen(
                [
                    CHROMIUM,
                    *FLAGS,
                    f"--user-data-dir={self._profile.name}",
                    # Chromium picks a free port and writes it to DevToolsActivePort
                    "--remote-debugging-port=0",
                    f"--window-size={self.width},{self.height}",
                    "about:blank",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    async def __aenter__(self) -> Self:
        await asyncio.to_thread(self._launch)
        try:
            port = await self._devtools_port(Path(self._profile.name) / "DevToolsActivePort")
            url = await asyncio.to_thread(self._page_url, port)
            self._ws = await websockets.connect(url, max_size=None)
            self._reader = asyncio.create_task(self._read(self._ws), name="cdp-reader")
            await self.send("Page.enable")
            await self.send("Runtime.enable")
            await self.send("Log.enable")
            await self.send(
                "Emulation.setDeviceMetricsOverride",
                width=self.width,
                height=self.height,
                deviceScaleFactor=1,
                mobile=False,
            )
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._ws is not None:
            await self._ws.close()
        if self._proc is not None:
            self._proc.terminate()
            try:
                await asyncio.to_thread(self._proc.wait, 15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                await asyncio.to_thread(self._proc.wait)
        self._profile.cleanup()

    def logs(self) -> str:
        """The end of Chromium's own output (for a failing test's message)."""
        try:
            return self._log.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    async def _devtools_port(self, path: Path, wait_s: float = 60.0) -> int:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"chromium exited ({self._proc.returncode}): {self.logs()}")
            with contextlib.suppress(OSError, ValueError, IndexError):
                return int((await asyncio.to_thread(path.read_text)).splitlines()[0])
            await asyncio.sleep(0.1)
        raise RuntimeError(
            f"chromium did not open its DevTools port in {wait_s:g} s: {self.logs()}"
        )

    @staticmethod
    def _page_url(port: int) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            targets = json.loads(r.read())
        return str(next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page"))

    async def _read(self, ws: ClientConnection) -> None:
        async for raw in ws:
            msg = json.loads(raw)
            if "id" in msg:
                fut = self._waiting.pop(msg["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif msg.get("method") == "Runtime.consoleAPICalled":
                args = msg["params"].get("args", [])
                self.console.append(
                    " ".join(str(a.get("value", a.get("description", ""))) for a in args)
                )
            elif msg.get("method") == "Log.entryAdded":
                self.console.append(str(msg["params"]["entry"].get("text", "")))
            elif msg.get("method") == "Runtime.exceptionThrown":
                self.console.append(str(msg["params"]["exceptionDetails"]))

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; its result (raises on a protocol error)."""
        assert self._ws is not None
        i = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[i] = fut
        await self._ws.send(json.dumps({"id": i, "method": method, "params": params}))
        msg = await asyncio.wait_for(fut, 30)
        if "error" in msg:
            raise RuntimeError(f"{method}: {msg['error']}")
        return dict(msg.get("result", {}))

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-serialisable values only)."""
        result = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def navigate(self, url: str) -> None:
        """Open a URL and wait until the page has loaded."""
        await self.send("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    async def wait_for(self, expression: str, wait_s: float = 30.0) -> Any:
        """Poll a JavaScript expression until it is truthy; its value."""
        deadline = time.monotonic() + wait_s
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {wait_s:g} s waiting for {expression}; "
                    f"console: {self.console}"
                )
            await asyncio.sleep(0.1)

    async def screenshot(self, path: Path, *, full_page: bool = True) -> Path:
        """A PNG of the page (all of it, or the viewport)."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            size = await self.evaluate(
                "[document.documentElement.scrollWidth, document.documentElement.scrollHeight]"
            )
            params |= {
                "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": size[0], "height": size[1], "scale": 1},
            }
        data = await self.send("Page.captureScreenshot", **params)
        await asyncio.to_thread(path.write_bytes, base64.b64decode(data["data"]))
        return path

"""An event loop on a daemon thread, reached through an anyio BlockingPortal: where the sync hook's
async core runs.

anyio's `start_blocking_portal` runs its loop on an executor thread that interpreter exit waits
for, so a script that forgot `judge.close()` never exited; a daemon thread does not hold the
process, and `stop()` still shuts the loop down cleanly when called.
"""

from __future__ import annotations

import threading

import anyio
from anyio.from_thread import BlockingPortal


class LoopThread:
    """A running event loop on its own daemon thread; `portal` calls into it from other threads."""

    def __init__(self, name: str) -> None:
        self._ready = threading.Event()
        self._portal: BlockingPortal | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(
                f"the background event loop did not start: {self._error}"
            ) from self._error

    @property
    def portal(self) -> BlockingPortal:
        """The portal into the loop."""
        assert self._portal is not None
        return self._portal

    def _run(self) -> None:
        async def serve() -> None:
            async with BlockingPortal() as portal:
                self._portal = portal
                self._ready.set()
                await portal.sleep_until_stopped()

        try:
            anyio.run(serve)
        except BaseException as e:  # reported to the constructor when the loop never came up
            self._error = e
            self._ready.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop (tasks still running are cancelled) and wait for the thread."""
        if self._portal is not None and self._thread.is_alive():
            self._portal.call(self._portal.stop, True)
        self._thread.join(timeout)

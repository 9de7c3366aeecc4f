"""The one way the synchronous forms use the async objects: on the judge's background loop, else a
private one.

`ProgressTracker`, `track`, `select` and `GroupTracker` are the async objects run from
synchronous code. A `BaseJudge` owns a background loop (its HTTP client or model lives there),
so the sync forms call into that loop; any other judge gets a private loop thread. `twin_of`
gives a one-shot synchronous twin (`select` of `aselect`) the async function's parameters:
typed from it by a ParamSpec, its signature not written twice.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AbstractContextManager
from typing import Any, ParamSpec, TypeVar, overload

from anyio.from_thread import BlockingPortal

from .loop import LoopThread

P = ParamSpec("P")
T = TypeVar("T")


class Blocking:
    """Calls from synchronous code into the loop an async object runs on: the judge's own, or a
    private thread's."""

    def __init__(self, judge: object, name: str) -> None:
        self._own: LoopThread | None = None
        # A judge (BaseJudge) owns a loop and hands out its portal; duck-typed, so this plumbing
        # stays below judges.
        portal_of = getattr(judge, "_portal", None)
        if callable(portal_of):
            self.portal: BlockingPortal = portal_of()
        else:
            self._own = LoopThread(name)
            self.portal = self._own.portal

    @overload
    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T: ...
    @overload
    def call(self, fn: Callable[..., T], *args: Any) -> T: ...
    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` (a coroutine function, or a plain one that must run on the loop) and
        block until it returns."""
        return self.portal.call(fn, *args)

    def within(self, fn: Callable[[], Awaitable[T]]) -> T:
        """`call(fn)` in a copy of the caller's context variables (its OpenTelemetry span,
        structlog's context)."""
        return self.portal.call(_run_in, contextvars.copy_context(), fn)

    def enter(self, cm: Any) -> AbstractContextManager[Any]:
        """Enter an async context manager on the loop; the returned manager's `__exit__` leaves
        it there."""
        wrapped = self.portal.wrap_async_context_manager(cm)
        wrapped.__enter__()
        return wrapped

    def close(self) -> None:
        """Stop the private loop, if this made one (a judge's loop stays: other trackers use it)."""
        if self._own is not None:
            self._own.stop()
            self._own = None


async def _run_in(context: contextvars.Context, fn: Callable[[], Awaitable[T]]) -> T:
    # A task of its own, made in the caller's context: the portal would run it in the loop thread's.
    async def run() -> T:
        return await fn()

    return await asyncio.create_task(run(), context=context)


def run_blocking(judge: object, fn: Callable[[], Awaitable[T]], name: str) -> T:
    """Run `fn()` to completion from synchronous code: on the judge's loop, else on a private loop
    that ends with it.

    The caller's context variables go along (its OpenTelemetry span, structlog's bound context).
    """
    sync = Blocking(judge, f"{name}-loop")
    try:
        return sync.within(fn)
    finally:
        sync.close()


def twin_of(
    afn: Callable[P, Coroutine[Any, Any, T]],
) -> Callable[[Callable[..., T]], Callable[P, T]]:
    """Give a synchronous twin `afn`'s parameters (typed by a ParamSpec, signed with its signature):
    written once.

    The twin's body calls `run_blocking(judge, partial(afn, *args, **kwargs), name)`.
    """

    def sign(fn: Callable[..., T]) -> Callable[P, T]:
        fn.__signature__ = inspect.signature(afn)  # type: ignore[attr-defined]
        return fn

    return sign


__all__ = ["Blocking", "run_blocking", "twin_of"]

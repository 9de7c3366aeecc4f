"""A circuit breaker in front of a judge: stop hammering a dead backend, report `degraded`, probe until it is back."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Literal

import structlog

from .base import Judge, JudgeError, JudgeRequest, JudgeResponse

log = structlog.get_logger("agent_monitor.judges.circuit")

State = Literal["closed", "open"]


class CircuitJudge:
    """Wrap a judge: after `threshold` failed calls in a row, fail fast for a cool-down, then let one probe through.

    Only outages count (timeouts, connection errors, 429/5xx, a backend's crash); a 400 is the
    request's fault and does not trip it. Each failed probe doubles the cool-down up to
    `max_cooldown_s`; a successful call closes the circuit. `degraded` is True while it is open;
    a scheduler can `await wait_ready()` instead of spending runs on certain failures.
    """

    def __init__(
        self,
        judge: Judge,
        *,
        threshold: int = 5,
        cooldown_s: float = 2.0,
        max_cooldown_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[bool], object] | None = None,
    ) -> None:
        if threshold < 1 or cooldown_s <= 0 or max_cooldown_s < cooldown_s:
            raise ValueError("circuit needs threshold >= 1 and 0 < cooldown_s <= max_cooldown_s")
        self.inner = judge
        self.name = judge.name
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self.clock = clock
        self.on_change = on_change
        self.state: State = "closed"
        self.degraded = False
        """The judge is failing and calls are being held back (the circuit is open)."""
        self.failures_in_row = 0
        self.trips = 0
        self.open_until = 0.0
        self.last_error: JudgeError | None = None
        self._probing = False
        self._changed = asyncio.Event()

    @property
    def model(self) -> str:
        """The wrapped judge's model id."""
        return str(getattr(self.inner, "model", "") or "")

    async def wait_ready(self) -> bool:
        """Wait until a call would go through; True when the caller now holds the probe and must `release()` it.

        While the circuit is open, one caller at a time probes (all its calls go through) after each
        cool-down; the others wait here instead of spending their work on certain failures.
        """
        while self.state == "open":
            wait = self.open_until - self.clock()
            if wait <= 0 and not self._probing:
                self._probing = True
                return True
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                # Woken early when the circuit closes or the probe is released; else re-checked at the cool-down's end.
                await asyncio.wait_for(changed.wait(), max(wait, 0.05))
        return False

    @contextlib.asynccontextmanager
    async def ready(self) -> AsyncIterator[bool]:
        """`wait_ready()` and, when this caller took the probe, `release()` on the way out; yields whether it did."""
        probe = await self.wait_ready()
        try:
            yield probe
        finally:
            if probe:
                self.release()

    def release(self) -> None:
        """Give back the probe taken by `wait_ready()`."""
        self._probing = False
        self._wake()

    async def grade(self, request: JudgeRequest) -> JudgeResponse:
        """Grade through the wrapped judge unless the circuit is open (then fail fast with `judge_unavailable`)."""
        own_probe = False
        if self.state == "open" and not self._probing:
            remaining = self.open_until - self.clock()
            if remaining > 0:
                raise JudgeError(
                    "judge_unavailable",
                    f"the judge failed {self.failures_in_row} times in a row "
                    f"({self.last_error}); next try in {remaining:.1f} s",
                )
            self._probing = own_probe = True  # a caller that did not wait_ready(): this call is the probe
        try:
            response = await self.inner.grade(request)
        except JudgeError as e:
            self._failed(e)
            raise
        except Exception as e:
            self._failed(JudgeError("judge_exception", f"{type(e).__name__}: {e}"))
            raise
        finally:
            if own_probe:
                self.release()
        self._succeeded()
        return response

    def _failed(self, e: JudgeError) -> None:
        if not (e.retryable or e.reason == "judge_exception"):
            return  # the request's fault (bad request, no such model): the judge itself is up
        self.failures_in_row += 1
        self.last_error = e
        now = self.clock()
        if self.state == "open":
            if now >= self.open_until:  # the probe failed: wait longer before the next one
                self._open(now, e)
        elif self.failures_in_row >= self.threshold:
            self.state, self.degraded = "open", True
            self._open(now, e)
            log.warning("judge_degraded", judge=self.name, failures=self.failures_in_row, error=str(e))
            self._notify(True)

    def _open(self, now: float, e: JudgeError) -> None:
        cooldown = min(self.max_cooldown_s, self.cooldown_s * 2**self.trips)
        self.trips += 1
        self.open_until = now + cooldown
        log.info("judge_down", judge=self.name, retry_in_s=round(cooldown, 2), error=str(e))

    def _succeeded(self) -> None:
        was_open = self.state == "open"
        self.failures_in_row = 0
        self.trips = 0
        self.state, self.degraded = "closed", False
        if was_open:
            log.warning("judge_recovered", judge=self.name)
            self._notify(False)

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _notify(self, degraded: bool) -> None:
        self._wake()
        if self.on_change is not None:
            try:
                self.on_change(degraded)
            except Exception:
                log.exception("circuit_on_change_failed")

    async def aclose(self) -> None:
        """Close the wrapped judge."""
        await self.inner.aclose()

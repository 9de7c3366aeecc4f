"""A circuit breaker in front of a judge: stop hammering a dead backend, report `degraded`, probe
until it is back."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal

import structlog

from .base import Judge, JudgeError, JudgeRequest, JudgeResponse

log = structlog.get_logger("agent_monitor.judges.circuit")

State = Literal["closed", "open"]

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0)
"""Upper bounds (seconds) the calls' wall times are counted in: judge latencies run from tens of
milliseconds (a warm local model) to a minute (a loaded hosted API)."""


@dataclass(frozen=True, slots=True)
class CircuitJudgeStatistics:
    """The calls that reached the wrapped judge, their wall times, its tokens, and the circuit's
    state."""

    calls_ok: int
    calls_failed: int
    """Calls the judge failed (calls refused while the circuit is open never reached it: not
    counted)."""
    latency_buckets: tuple[float, ...]
    """`LATENCY_BUCKETS`: the upper bounds (seconds) of `latency_counts`."""
    latency_counts: tuple[int, ...]
    """Calls by wall time, retries included: one count per bound, then the ones over the last."""
    latency_sum: float
    """The calls' wall times added up, in seconds."""
    input_tokens: int
    """Input tokens the judge reported, cached ones included."""
    cached_input_tokens: int
    output_tokens: int
    degraded: bool
    """Whether the circuit is open now (the judge is failing or silent)."""
    trips: int
    """Times the circuit opened since a call last succeeded (each doubles the next cool-down)."""


class CircuitJudge:
    """Wrap a judge: when it fails or goes silent, fail fast for a cool-down, then let one probe
    through.

    The circuit opens (`degraded`) on either sign of an outage:
    - `threshold` failed calls in a row: a judge that fails fast (refused connections, 5xx);
    - `silence_s` seconds without an answer while at least one call was waiting for one: a judge
      that hangs. The wrapped judge retries inside each call, so with the default retries one call
      to a hanging judge lasts four timeouts plus backoff, and `threshold` such calls take minutes;
      measured in waiting time instead, a hang is reported after `silence_s` whatever the retry
      settings. It defaults to twice the wrapped judge's `timeout_s` (one attempt timing out can
      be bad luck, a second in a row is an outage); `math.inf` turns it off. Only time with a call
      in flight counts, so an idle monitor never degrades, and any answer (a score, or a 400,
      which is the request's fault) starts the count again. A timer on the event loop
      (`loop.call_later`, cancelled when an answer comes or the circuit closes) opens the circuit
      on time while the call is still hanging.

    Only outages count (timeouts, connection errors, 429/5xx, a backend's crash); a 400 is the
    request's fault and does not trip it. Each failed probe doubles the cool-down up to
    `max_cooldown_s`; a successful call, in-flight ones included, closes the circuit. `degraded`
    is True while it is open; a scheduler can `await wait_ready()` instead of spending runs on
    certain failures.
    """

    def __init__(
        self,
        judge: Judge,
        *,
        threshold: int = 5,
        cooldown_s: float = 2.0,
        max_cooldown_s: float = 60.0,
        silence_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[bool], object] | None = None,
    ) -> None:
        if threshold < 1 or cooldown_s <= 0 or max_cooldown_s < cooldown_s:
            raise ValueError("circuit needs threshold >= 1 and 0 < cooldown_s <= max_cooldown_s")
        if silence_s is None:
            timeout = getattr(judge, "timeout_s", None)
            silence_s = (
                2.0 * timeout if isinstance(timeout, (int, float)) and timeout > 0 else math.inf
            )
        if not silence_s > 0:
            raise ValueError(
                f"silence_s={silence_s}; use seconds > 0 (math.inf turns the silence rule off)"
            )
        self.inner = judge
        self.name = judge.name
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self.silence_s = silence_s
        self.clock = clock
        self.on_change = on_change
        self.state: State = "closed"
        self.degraded = False
        """The judge is failing and calls are being held back (the circuit is open)."""
        self.failures_in_row = 0
        self.trips = 0
        self.open_until = 0.0
        self.last_error: JudgeError | None = None
        self._why = ""
        self._probing = False
        self._changed = asyncio.Event()
        # Silence: waiting time (some call in flight) since the judge last answered.
        self._in_flight = 0
        # when the current stretch with calls in flight began (or the last answer in it)
        self._busy_since = 0.0
        self._silent_for = 0.0  # waiting time without an answer before that stretch
        self._watchdog: asyncio.TimerHandle | None = None
        # What the wrapped judge was asked and answered, counted here (plain numbers on the call
        # path) and read by whoever exports them (`statistics()`: the daemon's metrics collector, at
        # scrape time).
        self.calls_ok = 0
        self.calls_failed = 0
        self.latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)
        """Calls by wall time: one count per bound of `LATENCY_BUCKETS`, then the ones over the
        last."""
        self.latency_sum = 0.0
        self.tokens = [0, 0, 0]
        """Every token the judge reported: input (cached included), cached input, output."""

    def statistics(self) -> CircuitJudgeStatistics:
        """The calls that reached the judge (ok, failed), their wall times, its tokens, and the
        circuit's state."""
        return CircuitJudgeStatistics(
            calls_ok=self.calls_ok,
            calls_failed=self.calls_failed,
            latency_buckets=LATENCY_BUCKETS,
            latency_counts=tuple(self.latency_counts),
            latency_sum=self.latency_sum,
            input_tokens=self.tokens[0],
            cached_input_tokens=self.tokens[1],
            output_tokens=self.tokens[2],
            degraded=self.degraded,
            trips=self.trips,
        )

    @property
    def model(self) -> str:
        """The wrapped judge's model id."""
        return str(getattr(self.inner, "model", "") or "")

    @property
    def min_mass(self) -> float | None:
        """The minimum letter mass the wrapped judge recommends, if it has one."""
        value = getattr(self.inner, "min_mass", None)
        return None if value is None else float(value)

    @property
    def context_tokens(self) -> int | None:
        """The wrapped judge's context window in tokens (read each time: it may learn a smaller
        one), if known."""
        value = getattr(self.inner, "context_tokens", None)
        return value if isinstance(value, int) else None

    @property
    def timeout_s(self) -> float | None:
        """The wrapped judge's timeout per attempt, if it has one."""
        timeout = getattr(self.inner, "timeout_s", None)
        return float(timeout) if isinstance(timeout, (int, float)) else None

    async def wait_ready(self) -> bool:
        """Wait until a call would go through; True when the caller now holds the probe and must
        `release()` it.

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
                # Woken early when the circuit closes or the probe is released; else re-checked at
                # the cool-down's end.
                await asyncio.wait_for(changed.wait(), max(wait, 0.05))
        return False

    @contextlib.asynccontextmanager
    async def ready(self) -> AsyncIterator[bool]:
        """`wait_ready()` and, when this caller took the probe, `release()` on the way out;
        yields whether it did."""
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
        """Grade through the wrapped judge unless the circuit is open (then fail fast with
        `judge_unavailable`)."""
        own_probe = False
        if self.state == "open" and not self._probing:
            remaining = self.open_until - self.clock()
            if remaining > 0:
                raise JudgeError(
                    "judge_unavailable",
                    f"the judge {self._why} ({self.last_error}); next try in {remaining:.1f} s",
                )
            # a caller that did not wait_ready(): this call is the probe
            self._probing = own_probe = True
        heard = False
        self._started()
        start = time.perf_counter()
        try:
            response = await self.inner.grade(request)
            heard = True
        except JudgeError as e:
            heard = not _outage(e)  # a 400 is an answer: the judge is up
            self.calls_failed += 1
            self._failed(e)
            raise
        except Exception as e:  # a backend's bug: a failed call as well
            self.calls_failed += 1
            self._failed(JudgeError("judge_exception", f"{type(e).__name__}: {e}"))
            raise
        finally:
            took = time.perf_counter() - start
            self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS, took)] += 1
            self.latency_sum += took
            self._ended(heard)
            if own_probe:
                self.release()
        self.calls_ok += 1
        u, t = response.usage, self.tokens
        t[0] += u.input_tokens
        t[1] += u.cached_input_tokens
        t[2] += u.output_tokens
        self._succeeded()
        return response

    def _failed(self, e: JudgeError) -> None:
        if not _outage(e):
            return  # the request's fault (bad request, no such model): the judge itself is up
        self.failures_in_row += 1
        self.last_error = e
        now = self.clock()
        if self.state == "open":
            if now >= self.open_until:  # the probe failed: wait longer before the next one
                self._open(now, e)
        elif self.failures_in_row >= self.threshold:
            self._trip(now, e, f"failed {self.failures_in_row} times in a row")

    def _trip(self, now: float, e: JudgeError, why: str) -> None:
        self.state, self.degraded = "open", True
        self.last_error, self._why = e, why
        self._open(now, e)
        log.warning("judge_degraded", judge=self.name, why=why, error=str(e))
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
            self._arm()  # calls still in flight are watched again

    # -- silence ----------------------------------------------------------------

    def _silent(self, now: float) -> float:
        """Waiting time since the judge last answered."""
        return self._silent_for + (now - self._busy_since if self._in_flight else 0.0)

    def _started(self) -> None:
        if self._in_flight == 0:
            self._busy_since = self.clock()
        self._in_flight += 1
        if self._watchdog is None:
            self._arm()

    def _ended(self, heard: bool) -> None:
        now = self.clock()
        self._in_flight -= 1
        if heard:
            self._silent_for, self._busy_since = 0.0, now
        elif self._in_flight == 0:
            # Failing calls keep the count; the idle time until the next call does not add to it.
            self._silent_for += now - self._busy_since
        if heard or self._in_flight == 0:
            self._arm()

    def _arm(self) -> None:
        """(Re)schedule the check for the moment the waiting time reaches `silence_s`, if a call
        is waiting."""
        if not (self._in_flight and self.state == "closed" and math.isfinite(self.silence_s)):
            if self._watchdog is not None:
                self._watchdog.cancel()
                self._watchdog = None
            return
        loop = asyncio.get_running_loop()
        due = loop.time() + max(self.silence_s - self._silent(self.clock()), 0.001)
        if self._watchdog is not None:
            if self._watchdog.when() <= due:
                # An answer only moves the moment later: the timer set for the earlier one wakes
                # early and re-arms itself (see _watch), instead of a new timer per answer (one per
                # call when busy).
                return
            self._watchdog.cancel()
        self._watchdog = loop.call_at(due, self._watch)

    def _watch(self) -> None:
        self._watchdog = None
        if not self._in_flight or self.state != "closed":
            return
        now = self.clock()
        silent = self._silent(now)
        if silent < self.silence_s:
            # woken a little early (timer resolution, or a clock that is not the loop's)
            self._arm()
            return
        e = JudgeError(
            "timeout", f"no answer for {silent:.1f} s while calls waited for one", retryable=True
        )
        self._trip(now, e, f"gave no answer for {silent:.1f} s")

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
        """Stop watching for silence and close the wrapped judge."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        await self.inner.aclose()


def _outage(e: JudgeError) -> bool:
    """Whether a failure says the judge is down (retryable, or a backend's crash) rather than the
    request is bad."""
    return e.retryable or e.reason == "judge_exception"

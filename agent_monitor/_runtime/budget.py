"""Time budgets for code that reads untrusted text: no pattern or step may stall scoring.

Step text comes from the network, and so may the patterns that read it
(`regex_capture` in a run's `start.criteria`). A backtracking pattern can take
seconds or hours on a few dozen characters, and CPython's `re` holds the GIL
while it matches, so a worker thread alone would not keep the event loop
responsive. Every pattern the extractors and rules use is therefore compiled
with the `regex` package, whose matcher checks a timeout as it goes and
releases the GIL while it matches (`concurrent=True`), and gets the time left in
the current budget: one budget per step for the rubric's extractors, one per
criterion and prefix for its rules. The tracker runs both in a worker thread.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator
from typing import Any

import regex

DEFAULT_BUDGET_S = 0.05
"""Time for one step's extractors, and for one criterion's rules on one prefix (50 ms)."""

_deadline: contextvars.ContextVar[tuple[float, float] | None] = contextvars.ContextVar(
    "agent_monitor_budget", default=None
)


class BudgetExceeded(Exception):
    """Code reading untrusted text ran past its time budget; `what` names the pattern or step."""

    def __init__(self, what: str, budget_s: float) -> None:
        super().__init__(f"{what} ran over its {budget_s * 1000:g} ms budget")
        self.what = what
        self.budget_s = budget_s


@contextlib.contextmanager
def budget(seconds: float) -> Iterator[None]:
    """Run the block under a time budget: budgeted patterns inside it stop when it is spent."""
    token = _deadline.set((time.monotonic() + seconds, seconds))
    try:
        yield
    finally:
        _deadline.reset(token)


def within(fn: Callable[[], Any], seconds: float, what: str) -> Any:
    """Call `fn()` under a budget of `seconds`; BudgetExceeded if it ran over, even if it
    returned."""
    start = time.monotonic()
    with budget(seconds):
        result = fn()
    # Python code (a registered extractor or rule) cannot be stopped; its late answer is not used
    # either, so one slow step costs the same whether the time went to patterns or to code.
    if time.monotonic() - start > seconds:
        raise BudgetExceeded(what, seconds)
    return result


class Pattern:
    """A compiled pattern that stops at the end of the current budget (the `regex` package; `re`
    syntax)."""

    __slots__ = ("_rx", "groupindex", "groups", "pattern")

    def __init__(self, pattern: str, flags: int = 0) -> None:
        # VERSION0 is `re`-compatible syntax, so patterns written for `re` mean the same here.
        self._rx = regex.compile(pattern, flags | regex.VERSION0)
        self.pattern = pattern
        self.groups: int = self._rx.groups
        self.groupindex: dict[str, int] = dict(self._rx.groupindex)

    def _over(self) -> BudgetExceeded:
        d = _deadline.get()
        return BudgetExceeded(f"pattern {_short(self.pattern)}", d[1] if d else 0.0)

    def _left(self) -> float | None:
        d = _deadline.get()
        if d is None:
            return None
        left = d[0] - time.monotonic()
        if left <= 0:
            raise self._over()
        return left

    def search(self, text: str, pos: int = 0) -> Any:
        """The first match at or after `pos`, or None."""
        try:
            return self._rx.search(text, pos, concurrent=True, timeout=self._left())
        except TimeoutError:
            raise self._over() from None

    def match(self, text: str, pos: int = 0) -> Any:
        """A match at `pos`, or None."""
        try:
            return self._rx.match(text, pos, concurrent=True, timeout=self._left())
        except TimeoutError:
            raise self._over() from None

    def finditer(self, text: str) -> Iterator[Any]:
        """Every match, in order."""
        try:
            yield from self._rx.finditer(text, concurrent=True, timeout=self._left())
        except TimeoutError:
            raise self._over() from None

    def findall(self, text: str) -> list[Any]:
        """Every match as `re.findall` gives it."""
        try:
            found: list[Any] = self._rx.findall(text, concurrent=True, timeout=self._left())
        except TimeoutError:
            raise self._over() from None
        return found

    def sub(self, repl: str | Callable[[Any], str], text: str, count: int = 0) -> str:
        """The text with matches replaced."""
        try:
            out: str = self._rx.sub(repl, text, count, concurrent=True, timeout=self._left())
        except TimeoutError:
            raise self._over() from None
        return out

    def __repr__(self) -> str:
        return f"Pattern({self.pattern!r})"


def _short(pattern: str) -> str:
    return repr(pattern if len(pattern) <= 40 else pattern[:37] + "...")


error = regex.error
IGNORECASE, DOTALL, MULTILINE = regex.IGNORECASE, regex.DOTALL, regex.MULTILINE

"""The judge interface: one async call from a prompt to letter log-probabilities, with retries
and limits."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import email.utils
import math
import random
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import structlog

from .._runtime.loop import LoopThread
from .._runtime.tokens import estimate_tokens
from ..progress import Usage
from ..prompts import Prompt
from ..scale import DEFAULT_MIN_MASS, read_binary, read_letter

if TYPE_CHECKING:
    from anyio.from_thread import BlockingPortal

log = structlog.get_logger("agent_monitor.judges")


FRAMES_NOT_SEEN = "frames are not seen by this judge"
"""What serve, the demo and a run's page say when a judge gets camera frames as text
placeholders."""


def sees_frames(judge: object) -> bool | None:
    """Whether camera frames reach a judge as pixels (False: as text placeholders; None: known at
    its first frame)."""
    name = getattr(judge, "name", "")
    if name == "llamacpp":
        return False  # text-only: a frame is read as its one-line description
    if name not in ("openai", "gemini"):
        return None
    vision = getattr(judge, "vision", None)
    if vision is False or getattr(judge, "api", "chat") == "completions":
        return False
    # None: the server says at the first frame (judge_refuses_images)
    return True if vision is True else None


class JudgeError(Exception):
    """A judge call that failed; `reason` is a short machine-readable cause.

    `retryable` says whether trying again may help (429, 5xx, timeouts,
    connection errors); `retry_after` is the server's hint in seconds, if any.
    """

    def __init__(
        self,
        reason: str,
        message: str,
        *,
        retryable: bool = False,
        retry_after: float | None = None,
        limit: int | None = None,
        requested: int | None = None,
    ) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.retryable = retryable
        self.retry_after = retry_after
        self.limit = limit
        """With reason `context_overflow`: the judge's context in tokens, when the refusal said
        it."""
        self.requested = requested
        """With reason `context_overflow`: the tokens the refused request needed, when the
        refusal said it."""


@dataclass(frozen=True, slots=True)
class JudgeRequest:
    """What to grade: the prompt, how many repeats, and the run the call belongs to.

    `run_key` is a stable id of the run (every tracker sets it: the run id, else an
    anonymous id of its own). It never enters the prompt; a judge may use it to keep
    one KV prefix per run (LlamaCppJudge) or pass it to a server as a cache hint.
    None: the caller did not say (such calls share one prefix).
    """

    prompt: Prompt
    repeats: int = 1
    run_key: str | None = None


@dataclass(frozen=True, slots=True)
class JudgeResponse:
    """The judge's answer: per repeat, candidate tokens at the letter position and their logprobs.

    An entry of `samples` is None when that repeat produced no answer position
    at all (e.g. an empty completion); the scorer turns it into a failure.
    `draws` > 0 marks a judge without logprobs: each sample is then the
    empirical letter frequencies (as logprobs) of that many sampled answers.
    `images_dropped` counts the prompt's image parts the judge got as text
    placeholders instead of pixels in the request it answered (0: it saw every frame).
    """

    samples: tuple[Mapping[str, float] | None, ...]
    model: str
    usage: Usage = field(default_factory=Usage)
    latency_s: float = 0.0
    attempts: int = 1
    draws: int = 0
    images_dropped: int = 0


Sample = Mapping[str, float] | None
"""Candidate tokens at the answer position and their logprobs, or None when a repeat gave no
answer."""


@runtime_checkable
class Judge(Protocol):
    """Anything that grades a prompt: the narrow seam between scoring and model backends.

    A judge may also carry `min_mass`, the minimum letter mass it recommends (see
    `recommended_min_mass`); trackers use it when the user sets none.
    """

    name: str

    async def grade(self, request: JudgeRequest) -> JudgeResponse:
        """Grade one prompt, `request.repeats` times; raise JudgeError on failure."""
        ...

    async def aclose(self) -> None:
        """Release connections and models."""
        ...


@runtime_checkable
class Summariser(Protocol):
    """A judge that also writes one plain text completion: the summaries of an LLM digest
    (`--digest judge|MODEL`)."""

    async def summarise(
        self, text: str, *, max_tokens: int, model: str | None = None
    ) -> tuple[str, Usage]:
        """Complete `text` in at most `max_tokens` tokens with `model` (None: the judge's own); the
        text and its usage.

        Raise JudgeError on failure (the chunk then keeps its deterministic digest lines).
        """
        ...


def summariser(judge: object) -> Summariser | None:
    """`judge`, or the judge it wraps (a circuit breaker's `inner`), when it can summarise; else
    None."""
    for _ in range(4):
        if isinstance(judge, Summariser):
            return judge
        judge = getattr(judge, "inner", None)
        if judge is None:
            return None
    return None


def require_summariser(judge: object, digest: str | None) -> Summariser | None:
    """The summariser an LLM digest (`digest` not None) uses, checked at start-up; None for the
    deterministic digest."""
    if digest is None:
        return None
    found = summariser(judge)
    if found is None:
        raise ValueError(
            f"digest={digest!r} needs a judge that can summarise (OpenAIJudge, LlamaCppJudge, "
            "FakeJudge); "
            f"{type(judge).__name__} cannot: leave digest unset (the deterministic digest) or "
            "use one of those"
        )
    return found


class BaseJudge(abc.ABC):
    """Shared machinery for judges: concurrency limit, per-call timeout, retries with jittered
    backoff.

    Subclasses implement `_call`. One judge object belongs to one event loop
    (its SDK client does too); synchronous trackers sharing it run on the
    judge's own background loop (`_portal`).
    """

    name = "judge"
    min_mass: float | None = None
    """The minimum letter mass this judge recommends; None: the library default
    (`DEFAULT_MIN_MASS`).

    Trackers and the daemon use it when the user sets no `min_mass`; an explicit value always wins.
    """

    def __init__(
        self,
        *,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 20.0,
        concurrency: int = 8,
        context_tokens: int | None = None,
    ) -> None:
        if timeout_s <= 0 or max_retries < 0 or concurrency < 1:
            raise ValueError("judge needs timeout_s > 0, max_retries >= 0 and concurrency >= 1")
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.concurrency = concurrency
        self.context_tokens = context_tokens
        """The judge's context window in tokens (prompt and answer), None while unknown: set by the
        user, read from the server or model, or learned from a context-length refusal; prompt
        budgets are taken from it."""
        self.model = ""
        self._fits_below: int | None = None
        """Learned from context-length refusals: a request whose estimated tokens (`request_tokens`)
        are over this is refused here, never sent (None: no refusal yet)."""
        self.context_refused = 0
        """Requests refused here, without a network call, as over the context the judge learned
        from a refusal."""
        self._sem: asyncio.Semaphore | None = None
        self._sem_loop: asyncio.AbstractEventLoop | None = None
        self._loop: LoopThread | None = None
        self._portal_lock = threading.Lock()
        self._spent = [0, 0, 0]
        """Input, cached input and output tokens of the calls that succeeded (`usage`), counted
        as plain numbers."""
        self.calls = 0
        self.failures = 0

    @property
    def usage(self) -> Usage:
        """Tokens the calls that succeeded spent, summed over this judge's life."""
        return Usage(*self._spent)

    @usage.setter
    def usage(self, usage: Usage) -> None:
        # A subclass (or a caller resetting the count) may still assign it, as when it was a plain
        # attribute.
        self._spent = [usage.input_tokens, usage.cached_input_tokens, usage.output_tokens]

    @abc.abstractmethod
    async def _call(self, request: JudgeRequest) -> JudgeResponse:
        """One attempt at grading, without limits or retries; raise JudgeError on failure."""

    def _limit(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._sem is None or self._sem_loop is not loop:
            if self._sem is not None:
                raise RuntimeError(
                    f"{type(self).__name__} is already used from another event loop; "
                    "use one judge per event loop (sync trackers share the judge's own loop)"
                )
            self._sem, self._sem_loop = asyncio.Semaphore(self.concurrency), loop
        return self._sem

    @property
    def answer_tokens(self) -> int:
        """Tokens an answer may take (the request's max tokens); a request needs its prompt's and
        these."""
        return 1

    def request_tokens(self, request: JudgeRequest) -> int:
        """A request's tokens as `estimate_tokens` counts them (an upper estimate): its prompt's
        text and its answer."""
        return estimate_tokens(request.prompt.text()) + self.answer_tokens

    def learn_context(self, request: JudgeRequest, error: JudgeError) -> None:
        """Learn from a context-length refusal of `request`: lower `context_tokens`, and refuse such
        sizes from now on.

        The refusal's numbers, when it gives them (the limit N, the tokens M the request needed),
        calibrate the estimate: a request estimated at E tokens needed M, so one estimated over E x
        N / M would not fit. Without them, any request estimated at E or more is refused, and the
        context is taken as below E.
        """
        size = self.request_tokens(request)
        limit, needed = error.limit, error.requested
        fits_below = size * limit // needed if limit and needed and needed > limit else size - 1
        self._fits_below = (
            fits_below if self._fits_below is None else min(self._fits_below, fits_below)
        )
        learned = limit if limit else max(1, size - 1)
        was = self.context_tokens
        if was is None or learned < was:
            self.context_tokens = learned
        log.warning(
            "judge_context_learned",
            judge=self.name,
            context_tokens=self.context_tokens,
            was=was,
            refused_tokens_estimated=size,
            hint="requests estimated over the learned size are refused without being sent "
            "(context_overflow); "
            "set --judge-context to the judge's real context if this is wrong",
        )

    def _over_context(self, request: JudgeRequest) -> JudgeError | None:
        """A `context_overflow` for a request a context-length refusal showed too long, without
        sending it."""
        if self._fits_below is None:
            return None  # nothing refused yet: no estimate is spent on the prompt
        size = self.request_tokens(request)
        if size <= self._fits_below:
            return None
        return JudgeError(
            "context_overflow",
            f"the request is about {size} tokens (estimated), over the "
            f"{self.context_tokens}-token context the "
            "judge learned from an earlier refusal; not sent. Give the judge fewer steps, or "
            "a judge with a "
            "larger context",
            limit=self.context_tokens,
        )

    async def grade(self, request: JudgeRequest) -> JudgeResponse:
        """Grade with the concurrency limit, a timeout per attempt, and bounded retries.

        A request a context-length refusal showed too long is refused (`context_overflow`) without
        being sent; a refusal for length is never retried and teaches the judge its context
        (`learn_context`).
        """
        start = time.perf_counter()
        attempt = 0
        if (over := self._over_context(request)) is not None:
            self.calls += 1
            self.failures += 1
            self.context_refused += 1
            try:
                raise over
            finally:
                del over  # see below: no local may hold the error this frame raises
        async with self._limit():
            while True:
                attempt += 1
                try:
                    async with asyncio.timeout(self.timeout_s):
                        resp = await self._call(request)
                except TimeoutError:
                    err = JudgeError(
                        "timeout", f"no answer within {self.timeout_s:g} s", retryable=True
                    )
                except JudgeError as e:
                    err = e
                else:
                    self.calls += 1
                    u, t = resp.usage, self._spent
                    t[0] += u.input_tokens
                    t[1] += u.cached_input_tokens
                    t[2] += u.output_tokens
                    return replace(resp, latency_s=time.perf_counter() - start, attempts=attempt)
                if (
                    err.reason == "context_overflow"
                    or not err.retryable
                    or attempt > self.max_retries
                ):
                    break
                await asyncio.sleep(self._delay(attempt, err.retry_after))
        if err.reason == "context_overflow":
            self.learn_context(request, err)
        self.calls += 1
        self.failures += 1
        # Raised without the failed attempt's traceback, whose frames hold the request body
        # (megabytes of prompt on a long run), and with no local left holding it: `err` -> traceback
        # -> this frame -> `err` is a cycle only the cyclic GC frees, late (the daemon runs it
        # seldom). Kept, every failed call left its prompt behind a while, and the daemon's RSS grew
        # with each one (issue 42: 78 -> 420 MB over 472 failed calls).
        try:
            raise err.with_traceback(None)
        finally:
            del err

    async def _repeats(
        self, k: int, ask: int, request: Callable[[int], Awaitable[tuple[list[Sample], Usage]]]
    ) -> tuple[list[Sample], Usage, bool | None]:
        """Collect k samples: one request for `ask` of them, then single requests for whatever is
        missing.

        Returns the samples, the usage, and whether the server honoured a batch
        (None when none was asked). A server that answers a batch with fewer
        samples, or refuses it with a 400, gets single requests.
        """
        batch: bool | None = None
        try:
            samples, usage = await request(ask)
            if ask > 1:
                batch = len(samples) >= ask
        except JudgeError as e:
            if ask == 1 or e.reason != "bad_request":
                raise
            samples, usage, batch = [], Usage(), False
        missing = k - len(samples)
        if missing > 0:
            for more, u in await asyncio.gather(*(request(1) for _ in range(missing))):
                samples.extend(more[:1])
                usage += u
        return samples[:k], usage, batch

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        # Full jitter (AWS architecture blog) spreads retries of many runs apart;
        # a server's Retry-After is a floor, capped so one bad hint cannot stall a run.
        delay = random.uniform(0, min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)))
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.max_backoff_s))
        return delay

    def _portal(self) -> BlockingPortal:
        """The judge's background event loop, started on first use by a synchronous tracker."""
        with self._portal_lock:
            if self._loop is None:
                self._loop = LoopThread(f"{type(self).__name__}-loop")
            return self._loop.portal

    async def aclose(self) -> None:  # noqa: B027 - a judge with nothing to release need not override it
        """Release the judge's resources."""

    def close(self) -> None:
        """Release resources and stop the background loop used by synchronous trackers."""
        with self._portal_lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            with contextlib.suppress(Exception):
                loop.portal.call(self.aclose)
            loop.stop()

    def __enter__(self) -> BaseJudge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> BaseJudge:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def recommended_min_mass(judge: object) -> float:
    """The minimum letter mass `judge` recommends (its `min_mass`), else the library default
    DEFAULT_MIN_MASS."""
    value = getattr(judge, "min_mass", None)
    return DEFAULT_MIN_MASS if value is None else float(value)


def answer_sample(
    generated: Sequence[tuple[str, float | None]],
    alternatives: Sequence[Iterable[tuple[str, float | None]]],
) -> Sample:
    """Candidates and logprobs at the answer position of one generated answer.

    The answer position is the first generated token that is exactly a scale
    letter (so "The" or "Grade" before the letter is skipped), else the first
    token. `alternatives[i]` are the top candidates at position i; the token
    actually generated there is added when the top list lacks it. None when
    nothing was generated.
    """
    if not generated:
        return None
    # The first generated token that is an answer: a letter, or True / False for a binary rubric.
    pos = next(
        (
            i
            for i, (t, _) in enumerate(generated)
            if read_letter(t) is not None or read_binary(t) is not None
        ),
        0,
    )
    cands: dict[str, float] = {}
    if pos < len(alternatives):
        for token, lp in alternatives[pos]:
            if lp is not None:
                cands.setdefault(token, lp)
    token, lp = generated[pos]
    if lp is not None:
        cands.setdefault(token, lp)
    return cands


def drawn_letter(text: str) -> dict[str, float]:
    """One sampled answer (a judge without logprobs) as a sample: the letter it is exactly, else
    nothing.

    Trailing punctuation is allowed ("K." is K); "The answer is K" is not a letter.
    """
    answer = text.strip().rstrip(".,;:!)")
    letter = read_letter(answer)
    if letter:
        return {letter: 0.0}
    binary = read_binary(answer)
    return {} if binary is None else {"True" if binary else "False": 0.0}


def tally(draws: Sequence[Sample], repeats: int, samples: int) -> tuple[Sample, ...]:
    """Each repeat's letter frequencies, as logprobs, over its `samples` draws (draws in repeat
    order).

    Frequencies are over all draws, so answers that are not a letter lower the mass.
    """
    out: list[Sample] = []
    for r in range(repeats):
        group = draws[r * samples : (r + 1) * samples]
        counts: dict[str, int] = {}
        for d in group:
            for letter in d or {}:
                counts[letter] = counts.get(letter, 0) + 1
        out.append({letter: math.log(c / len(group)) for letter, c in counts.items()})
    return tuple(out)


def batches(total: int, size: int) -> list[int]:
    """`total` split into requests of at most `size`."""
    return [size] * (total // size) + ([total % size] if total % size else [])


# What servers answer when a request is over the model's context (a 400), as their code or their
# users' reports show it; the numbers are read where given (N: the context, M: what the request
# needed).
# - OpenAI: code `context_length_exceeded`, "This model's maximum context length is N tokens.
#   However, your
# messages resulted in M tokens..." (or "you requested M tokens (... in the messages, ... in the
# completion)").
# - vLLM: "This model's maximum context length is N tokens. However, you requested M tokens (...)",
#   newer
# "The prompt (total length M) is longer than the maximum model length of N." and "Input prompt (M
# tokens) is too long and exceeds limit of N".
# - llama.cpp's llama-server: "the request exceeds the available context size, try increasing it",
#   type
#   `exceed_context_size_error` with fields n_prompt_tokens (M) and n_ctx (N) beside the message.
# - Anthropic: "prompt is too long: M tokens > N maximum".
# - Gemini: "The input token count (M) exceeds the maximum number of tokens allowed (N)."
# - SGLang: "The input (M tokens) is longer than the model's context length (N tokens)."
_CONTEXT_REFUSAL = re.compile(
    r"context_length_exceeded|exceed_context_size_error|maximum context length|maximum model length"
    r"|exceeds the available context size|prompt is too long|exceeds limit of \d+"
    r"|exceeds the maximum number of tokens|longer than the model's context length",
    re.IGNORECASE,
)
_CONTEXT_LIMIT = re.compile(
    r"maximum context length is (\d+)|maximum model length of (\d+)|exceeds limit of "
    r"(\d+)|tokens > (\d+) maximum"
    r"|maximum number of tokens allowed \((\d+)\)|model's context length \((\d+) "
    r"tokens\)|\bn_ctx\W{1,3}(\d+)",
    re.IGNORECASE,
)
_CONTEXT_NEEDED = re.compile(
    r"you requested (\d+) tokens|resulted in (\d+) tokens|total length (\d+)\)|prompt \((\d+) "
    r"tokens\)"
    r"|prompt is too long: (\d+) tokens|input token count \((\d+)\)|input \((\d+) tokens\)"
    r"|\bn_prompt_tokens\W{1,3}(\d+)",
    re.IGNORECASE,
)


def context_refusal(status: int, message: str) -> JudgeError | None:
    """The `context_overflow` error for an HTTP refusal whose message says the request is over the
    context, else None.

    Only a 4xx counts (servers answer 400, some 413 or 422); the context (N) and what the request
    needed (M) are read from the message where it says them (`JudgeError.limit`, `.requested`).
    Never retried.
    """
    if not 400 <= status < 500 or _CONTEXT_REFUSAL.search(message) is None:
        return None

    def number(pattern: re.Pattern[str]) -> int | None:
        m = pattern.search(message)
        return int(next(g for g in m.groups() if g is not None)) if m else None

    return JudgeError(
        "context_overflow",
        f"HTTP {status}: {message}; the prompt is over the judge's context: give it fewer "
        "steps, set "
        "--judge-context, or use a judge with a larger context",
        limit=number(_CONTEXT_LIMIT),
        requested=number(_CONTEXT_NEEDED),
    )


def retry_after_seconds(headers: Mapping[str, str]) -> float | None:
    """A server's wait hint from `retry-after-ms` or `Retry-After` (seconds or an HTTP date), if
    any."""
    if ms := headers.get("retry-after-ms"):
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())

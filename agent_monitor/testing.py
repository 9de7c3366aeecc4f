"""Test helpers for users' tests (and ours): `FakeJudge`, a scripted judge with exact letter
distributions.

```python
from agent_monitor import ProgressTracker
from agent_monitor.testing import FakeJudge

judge = FakeJudge(["C", {"J": 0.7, "K": 0.3}, FakeJudge.failure("timeout")])
tracker = ProgressTracker("Make the test pass", judge=judge)
tracker.update("ran pytest").score        # 2/19: all mass on C
tracker.update("fixed the bug").score     # (0.7*9 + 0.3*10)/19
tracker.update("ran pytest again").reason # "timeout": a failure, never a made-up score
```

An answer is a letter (all probability on it), a mapping of tokens to *probabilities* (tokens that
are not scale letters, like `"The"`, take mass away from the letters, as a real model's do), a list
of those, one per repeat (`["C", "K", "T"]` with `repeats=3`: the repeats disagree; the last is used
for further repeats), or an exception to raise (`FakeJudge.failure(reason)` gives a `JudgeError`
with the real reason and retry semantics). Answers come from a list (one per call, the last one
repeated), or from a function of the prompt. With no answers, progress grows one letter per step.

Each answered call reports `usage`: a fixed `Usage`, or a function of the prompt; by default the
prompt's characters stand in for input tokens, with one output token. A failed call reports none.

```python
from agent_monitor import Prices, Usage

judge = FakeJudge(["C"], usage=Usage(input_tokens=1000, cached_input_tokens=600, output_tokens=1))
tracker = ProgressTracker("Make the test pass", judge=judge, prices=Prices(input=2.0, output=8.0,
cached_input=0.5)) tracker.update("ran pytest") tracker.update("fixed the bug") tracker.usage #
Usage(input_tokens=2000, cached_input_tokens=1200, output_tokens=2) tracker.cost # (800 * 2.0 + 1200
* 0.5 + 2 * 8.0) / 1e6 = 0.002216 tracker.close()
```
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeAlias

from .judges.base import BaseJudge, JudgeError, JudgeRequest, JudgeResponse
from .progress import FAILURES, OUTAGE_REASONS, Usage
from .prompts import Prompt, TextPart
from .scale import LETTERS

Answer: TypeAlias = str | Mapping[str, float] | list[str | Mapping[str, float]] | BaseException
"""A letter, a token -> probability mapping, a list of those (one per repeat), or an exception to
raise."""


def letter_at(step: int) -> str:
    """The letter for progress growing one letter per step (A at step 0, T from step 19 on)."""
    return LETTERS[min(max(step, 0), len(LETTERS) - 1)]


class FakeJudge(BaseJudge):
    """A judge whose answers are scripted; it records every request (`record=False`: none, for
    benchmarks).

    Retries, timeouts and the concurrency limit are BaseJudge's, as for a real judge.
    """

    name = "fake"

    def __init__(
        self,
        answers: Iterable[Answer] | Callable[[Prompt], Answer] | None = None,
        *,
        latency_s: float = 0.0,
        model: str = "fake-1",
        record: bool = True,
        max_retries: int = 0,
        usage: Usage | Callable[[Prompt], Usage] | None = None,
        summary: Callable[[str], str | BaseException] | None = None,
        **options: float,
    ) -> None:
        super().__init__(max_retries=max_retries, **options)  # type: ignore[arg-type]
        self._script: list[Answer] | None = None
        self._answer: Callable[[Prompt], Answer] = lambda p: letter_at(p.step)
        if callable(answers):
            self._answer = answers
        elif answers is not None:
            self._script = list(answers)
            if not self._script:
                raise ValueError(
                    "FakeJudge needs at least one answer (or none at all for the default)"
                )
        if latency_s < 0:
            raise ValueError(f"latency_s={latency_s}; use 0 or more")
        self.latency_s = latency_s
        self._usage: Callable[[Prompt], Usage] = (
            (lambda p: Usage(input_tokens=_characters(p), output_tokens=1))
            if usage is None
            else usage
            if callable(usage)
            else (lambda _p: usage)
        )
        self.model = model
        self.record = record
        self.requests: list[JudgeRequest] = []
        self.calls_made = 0
        self._summary = summary
        self.summarised: list[tuple[str, int, str | None]] = []
        """Every summary asked (an LLM digest): its prompt, max tokens and model (None: the
        judge's own)."""

    @property
    def prompts(self) -> list[Prompt]:
        """Every prompt the judge was asked, in order."""
        return [r.prompt for r in self.requests]

    @staticmethod
    def failure(reason: str, message: str = "", *, retry_after: float | None = None) -> JudgeError:
        """A JudgeError as a real backend raises it for `reason` (outages are retryable; see
        progress.FAILURES)."""
        if reason not in FAILURES:
            raise ValueError(f"unknown failure reason {reason!r}; use one of {', '.join(FAILURES)}")
        return JudgeError(
            reason,
            message or FAILURES[reason],
            retryable=reason in OUTAGE_REASONS,
            retry_after=retry_after,
        )

    async def _call(self, request: JudgeRequest) -> JudgeResponse:
        if self.record:
            self.requests.append(request)
        self.calls_made += 1
        if self._script is not None:
            answer = self._script[min(self.calls_made - 1, len(self._script) - 1)]
        else:
            answer = self._answer(request.prompt)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        if isinstance(answer, BaseException):
            raise answer
        if isinstance(answer, list):
            if not answer:
                raise ValueError("FakeJudge answer []: give at least one answer per call")
            per_repeat = [answer[min(i, len(answer) - 1)] for i in range(request.repeats)]
        else:
            per_repeat = [answer] * request.repeats
        return JudgeResponse(
            samples=tuple(_logprobs(a) for a in per_repeat),
            model=self.model,
            usage=self._usage(request.prompt),
        )

    async def summarise(
        self, text: str, *, max_tokens: int, model: str | None = None
    ) -> tuple[str, Usage]:
        """A scripted summary of `text` (`summary=`: a function of the text; default "summary of N
        characters").

        Usage: the text's characters as input tokens, the summary's as output tokens. An exception
        the script returns is raised (a failed summary call).
        """
        self.summarised.append((text, max_tokens, model))
        out = (
            f"summary of {len(text):,} characters" if self._summary is None else self._summary(text)
        )
        if isinstance(out, BaseException):
            raise out
        return out, Usage(input_tokens=len(text), output_tokens=len(out))


def _characters(prompt: Prompt) -> int:
    # The prompt's text length stands in for its tokens; summed, not rendered, so the fake costs
    # next to nothing.
    return len(prompt.instructions) + sum(
        len(p.text) for p in prompt.parts if isinstance(p, TextPart)
    )


def _logprobs(answer: str | Mapping[str, float]) -> dict[str, float]:
    if isinstance(answer, str):
        return {answer: 0.0}
    out: dict[str, float] = {}
    for token, p in answer.items():
        if not (isinstance(p, (int, float)) and 0.0 <= p <= 1.0):
            raise ValueError(
                f"FakeJudge answer {dict(answer)!r}: probabilities must be in [0, 1], got {p!r}"
            )
        if p > 0.0:
            out[token] = math.log(p)
    return out


def prompt_key(prompt: Prompt) -> str:
    """A prompt's identity for a recorded answer: its instructions, text parts and criterion,
    hashed."""
    h = hashlib.sha256()
    for text in (
        prompt.instructions,
        prompt.criterion,
        *(p.text for p in prompt.parts if isinstance(p, TextPart)),
    ):
        h.update(text.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


class ReplayJudge(FakeJudge):
    """A scripted judge that replays a real judge's recorded letter distributions and token counts,
    by prompt.

    `answers` maps `prompt_key(prompt)` to `{"p": {letter: probability}, "in": input tokens,
    "cached": cached input tokens, "out": output tokens}` (what `record_answer` writes), or to
    `{"error": reason}` for a prompt the recorded judge failed on (replayed as that failure); `load`
    reads a (gzipped) JSON file of them. Every repeat gets the recorded distribution (the recording
    judge was deterministic); each call reports the recorded usage times `request.repeats` (a server
    without a prefix cache reads the prompt once per repeat). A prompt that was never recorded fails
    as `bad_response`: a replay never makes up a score.
    """

    name = "replay"

    def __init__(
        self,
        answers: Mapping[str, Mapping[str, Any]],
        *,
        model: str = "replay",
        min_mass: float | None = None,
        record: bool = False,
    ) -> None:
        self.answers = dict(answers)
        self.missing = 0
        """Prompts asked that were never recorded (each failed)."""
        super().__init__(self._replay, model=model, record=record, usage=self._usage_of)
        self.min_mass = min_mass
        """The recorded judge's recommended minimum letter mass (a tiny local model's is low)."""

    @classmethod
    def load(cls, path: str | Path, **options: Any) -> ReplayJudge:
        """A replay judge from a JSON file (gzipped when its name ends in .gz) written by
        `save_answers`."""
        p = Path(path)
        raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
        data = json.loads(raw)
        mass = data.get("min_mass")
        return cls(
            data["answers"],
            model=str(data.get("model") or "replay"),
            min_mass=None if mass is None else float(mass),
            **options,
        )

    def _replay(self, prompt: Prompt) -> Answer:
        got = self.answers.get(prompt_key(prompt))
        if got is None:
            self.missing += 1
            return FakeJudge.failure(
                "bad_response", f"no recorded answer for this prompt (step {prompt.step})"
            )
        # the recorded judge failed on this prompt (e.g. context_overflow): so does the replay
        if "error" in got:
            return FakeJudge.failure(str(got["error"]), f"recorded failure (step {prompt.step})")
        return {k: float(v) for k, v in got["p"].items()}

    def _usage_of(self, prompt: Prompt) -> Usage:
        got = self.answers.get(prompt_key(prompt))
        if got is None or "error" in got:
            return Usage()
        return Usage(int(got["in"]), int(got.get("cached", 0)), int(got.get("out", 1)))

    async def _call(self, request: JudgeRequest) -> JudgeResponse:
        r = await super()._call(request)
        return JudgeResponse(
            samples=r.samples,
            model=r.model,
            usage=_times(r.usage, request.repeats),
            latency_s=r.latency_s,
        )


def _times(u: Usage, k: int) -> Usage:
    return Usage(u.input_tokens * k, u.cached_input_tokens * k, u.output_tokens * k)


def record_answer(
    prompt: Prompt, response: JudgeResponse, *, digits: int = 4
) -> tuple[str, dict[str, Any]]:
    """One real answer as `ReplayJudge` replays it: the first repeat's letter probabilities,
    rounded, and its usage.

    Tokens that are not scale letters are kept as one `"other"` entry, so the letter mass replays
    too.
    """
    sample = response.samples[0] if response.samples else None
    probs: dict[str, float] = {}
    if sample is not None:
        letters: dict[str, float] = {}
        for token, lp in sample.items():
            t = token.strip()
            if len(t) == 1 and t in LETTERS:
                letters[t] = letters.get(t, 0.0) + math.exp(lp)
        probs = {k: round(v, digits) for k, v in sorted(letters.items()) if round(v, digits) > 0}
        rest = round(max(0.0, 1.0 - sum(probs.values())), digits)
        if rest > 0:
            probs["other"] = rest
    k = max(1, len(response.samples))
    u = response.usage
    return prompt_key(prompt), {
        "p": probs,
        "in": u.input_tokens // k,
        "cached": u.cached_input_tokens // k,
        "out": max(1, u.output_tokens // k),
    }


def save_answers(
    path: str | Path,
    answers: Mapping[str, Mapping[str, Any]],
    *,
    model: str,
    min_mass: float | None = None,
) -> Path:
    """Write recorded answers for `ReplayJudge.load` (gzipped when the name ends in .gz), with
    the judge's model."""
    p = Path(path)
    body = {"model": model, "min_mass": min_mass, "answers": dict(sorted(answers.items()))}
    raw = json.dumps(body, separators=(",", ":")).encode()
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(gzip.compress(raw, mtime=0) if p.suffix == ".gz" else raw)
    return p


__all__ = [
    "Answer",
    "FakeJudge",
    "ReplayJudge",
    "letter_at",
    "prompt_key",
    "record_answer",
    "save_answers",
]

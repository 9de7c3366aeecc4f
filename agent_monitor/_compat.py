"""The reference library's (llm-verifier's) call forms, read at the edge of `select`, `compare`,
`track`, trackers.

`import agent_monitor as llm_verifier` runs its documented calls: `problem=`, `trace_a=`/`trace_b=`,
`n_evaluations=` (our `repeats`), `max_workers=` (the judge's concurrency), `model=`, `client=`,
`ground_truth_note=`, `checkpoint_steps=`, `on_error=`, `progress=`, and the skill's editable
progress template `prompt=` (trackers, track); one image or a list, a candidate as one string.
Without `judge=` the judge comes from the environment (`judge_from_env`). Options that have no
meaning here are refused with what to use instead, never ignored. Where we differ on purpose (a
failed call is a failure, never a score; `compare` asks both slot orders) docs/coming-from.md says
why.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from ._runtime.sync import run_blocking
from .criteria import CriteriaSpec, Rubric, load_criteria
from .judges.base import BaseJudge, JudgeError
from .options import OPTION_NAMES
from .progress import Progress
from .templates import load_template

Kind = Literal["select", "compare", "track", "tracker"]
F = TypeVar("F", bound=Callable[..., Any])

JUDGE_URL_ENV = "AGENT_MONITOR_JUDGE_URL"
JUDGE_CONTEXT_ENV = "AGENT_MONITOR_JUDGE_CONTEXT"
"""The judge's context window in tokens (the environment twin of `--judge-context`); unset: the
server's, or learned."""
"""An OpenAI-compatible judge server's base URL; `model=` then names the model on it (default: the
one it lists)."""

# The reference library's defaults for K where they are not ours (its select repeats 4 times, the
# rest once).
_REFERENCE_REPEATS = {"select": 4, "compare": 1, "track": 1, "tracker": 1}
_RENAMED = {"problem": "task", "trace_a": "a", "trace_b": "b"}
# Options of the reference library that agent-monitor has no use for, and what to use instead.
_REFUSED = {
    "cache": "agent-monitor keeps no score-cache file; pass compare_fn= (e.g. a memoised "
    "compare) to select, "
    "or rely on the judge server's prefix cache (prompts are prefix-stable)",
}


class MissingJudgeError(ValueError):
    """No judge was given and none can be built from the environment."""


class UnsupportedOption(TypeError):
    """A reference-library option that has no meaning here; the message says what to use instead."""


def read_dotenv(path: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """`KEY=value` lines of `.env` in the working directory (or `path`), as the reference library
    reads them.

    Blank lines and `#` comments are skipped; the value is what follows the first `=`, stripped.
    The process environment wins over the file (the library's `os.environ.setdefault`); unlike the
    library, the file is read into the returned mapping only, never into `os.environ`.
    """
    p = Path(path) if path is not None else Path.cwd() / ".env"
    values: dict[str, str] = {}
    try:
        text = p.read_text(encoding="utf-8")
    except OSError:
        return values
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            values.setdefault(k.strip(), v.strip())
    return values


def settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment the judge is built from: `.env` under the process environment."""
    merged = read_dotenv()
    merged.update(os.environ if environ is None else environ)
    return merged


def judge_from_env(
    model: str | None = None,
    *,
    max_workers: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> BaseJudge:
    """The judge the reference library's calls get without `judge=`.

    `AGENT_MONITOR_JUDGE_URL` set: an OpenAI-compatible server there (`model=` names the model,
    else the one the server lists). Else `model=` decides: `gemini-*` through google-genai
    (`GEMINI_API_KEY` / `GOOGLE_API_KEY`, or `VERTEX_API_KEY` for Vertex AI), any other through
    openai (`OPENAI_API_KEY`, `OPENAI_BASE_URL`). Else `OPENAI_BASE_URL` alone (the served model
    is read from the server), as the reference library does. Otherwise `MissingJudgeError`.
    """
    env = settings(environ)
    # Only when given: each judge's own default stays the one default.
    concurrency: dict[str, Any] = (
        {} if max_workers is None else {"concurrency": _workers(max_workers)}
    )
    if context := env.get(JUDGE_CONTEXT_ENV):
        concurrency["context_tokens"] = _context_tokens(context)
    url = env.get(JUDGE_URL_ENV)
    if url:
        from .judges.openai import OpenAIJudge

        return OpenAIJudge(
            base_url=url, model=model, api_key=env.get("OPENAI_API_KEY") or None, **concurrency
        )
    if model and model.startswith("gemini"):
        from .judges.gemini import GeminiJudge

        vertex = env.get("VERTEX_API_KEY")
        key = env.get("GEMINI_API_KEY") or env.get("GOOGLE_API_KEY") or vertex
        if not key:
            raise MissingJudgeError(
                f"model={model!r} needs a Gemini key: set GEMINI_API_KEY or GOOGLE_API_KEY "
                "(or VERTEX_API_KEY for "
                f"Vertex AI) in the environment or .env, or set {JUDGE_URL_ENV} to an "
                "OpenAI-compatible server, "
                "or pass judge="
            )
        vertexai = not (env.get("GEMINI_API_KEY") or env.get("GOOGLE_API_KEY"))
        return GeminiJudge(model, api_key=key, vertexai=vertexai, **concurrency)
    base_url = env.get("OPENAI_BASE_URL")
    if model or base_url:
        if not base_url and not env.get("OPENAI_API_KEY"):
            raise MissingJudgeError(
                f"model={model!r} is served through openai: set OPENAI_API_KEY (and "
                "OPENAI_BASE_URL for a server "
                f"other than OpenAI's), or set {JUDGE_URL_ENV} to an OpenAI-compatible "
                "server, or pass judge="
            )
        from .judges.openai import OpenAIJudge

        return OpenAIJudge(
            base_url=base_url, model=model, api_key=env.get("OPENAI_API_KEY") or None, **concurrency
        )
    raise MissingJudgeError(
        "no judge: pass judge= (e.g. agent_monitor.OpenAIJudge(base_url, model)), or set "
        f"{JUDGE_URL_ENV} to an "
        "OpenAI-compatible server (model= names the model), or pass model= (gemini-* with "
        "GEMINI_API_KEY or "
        "GOOGLE_API_KEY; others with OPENAI_API_KEY / OPENAI_BASE_URL), in the environment or .env"
    )


def _context_tokens(value: str) -> int:
    try:
        tokens = int(value)
    except ValueError:
        tokens = 0
    if tokens < 1:
        raise ValueError(
            f"{JUDGE_CONTEXT_ENV}={value!r}; use the judge's context window in "
            "tokens (>= 1), or unset it"
        )
    return tokens


def _workers(max_workers: object) -> int:
    if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
        raise ValueError(
            f"max_workers={max_workers!r}; use a number of concurrent judge calls >= 1"
        )
    return max_workers


def _judge_from_client(client: Any, model: str | None, max_workers: int | None) -> BaseJudge:
    """A judge over a pre-built openai or google-genai client (the reference library's
    `client=`)."""
    # Only when given: each judge's own default stays the one default.
    concurrency: dict[str, Any] = (
        {} if max_workers is None else {"concurrency": _workers(max_workers)}
    )
    module = type(client).__module__
    if module.startswith("openai"):
        from .judges.openai import OpenAIJudge

        if type(client).__name__ == "AsyncOpenAI":
            return OpenAIJudge(model=model, client=client, **concurrency)
        # A synchronous client: the same server and key, through the asynchronous client the judge
        # uses.
        return OpenAIJudge(
            base_url=str(client.base_url), model=model, api_key=client.api_key, **concurrency
        )
    if module.startswith("google"):
        from .judges.gemini import GeminiJudge

        return GeminiJudge(model or "gemini-2.5-flash", client=client, **concurrency)
    raise UnsupportedOption(
        f"client={type(client).__name__}: use an openai or google-genai client, or pass "
        "judge= (any agent_monitor Judge)"
    )


def as_images(images: object) -> tuple[Any, ...]:
    """One image (a path, URL, bytes, PIL image or Frame) or several, as a tuple; None is none."""
    if images is None:
        return ()
    if isinstance(images, str | bytes | bytearray | os.PathLike) or not isinstance(
        images, Iterable
    ):
        return (images,)
    return tuple(images)


def as_trajectory(candidate: Any) -> Any:
    """One candidate trajectory: a string is one whole step, a reference-format dict its `trace`."""
    if isinstance(candidate, str):
        return [candidate]
    if isinstance(candidate, Mapping):
        if "trace" in candidate:
            return [str(candidate["trace"])]
        return [candidate]  # one step given as a mapping
    return candidate


def as_steps(steps: Any) -> Any:
    """Steps of one trajectory: a single string is one step, not a sequence of characters."""
    if isinstance(steps, str | Mapping):
        return as_trajectory(steps)
    return steps


def with_note(criteria: CriteriaSpec, note: str | None) -> CriteriaSpec:
    """The criteria with the reference library's `ground_truth_note` (replacing a criteria file's
    own)."""
    if note is None:
        return criteria
    rubric = load_criteria(criteria)
    return dataclasses.replace(rubric, note=str(note).strip())


def _set(kwargs: dict[str, Any], ours: str, theirs: str, value: Any) -> None:
    if ours in kwargs and kwargs[ours] != value:
        raise TypeError(
            f"both {ours}= and the reference library's {theirs}= were given; use {ours}= alone"
        )
    kwargs[ours] = value


class _Call:
    """One call's arguments in our names, the judge it uses, and whether it built (and so closes)
    it."""

    def __init__(
        self,
        kind: Kind,
        sig: inspect.Signature,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        fn_name: str = "",
    ) -> None:
        self.kind = kind
        kwargs = dict(kwargs)
        for theirs, ours in _RENAMED.items():
            if theirs in kwargs:
                _set(kwargs, ours, theirs, kwargs.pop(theirs))
        for name, why in _REFUSED.items():
            if name in kwargs:
                raise UnsupportedOption(f"{kind}: {name}= is not supported: {why}")
        self.on_error = kwargs.pop("on_error", None) if kind == "select" else None
        if self.on_error not in (None, "raise", "tie"):
            raise ValueError(
                f"on_error={self.on_error!r}; use 'raise' or 'tie' (as the reference library)"
            )
        if self.on_error == "tie":
            raise UnsupportedOption(
                "select: on_error='tie' scores a failed call 0.5/0.5; agent-monitor never "
                "makes a failure a score: a "
                "failed comparison is left out of the win mass and counted in "
                "Selection.failed (on_error='raise' "
                "raises instead)"
            )
        if kwargs.pop("progress", None):
            raise UnsupportedOption(
                f"{kind}: progress=True draws a bar in the reference library; agent-monitor "
                "draws none here: use "
                "on_progress= (trackers, track) or `agent-monitor top` for a live view"
            )
        if "n_evaluations" in kwargs:
            _set(kwargs, "repeats", "n_evaluations", kwargs.pop("n_evaluations"))
        max_workers = kwargs.pop("max_workers", None)
        model = kwargs.pop("model", None)
        client = kwargs.pop("client", None)
        note = kwargs.pop("ground_truth_note", None)
        self.checkpoints = kwargs.pop("checkpoint_steps", None) if kind == "track" else None
        template = kwargs.pop("prompt", None) if kind in ("track", "tracker") else None
        try:
            bound = sig.bind_partial(*args, **kwargs)
        except TypeError as e:
            # As Python words it for the function itself: "track() got an unexpected keyword
            # argument 'x'".
            hint = ""
            if kind in ("tracker", "track") and "unexpected keyword" in str(e):
                hint = (
                    f"; its options are TrackerOptions' fields: {', '.join(sorted(OPTION_NAMES))}"
                )
            raise TypeError(f"{fn_name or kind}() {e}{hint}") from None
        self.arguments = bound.arguments
        self.owned: BaseJudge | None = None
        judge = self.arguments.get("judge")
        if judge is None:
            # The reference library's call: its K default, and a judge from the environment (or its
            # client).
            self.arguments.setdefault("repeats", _REFERENCE_REPEATS[kind])
            if kind == "select":
                self.arguments.setdefault("pairwise", True)
            self.owned = (
                _judge_from_client(client, model, max_workers)
                if client is not None
                else judge_from_env(model, max_workers=max_workers)
            )
            self.arguments["judge"] = self.owned
        else:
            for name, value in (("model", model), ("max_workers", max_workers), ("client", client)):
                if value is not None:
                    raise UnsupportedOption(
                        f"{kind}: {name}= configures the judge built from the environment; "
                        "with judge= given, set it "
                        "on that judge (e.g. OpenAIJudge(base_url, model, concurrency=...))"
                    )
        if note is not None:
            self.arguments["criteria"] = with_note(self.arguments.get("criteria"), note)
        if template is not None:
            # A progress template (checked: placeholders, prefix stability; a pairwise one is
            # refused with why).
            t = load_template(template)
            t.check_for("progress")
            self.arguments["criteria"] = dataclasses.replace(
                load_criteria(self.arguments.get("criteria")), template=t.text
            )
        if kind in ("select",) and "candidates" in self.arguments:
            c = self.arguments["candidates"]
            if isinstance(c, str):
                raise TypeError(
                    "select: candidates is one string; give a list of candidate trajectories"
                )
        if kind == "compare":
            for side in ("a", "b"):
                if side in self.arguments:
                    self.arguments[side] = as_trajectory(self.arguments[side])
        if kind == "track" and "steps" in self.arguments:
            self.arguments["steps"] = as_steps(self.arguments["steps"])
        if self.checkpoints is not None:
            self.arguments["checkpoints"] = list(self.checkpoints)

    def close(self) -> None:
        """Close the judge this call built (a judge the caller gave stays open)."""
        if self.owned is not None:
            self.owned.close()


def reference_form(kind: Kind) -> Callable[[F], F]:
    """Accept the reference library's arguments (and no `judge=`) on a public function or
    constructor."""

    def wrap(fn: F) -> F:
        sig = inspect.signature(fn)
        name = fn.__qualname__.removesuffix(".__init__")
        if kind == "tracker":

            @functools.wraps(fn)
            def init(self: Any, *args: Any, **kwargs: Any) -> None:
                call = _Call(kind, sig, (self, *args), kwargs, name)
                try:
                    fn(**call.arguments)
                except BaseException:
                    call.close()
                    raise
                # The tracker owns a judge built for it: `close()` closes it.
                self._owned_judge = call.owned

            return init  # type: ignore[return-value]

        if kind == "compare":

            @functools.wraps(fn)
            def comparing(*args: Any, **kwargs: Any) -> Any:
                call = _Call(kind, sig, args, kwargs, name)
                if call.owned is None:
                    return fn(**call.arguments)  # ours: a coroutine, awaited by the caller
                # The reference library's synchronous compare: run on the judge's loop, then close
                # the judge.
                try:
                    return run_blocking(
                        call.owned, functools.partial(fn, **call.arguments), "compare"
                    )
                finally:
                    call.close()

            return comparing  # type: ignore[return-value]

        @functools.wraps(fn)
        def calling(*args: Any, **kwargs: Any) -> Any:
            call = _Call(kind, sig, args, kwargs, name)
            try:
                result = fn(**call.arguments)
            finally:
                call.close()
            if kind == "select" and call.on_error == "raise" and result.failed:
                raise JudgeError(
                    result.reason or "scoring_failed", f"{result.failed} comparison(s) failed"
                )
            return result

        return calling  # type: ignore[return-value]

    return wrap


class TrackResult(list[Progress]):
    """`track`'s results, one `Progress` per scored step, with the reference library's
    `ProgressResult` fields.

    `steps` are the scored steps (1-based), `scores` their scores (None where the scoring failed: a
    failure is never a number), `per_rep_scores` the K repeats' curves (repeats x steps; None where
    a step has no score), `final` the last step's score (raises `ScoringFailed` if it has none).
    """

    def __init__(
        self, results: Iterable[Progress] = (), repeats: int = 1, rubric: Rubric | None = None
    ) -> None:
        super().__init__(results)
        self.repeats = repeats
        self.verdict: str | None = (
            rubric.verdict(self[-1].score) if rubric is not None and self else None
        )
        """The rubric's pass / review / fail for the last scored step (None: the rubric has no
        thresholds)."""

    @property
    def steps(self) -> list[int]:
        """The scored steps, 1-based."""
        return [p.step for p in self]

    @property
    def scores(self) -> list[float | None]:
        """Each scored step's score; None where its scoring failed."""
        return [p.score for p in self]

    @property
    def per_rep_scores(self) -> list[list[float | None]]:
        """The K repeats' curves (repeats x steps): each repeat's weighted mean over the
        criteria."""
        return [[_repeat_score(p, r) for p in self] for r in range(self.repeats)]

    @property
    def final(self) -> float:
        """The last scored step's score; raises `ScoringFailed` if that scoring failed."""
        if not self:
            raise ValueError("no step was scored")
        return float(self[-1])


def _repeat_score(p: Progress, r: int) -> float | None:
    if not p.ok or not p.criteria:
        return None
    total = sum(c.weight for c in p.criteria.values())
    if total <= 0:
        return p.score
    # A rule's score, or a criterion judged with fewer repeats, is the same in every repeat.
    return (
        sum(
            c.weight * (c.expectations[r] if r < len(c.expectations) else c.score)
            for c in p.criteria.values()
        )
        / total
    )


def indexed(
    candidates: Sequence[Any] | Mapping[str, Any], winner: str | None
) -> tuple[int | None, Any]:
    """The winner's position among the candidates as given, and the candidate itself."""
    if winner is None:
        return None, None
    if isinstance(candidates, Mapping):
        names = [str(k) for k in candidates]
        return names.index(winner), candidates[next(k for k in candidates if str(k) == winner)]
    return int(winner), candidates[int(winner)]


__all__ = [
    "JUDGE_URL_ENV",
    "MissingJudgeError",
    "TrackResult",
    "UnsupportedOption",
    "as_images",
    "as_steps",
    "as_trajectory",
    "indexed",
    "judge_from_env",
    "read_dotenv",
    "reference_form",
    "settings",
    "with_note",
]

"""The reward endpoints: a source of the monitor that scores an RL trainer's finished rollouts as
runs.

Mounted on the metrics port's HTTP server (`serve --reward-api`), each endpoint speaks its
framework's contract exactly (read from the framework's code; cited at each):

- `POST /get_reward`, OpenRLHF's remote reward model (`--remote_rm_url
  http://host:port/get_reward`): `{"query": [...], "prompts": [...], "labels": [...]}` ->
  `{"rewards": [...], "scores": [...], "extra_logs": {...}}`. Read from
  OpenRLHF/OpenRLHF@3c3be6234e0cb353e76bb8019947db9dfe99fca7: openrlhf/cli/serve_rm.py (the server's
  answer) and openrlhf/utils/agent.py (`SingleTurnAgentExecutor._fetch_rewards_via_http`: aiohttp
  POST with a 180 s total timeout, 5 tries 1 s apart on any error status; `query` is the prompt and
  response decoded with their special tokens; each `extra_logs` value becomes
  `torch.tensor([value])`, so every one is numeric).
- `POST /slime/reward`, slime's remote RM (`--rm-type remote_rm --rm-url
  http://host:port/slime/reward`): `{"prompt", "response", "label"}` -> the reward as a bare JSON
  number (`?form=dict` for a dict, with `--reward-key reward`). Read from
  THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515: slime/rollout/rm_hub/__init__.py
  (`remote_rm`: aiohttp, 120 s total timeout, `raise_for_status`, 10 tries with exponential backoff
  up to 30 s; the JSON answer is the sample's reward) and slime/utils/types.py (`Sample.prompt: str
  | list[dict]`).
- `POST /v1/score`, the native one: a task and steps (the step format of `{prefix}/{run}/step`),
  chat messages, or the id of a live run -> the final progress, each step's `delta` (the dense
  reward), the uncertainty, the verdict and `stop_kind`.

Each rollout becomes a run of its own (`rl-` and 20 hex digits): start, steps (split by the rules of
`_reward_steps`), end, handed to ingest like any source's events, so the run is journaled, bounded,
scored with the configured judge and rubric and published like any other. The answer waits for the
run's score through the source's sink. A judge or plumbing failure is never a reward: it is a 503
(both trainers retry it) saying `stop_kind: "infra"`; the rollouts of a batch that did score are
kept by their digest, so the retry re-scores only the failed one and one failure never costs its
siblings their rewards.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import math
import time
import urllib.parse
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client import Counter as PromCounter

from ....calibration import Calibration, Family
from ....progress import Progress, Signal, StopKind
from ....wire import MAX_TASK_CHARS
from ..._config import RewardApiSettings, RewardShape
from ..._events import MonitorEvent, Refused, RunClosed, Scored, Sink
from ...http import HttpRequest, HttpResponse, HttpServer, Route
from .._protocol import Inbound, RunsView, SourceInput
from ._steps import Rollout, RolloutError, from_messages, from_text

__all__ = ["PATHS", "RewardSource", "pass_probability"]

log = structlog.get_logger("agent_monitor.reward")

PATHS = ("/get_reward", "/slime/reward", "/v1/score")
SHAPES: tuple[RewardShape, ...] = ("final", "dense", "calibrated")
MIN_CALIBRATION = 10
"""Ended runs with outcomes (both successes and failures among them) a family needs for
`calibrated` rewards."""
_JSON = "application/json"


def pass_probability(
    calibration: Calibration, family: Family, score: float
) -> tuple[float | None, str]:
    """P(success | final score) from the family's ended runs: the nearest `k` final scores,
    smoothed; or why not.

    k is the square root of the samples (at least 5); (successes + 0.5) / (k + 1) keeps it off 0 and
    1.
    """
    finals = []
    for s in calibration.samples(family):
        last = next((p.score for p in reversed(s.curve) if p.score is not None), None)
        if last is not None:
            finals.append((last, s.success))
    wins = sum(ok for _, ok in finals)
    if len(finals) < MIN_CALIBRATION or wins == 0 or wins == len(finals):
        return None, (
            f"not calibrated: {len(finals)} ended runs with outcomes ({wins} successes) in family "
            f"{family.name!r}; {MIN_CALIBRATION} with both outcomes needed"
        )
    k = max(5, round(math.sqrt(len(finals))))
    near = sorted(finals, key=lambda f: abs(f[0] - score))[:k]
    return (sum(ok for _, ok in near) + 0.5) / (k + 1), (
        f"calibrated on {len(finals)} ended runs (k={k})"
    )


@dataclass(slots=True)
class _Wait:
    """One rollout being scored: what the sink has seen of its run."""

    scored: dict[int, Progress] = field(default_factory=dict)
    closed: RunClosed | None = None
    refused: Refused | None = None
    family: Family | None = None
    """The run's calibration key, read at its first score (the run may have closed by the
    answer)."""
    ended: bool = False
    """The run's end was sent (or it closed): nothing more is sent for it."""
    changed: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True, slots=True)
class Answer:
    """A rollout's reward answer (or why there is none)."""

    status: int
    """200, or 422 (the rollout was refused as input), 503 (infra: retry)."""
    run_id: str = ""
    final: Progress | None = None
    points: tuple[tuple[int, float | None, float | None], ...] = ()
    """Each scored step as (step, score, uncertainty)."""
    reward: float | None = None
    shape: RewardShape = "final"
    note: str | None = None
    error: str | None = None
    rule: str = ""
    steps: int = 0

    @property
    def ok(self) -> bool:
        """A reward was computed."""
        return self.status == 200

    @property
    def verdict(self) -> Signal | None:
        """The policy's signal after the final score."""
        d = self.final.signal if self.final is not None else None
        return d.signal if d is not None else None

    @property
    def stop_kind(self) -> StopKind | None:
        """ "infra" without a reward; "judged" when the policy aborted the run on its scores; else
        None."""
        if self.status == 503:
            return "infra"
        return "judged" if self.verdict == "abort" else None

    def to_json(self) -> dict[str, Any]:
        """The native answer (`/v1/score`, slime's `?form=dict`)."""
        if not self.ok:
            return {"error": self.error, "stop_kind": self.stop_kind, "run_id": self.run_id or None}
        steps: list[dict[str, Any]] = []
        prev: float | None = None
        for step, score, u in self.points:
            delta = None if score is None or prev is None else score - prev
            steps.append({"step": step, "score": score, "delta": delta, "uncertainty": u})
            prev = score if score is not None else prev
        f = self.final
        assert f is not None
        return {
            "run_id": self.run_id,
            "reward": self.reward,
            "shape": self.shape,
            "score": f.score,
            "delta": steps[-1]["delta"] if steps else None,
            "uncertainty": f.uncertainty,
            "verdict": self.verdict,
            "stop_kind": self.stop_kind,
            "steps": steps,
            "rule": self.rule,
            "note": self.note,
            "progress": f.to_json(),
        }


class _Refusal(Exception):
    """A request refused before any rollout was scored: its status, its message and the counted
    reason."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


class _Metrics:
    """The reward endpoints' Prometheus series (on the monitor's registry)."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.requests = PromCounter(
            "agent_monitor_reward_requests",
            "Reward requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.refused = PromCounter(
            "agent_monitor_reward_refused",
            "Reward requests refused as bad input (4xx), by endpoint and reason",
            ["endpoint", "reason"],
            registry=r,
        )
        self.rollouts = PromCounter(
            "agent_monitor_reward_rollouts",
            "Rollouts scored, by outcome (ok, infra, refused, cached)",
            ["outcome"],
            registry=r,
        )
        self.fallbacks = PromCounter(
            "agent_monitor_reward_calibration_fallbacks",
            "Calibrated rewards answered with the final score instead (the family is not "
            "calibrated yet)",
            registry=r,
        )
        self.latency = Histogram(
            "agent_monitor_reward_latency_seconds",
            "Reward request latency, by endpoint",
            ["endpoint"],
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )


class _Scorer:
    """Scores rollouts as runs: hands each to ingest, waits for its scores through the sink,
    caches answers."""

    def __init__(
        self, settings: RewardApiSettings, metrics: _Metrics, clock: Callable[[], float]
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self.calibration: Calibration | None = None
        self.ingest: SourceInput | None = None
        self.runs: RunsView | None = None
        self.waits: dict[str, _Wait] = {}
        self.cache: OrderedDict[bytes, Answer] = OrderedDict()
        self.counts: Counter[str] = Counter()

    def on_event(self, event: MonitorEvent) -> None:
        """The sink: fold a result, a close or a refusal of one of this source's runs into its
        waiter."""
        run_id = event.run_id if isinstance(event, (Scored, RunClosed, Refused)) else None
        w = self.waits.get(run_id) if run_id is not None else None
        if w is None:
            return
        if isinstance(event, Scored):
            w.scored[event.progress.step] = event.progress
            if w.family is None and self.runs is not None:
                w.family = self.runs.family(event.run_id)
        elif isinstance(event, RunClosed):
            w.closed = event
        elif (
            isinstance(event, Refused)
            and event.invalid
            and event.reason != "step_gap"
            and w.refused is None
        ):
            w.refused = event
        w.changed.set()

    async def score(
        self,
        start: Mapping[str, Any],
        steps: Sequence[Mapping[str, Any]],
        shape: RewardShape,
        rule: str,
    ) -> Answer:
        """A rollout's answer: from the cache when it was scored already, else scored now within
        the timeout."""
        key = hashlib.blake2b(
            json.dumps([start, steps, shape], sort_keys=True, default=str).encode(), digest_size=16
        ).digest()
        if (hit := self.cache.get(key)) is not None:
            self.cache.move_to_end(key)
            self.metrics.rollouts.labels("cached").inc()
            return hit
        if len(self.waits) >= self.settings.max_inflight:
            self.metrics.rollouts.labels("infra").inc()
            return Answer(
                503,
                error=f"{len(self.waits)} rollouts are being scored (--reward-max-inflight); retry",
            )
        run_id = f"rl-{uuid.uuid4().hex[:20]}"
        w = self.waits[run_id] = _Wait()
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                answer = await self._run(run_id, w, start, steps, shape, rule)
        except TimeoutError:
            answer = Answer(
                503,
                run_id,
                error=f"not scored within {self.settings.timeout_s:g} s (--reward-timeout)",
            )
        finally:
            self.waits.pop(run_id, None)
        if answer.status != 200:
            with contextlib.suppress(Exception):  # the run ends: nothing waits for it any more
                await self._end(run_id, w)
        self.metrics.rollouts.labels({200: "ok", 503: "infra"}.get(answer.status, "refused")).inc()
        if answer.ok and self.settings.cache:
            self.cache[key] = answer
            while len(self.cache) > self.settings.cache:
                self.cache.popitem(last=False)
        return answer

    async def _send(self, events: Sequence[Inbound]) -> None:
        assert self.ingest is not None
        errors = await self.ingest.events(events)
        if (err := next((e for e in errors if e is not None), None)) is not None:
            raise err

    async def _end(self, run_id: str, w: _Wait) -> None:
        if not w.ended and w.closed is None and w.refused is None:
            w.ended = True
            await self._send([Inbound(run_id, "end", {})])

    async def _run(
        self,
        run_id: str,
        w: _Wait,
        start: Mapping[str, Any],
        steps: Sequence[Mapping[str, Any]],
        shape: RewardShape,
        rule: str,
    ) -> Answer:
        n = len(steps)
        p: Progress | Answer
        step = [Inbound(run_id, "step", {**s, "index": i + 1}) for i, s in enumerate(steps)]
        try:
            if shape == "dense":
                # Dense rewards need every prefix's score: a step is sent once the one before is
                # scored (sent together, the scheduler scores only the newest prefix).
                await self._send([Inbound(run_id, "start", dict(start)), step[0]])
                for i in range(1, n + 1):
                    p = await self._until(w, i)
                    if isinstance(p, Answer):
                        return p
                    if not p.ok or (p.signal is not None and p.signal.signal == "abort") or i == n:
                        break
                    await self._send([step[i]])
            else:
                # The end goes with the steps (one journal commit): the run closes once its newest
                # prefix is scored.
                w.ended = True
                await self._send(
                    [Inbound(run_id, "start", dict(start)), *step, Inbound(run_id, "end", {})]
                )
                p = await self._until(w, n)
                if isinstance(p, Answer):
                    return p
            await self._end(run_id, w)
            assert isinstance(p, Progress)
        except (OSError, RuntimeError) as e:  # the journal could not take the events
            return Answer(503, run_id, error=f"the run store refused the rollout ({e}); retry")
        if not p.ok:
            return Answer(
                503, run_id, final=p, error=f"the judge failed ({p.reason}: {p.error}); retry"
            )
        return self._answer(run_id, w, p, shape, rule, n)

    async def _until(self, w: _Wait, step: int) -> Progress | Answer:
        """The first result covering `step`, or the answer a refusal or a close without it makes."""
        while True:
            if p := max(
                (q for s, q in w.scored.items() if s >= step), key=lambda q: q.step, default=None
            ):
                return p
            if w.refused is not None:
                # The monitor's capacity is the plumbing's (retry later); anything else is the
                # rollout's own.
                status = 503 if w.refused.reason == "too_many_held" else 422
                return Answer(
                    status,
                    error=f"the rollout was refused ({w.refused.reason}): {w.refused.message}",
                )
            if w.closed is not None:
                c = w.closed
                if (
                    c.latest is not None
                    and c.latest.signal is not None
                    and c.latest.signal.signal == "abort"
                ):
                    return c.latest  # aborted before this step: the abort's result is the rollout's
                return Answer(
                    503,
                    error=f"the run closed ({c.outcome}) before its step {step} was scored; retry",
                )
            w.changed.clear()
            await w.changed.wait()

    def _answer(
        self, run_id: str, w: _Wait, p: Progress, shape: RewardShape, rule: str, n: int
    ) -> Answer:
        points = tuple(
            (s, q.score, q.uncertainty) for s, q in sorted(w.scored.items()) if s <= p.step
        )
        return self.answer(run_id, p, points, shape, w.family, rule=rule, steps=n)

    def answer(
        self,
        run_id: str,
        p: Progress,
        points: tuple[tuple[int, float | None, float | None], ...],
        shape: RewardShape,
        family: Family | None,
        *,
        rule: str,
        steps: int,
    ) -> Answer:
        """The answer for a run's final result `p`, its reward shaped; calibrated falls back to
        final, saying why."""
        note = None
        reward = p.score
        if shape == "dense":
            prev = next(
                (sc for s, sc, _ in reversed(points) if sc is not None and s < p.step), None
            )
            reward = None if p.score is None else p.score - (prev if prev is not None else 0.0)
        elif shape == "calibrated":
            prob, note = (
                (None, "no calibration attached")
                if self.calibration is None or family is None
                else (pass_probability(self.calibration, family, p.score or 0.0))
            )
            if prob is None:
                self.metrics.fallbacks.inc()
                shape, note = "final", f"{note}: the reward is the final score"
            else:
                reward = prob
        return Answer(200, run_id, p, points, reward, shape, note, rule=rule, steps=steps)


@dataclass(frozen=True, slots=True)
class RewardSourceStatistics:
    """The reward API's rollouts being scored, answers cached, and requests answered."""

    inflight: int
    """Rollouts being scored now (their requests wait for the scores)."""
    cached: int
    """Answers kept for requests repeated with the same rollout."""
    counts: Mapping[str, int]
    """Requests answered, by `"{path} {status}"` (only the ones that happened)."""


class RewardSource:
    """The reward endpoints as a source: `Monitor(config, judge=judge, sources=[RewardSource(http,
    settings)])`.

    Its routes are mounted on `http` (the metrics port's server) while the source runs. Give it the
    monitor's calibration (`calibration=`; the monitor does, opening it from `config.reward_api`)
    for `calibrated` rewards.
    """

    name = "reward"

    def __init__(
        self,
        http: HttpServer,
        settings: RewardApiSettings | None = None,
        *,
        registry: CollectorRegistry | None = None,
        calibration: Calibration | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.http = http
        self.settings = s = settings if settings is not None else RewardApiSettings(reward_api=True)
        self.metrics = _Metrics(registry)
        self.scorer = _Scorer(s, self.metrics, clock)
        self.scorer.calibration = calibration
        self.sink: Sink | None = self.scorer.on_event
        self.ready = asyncio.Event()
        """Set once the routes are mounted (the source's task started)."""

    @property
    def calibration(self) -> Calibration | None:
        """The calibration `calibrated` rewards read (the monitor's)."""
        return self.scorer.calibration

    @calibration.setter
    def calibration(self, value: Calibration | None) -> None:
        self.scorer.calibration = value

    async def run(self, ingest: SourceInput, runs: RunsView) -> None:
        """Mount the routes and serve until cancelled; unmount them on the way out."""
        self.scorer.ingest, self.scorer.runs = ingest, runs
        handlers = {
            "/get_reward": self._openrlhf,
            "/slime/reward": self._slime,
            "/v1/score": self._native,
        }
        for path, handler in handlers.items():
            self.http.mount(
                path,
                Route(
                    self._timed(path, handler),
                    max_body_bytes=self.settings.max_body_bytes,
                    on_refused=self._refused_by(path),
                ),
            )
        log.info(
            "reward_api_serving", url=self.http.url, paths=list(handlers), shape=self.settings.shape
        )
        self.ready.set()
        try:
            await asyncio.Event().wait()
        finally:
            self.ready.clear()
            for path in handlers:
                self.http.unmount(path)

    def _refused_by(self, path: str) -> Callable[[str], None]:
        """Count a request the HTTP server refused before the handler saw it (a body too large,
        no length)."""
        return lambda reason: self.metrics.refused.labels(path, reason).inc()

    def statistics(self) -> RewardSourceStatistics:
        """Rollouts being scored, answers cached, requests by endpoint and status."""
        return RewardSourceStatistics(
            inflight=len(self.scorer.waits),
            cached=len(self.scorer.cache),
            counts=dict(self.scorer.counts),
        )

    def _authorized(self, req: HttpRequest) -> bool:
        """Whether the request carries the token (`--reward-token`), as a bearer header or
        `?token=`."""
        want = self.settings.token
        if want is None:
            return True
        auth = req.headers.get("authorization", "")
        given = auth[7:] if auth.lower().startswith("bearer ") else None
        for part in req.query.split("&"):
            if given is None and part.startswith("token="):
                given = urllib.parse.unquote(part[6:])
        return given is not None and hmac.compare_digest(given.encode(), want.encode())

    def _timed(
        self, path: str, handler: Callable[[HttpRequest], Any]
    ) -> Callable[[HttpRequest], Any]:
        async def timed(req: HttpRequest) -> HttpResponse:
            t0 = time.perf_counter()
            try:
                if not self._authorized(req):
                    raise _Refusal(
                        401,
                        "unauthorized",
                        "a reward request needs the token "
                        "(--reward-token): send "
                        "'Authorization: Bearer TOKEN' or add ?token=TOKEN to the URL",
                    )
                answer: HttpResponse = await handler(req)
            except _Refusal as e:
                self.metrics.refused.labels(path, e.reason).inc()
                answer = _error(e.status, e.message, reason=e.reason)
            self.metrics.latency.labels(path).observe(time.perf_counter() - t0)
            self.metrics.requests.labels(path, str(answer.status)).inc()
            self.scorer.counts[f"{path} {answer.status}"] += 1
            return answer

        return timed

    # -- the endpoints --

    async def _openrlhf(self, req: HttpRequest) -> HttpResponse:
        body = _body(req)
        queries = body.get("query")
        if (
            not isinstance(queries, list)
            or not queries
            or not all(isinstance(q, str) for q in queries)
        ):
            raise _Refusal(
                400,
                "bad_body",
                '"query" must be a non-empty list of strings (prompt and response text)',
            )
        if len(queries) > self.settings.max_batch:
            raise _Refusal(
                413,
                "batch_too_large",
                f"{len(queries)} queries, over "
                "--reward-max-batch "
                f"{self.settings.max_batch}: send them in smaller batches",
            )
        prompts, labels = (
            _column(body, "prompts", len(queries)),
            _column(body, "labels", len(queries)),
        )
        shape = _shape(req, self.settings.shape)
        jobs = []
        for i, q in enumerate(queries):
            p = prompts[i]
            try:
                r = from_text(
                    q, prompt=p if isinstance(p, str) else None, max_steps=self.settings.max_steps
                )
            except RolloutError as e:
                raise _Refusal(422, "bad_rollout", f"query {i}: {e}") from None
            jobs.append(self._score(r, labels[i], shape))
        answers = await asyncio.gather(*jobs)
        if (bad := _worst(answers)) is not None:
            return bad
        return _ok(
            {
                "rewards": [a.reward for a in answers],
                "scores": [a.final.score if a.final else None for a in answers],
                # Numbers only: OpenRLHF makes a tensor of each value (samples_generator.py).
                "extra_logs": {
                    "progress": [a.final.score if a.final else 0.0 for a in answers],
                    "uncertainty": [
                        _num(a.final.uncertainty if a.final else None) for a in answers
                    ],
                    "stop_judged": [1 if a.stop_kind == "judged" else 0 for a in answers],
                    "steps": [a.steps for a in answers],
                },
            }
        )

    async def _slime(self, req: HttpRequest) -> HttpResponse:
        body = _body(req)
        prompt, response = body.get("prompt"), body.get("response")
        if not isinstance(response, str):
            raise _Refusal(
                400, "bad_body", '"response" must be a string (the sample\'s generated text)'
            )
        try:
            if isinstance(prompt, list):
                r = from_messages(prompt, response=response, max_steps=self.settings.max_steps)
            elif isinstance(prompt, str) or prompt is None:
                r = from_text(response, prompt=prompt or "", max_steps=self.settings.max_steps)
            else:
                raise RolloutError('"prompt" must be a string or a list of chat messages')
        except RolloutError as e:
            raise _Refusal(422, "bad_rollout", str(e)) from None
        a = await self._score(r, body.get("label"), _shape(req, self.settings.shape))
        if not a.ok:
            return _error(a.status, a.error or "", stop_kind=a.stop_kind)
        if "form=dict" in req.query.split("&"):
            return _ok(a.to_json())
        return _ok(a.reward)

    async def _native(self, req: HttpRequest) -> HttpResponse:
        body = _body(req)
        shape = body.get("shape", self.settings.shape)
        if shape not in SHAPES:
            raise _Refusal(
                400, "bad_shape", f"shape {str(shape)[:40]!r} is not one of {', '.join(SHAPES)}"
            )
        if "run_id" in body:
            return self._live(body["run_id"], shape)
        start: dict[str, Any] = {
            k: body[k]
            for k in ("criteria", "expected", "group", "family", "labels", "policy")
            if k in body
        }
        if "messages" in body:
            try:
                r = from_messages(body["messages"], max_steps=self.settings.max_steps)
            except RolloutError as e:
                raise _Refusal(422, "bad_rollout", str(e)) from None
            steps: list[Mapping[str, Any]] = [{"text": t} for t in r.steps]
            task, rule = body.get("task") or r.task, r.rule
        else:
            task, raw = body.get("task"), body.get("steps")
            if not isinstance(task, str) or not isinstance(raw, list) or not raw:
                raise _Refusal(
                    400,
                    "bad_body",
                    'send {"task": str, "steps": [...]}, {"messages": [...]} or {"run_id": str}',
                )
            if len(raw) > self.settings.max_steps:
                raise _Refusal(
                    413,
                    "too_many_steps",
                    f"{len(raw)} steps, over --reward-max-steps {self.settings.max_steps}",
                )
            steps = [s if isinstance(s, Mapping) else {"text": s} for s in raw]
            rule = "steps"
        a = await self.scorer.score({**start, "task": task}, steps, shape, rule)
        return _ok(a.to_json()) if a.ok else _error(a.status, a.error or "", stop_kind=a.stop_kind)

    def _live(self, run_id: object, shape: RewardShape) -> HttpResponse:
        runs = self.scorer.runs
        assert runs is not None
        if not isinstance(run_id, str) or not runs.is_live(run_id):
            raise _Refusal(
                404,
                "not_live",
                f"no live run {str(run_id)[:100]!r} here: score a "
                "finished trajectory "
                'with {"task", "steps"} instead',
            )
        p = runs.latest(run_id)
        if p is None:
            return _error(
                409, f"run {run_id!r} has no score yet; ask again after its first step is scored"
            )
        if not p.ok:
            return _error(
                503, f"the run's newest scoring failed ({p.reason}: {p.error})", stop_kind="infra"
            )
        points = tuple((s.step, s.score, s.uncertainty) for s in runs.points(run_id) or ())
        a = self.scorer.answer(
            run_id, p, points, shape, runs.family(run_id), rule="live", steps=p.step
        )
        # A grouped run: its group's early call (all_fail / all_pass: no outcome variance, no
        # gradient), if any.
        return _ok({**a.to_json(), "live": True, "uniform": runs.uniform(run_id)})

    async def _score(self, r: Rollout, label: Any, shape: RewardShape) -> Answer:
        start: dict[str, Any] = {"task": r.task, "labels": {"source": "reward"}}
        if label is not None:
            text = (
                label
                if isinstance(label, str)
                else json.dumps(label, ensure_ascii=False, default=str)
            )
            # a label is the judge's known answer, never a refusal
            start["expected"] = text[:MAX_TASK_CHARS]
        return await self.scorer.score(start, [{"text": t} for t in r.steps], shape, r.rule)


def _body(req: HttpRequest) -> dict[str, Any]:
    try:
        body = json.loads(req.body)
    except (ValueError, UnicodeDecodeError) as e:
        raise _Refusal(400, "bad_json", f"the body is not JSON ({e}); send a JSON object") from None
    except RecursionError:
        raise _Refusal(
            400, "bad_json", "the body nests too deeply to read; send a flatter JSON object"
        ) from None
    if not isinstance(body, dict):
        raise _Refusal(
            400, "bad_body", f"the body is a JSON {type(body).__name__}; send a JSON object"
        )
    return body


def _column(body: Mapping[str, Any], name: str, n: int) -> list[Any]:
    value = body.get(name)
    if value is None:
        return [None] * n
    if not isinstance(value, list) or len(value) != n:
        raise _Refusal(400, "bad_body", f'"{name}" must be a list as long as "query" ({n})')
    return value


def _shape(req: HttpRequest, default: RewardShape) -> RewardShape:
    for part in req.query.split("&"):
        if part.startswith("shape="):
            if (s := part[6:]) not in SHAPES:
                raise _Refusal(
                    400, "bad_shape", f"shape {s[:40]!r} is not one of {', '.join(SHAPES)}"
                )
            return s
    return default


def _worst(answers: Sequence[Answer]) -> HttpResponse | None:
    """The batch's error answer when a rollout failed: 422 for a refused one, else 503 (retry)
    naming which."""
    failed = [i for i, a in enumerate(answers) if not a.ok]
    if not failed:
        return None
    a = answers[failed[0]]
    kind = "infra" if any(answers[i].status == 503 for i in failed) else None
    status = 503 if kind else a.status
    return _error(
        status,
        f"rollouts {failed[:20]} were not scored ({a.error}); the others are kept for the retry",
        stop_kind=kind,
        failed=failed,
    )


def _num(x: float | None) -> float:
    return -1.0 if x is None else x


def _ok(data: Any) -> HttpResponse:
    return HttpResponse(
        200, json.dumps(data, separators=(",", ":"), allow_nan=False).encode(), _JSON
    )


def _error(status: int, message: str, **extra: Any) -> HttpResponse:
    headers = {"Retry-After": "1"} if status == 503 else {}
    return HttpResponse(status, json.dumps({"error": message, **extra}).encode(), _JSON, headers)

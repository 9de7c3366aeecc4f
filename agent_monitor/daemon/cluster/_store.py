"""Cluster mode's run store and its readers: each run's records and scores in Redis, written by its
owner only.

`ClusterStore` is the `RunStore` of a replica (fenced writes through `_cluster_lua`);
`ClusterJournal` reads a cluster's shared journal without joining it (`agent-monitor
runs|export|calibration --cluster`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from ...calibration import Sample
from ...wire import RunEnd, RunStart
from .._config import ClusterSettings
from ..sinks import Metrics
from ..stores import (
    PLACEHOLDER_PNG,
    Finished,
    GapFilled,
    OrphansDropped,
    Record,
    Replay,
    event_of,
    event_record,
    stored_totals,
    totals_row,
)
from ._leases import Fenced, Leases
from ._leases import later as _later
from ._lua import piped

if TYPE_CHECKING:
    import redis.asyncio as aioredis

log = structlog.get_logger("agent_monitor.cluster")
T = TypeVar("T")

NOTES_MAXLEN = 100_000
"""Notes kept (approximately): a replica reads them as they come; a missed one is caught by the
heartbeat's check."""


class ClusterUnavailable(ConnectionError):
    """Redis cannot be reached or refused the cluster's commands; the message says which and what
    to check."""


def _text(v: object) -> str:
    """A Redis reply as text (replies are bytes: the connection does not decode, payloads are
    bytes)."""
    return v.decode() if isinstance(v, bytes) else str(v)


def _record_body(record: Record) -> tuple[str, str, dict[str, Any]]:
    """A record as its kind, its JSON form, and the listing fields it sets."""
    at = record.at
    if isinstance(record, Finished):
        return (
            "finished",
            json.dumps({"k": "finished", "at": at, "outcome": record.outcome}),
            {
                "ended_at": at,
                "outcome": record.outcome,
                "updated_at": at,
            },
        )
    if isinstance(record, OrphansDropped):
        return "dropped", json.dumps({"k": "dropped", "at": at}), {}
    if isinstance(record, GapFilled):
        return "gap", json.dumps({"k": "gap", "at": at, "upto": record.upto}), {"updated_at": at}
    kind, event = event_of(record)
    data = json.loads(
        event.model_dump_json(exclude={"images"} if not isinstance(event, RunEnd) else None)
    )
    if not isinstance(event, RunEnd):
        data["images"] = [
            {"data": base64.b64encode(i.decoded()).decode("ascii"), "mime": i.mime}
            for i in event.images
        ]
    meta: dict[str, Any] = {"updated_at": at}
    if isinstance(event, RunStart):
        meta.update(task=event.task, started_at=at, labels=json.dumps(event.labels))
    return kind, json.dumps({"k": kind, "at": at, "e": data}), meta


def _record_of(run_id: str, body: str) -> Record:
    d = json.loads(body)
    kind, at = d["k"], float(d["at"])
    if kind == "finished":
        return Finished(run_id, d["outcome"], at)
    if kind == "dropped":
        return OrphansDropped(run_id, at)
    if kind == "gap":
        return GapFilled(run_id, int(d["upto"]), at)
    data = d["e"]
    for im in data.get("images") or ():
        if not im.get("data"):
            im["data"] = base64.b64encode(PLACEHOLDER_PNG).decode("ascii")
    return event_record(kind, run_id, data, at, None, where="the cluster journal")


class ClusterStore:
    """The run store of cluster mode: each run's accepted records and scores in Redis, written by
    its owner only.

    Implements `RunStore`. Every write names the run's fencing token; Redis refuses it (and the
    batch with it) when another replica took the run over. Scores are written in the background, in
    order.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        prefix: str,
        leases: Leases,
        scripts: Mapping[str, Any],
        metrics: Metrics,
        retention_ms: int,
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.leases = leases
        self.scripts = scripts
        """The cluster's Lua scripts, registered on `redis` (`_cluster_lua`)."""
        self.metrics = metrics
        self.retention_ms = retention_ms
        self._pending: list[tuple[Any, list[Any]] | Callable[[], Awaitable[None]]] = []
        """Writes in order: a script and its arguments, or a coroutine function of its own
        (samples, rankings)."""
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    def key(self, what: str, run_id: str = "") -> str:
        """A cluster key: `am:{name}:{what}` or, per run, `am:{name}:{what}:{run}`."""
        return f"{self.prefix}{what}:{run_id}" if run_id else f"{self.prefix}{what}"

    async def journal(self, record: Record) -> None:
        """Journal one record (fenced)."""
        await self.journal_batch([record])

    async def journal_batch(self, records: Sequence[Record]) -> None:
        """Journal records and their runs' inbox cursors in one script: all or none; Fenced for a
        run not owned."""
        if not records:
            return
        leases = self.leases
        by_run: dict[str, list[Record]] = {}
        for r in records:
            by_run.setdefault(r.run_id, []).append(r)
        args: list[Any] = [self.prefix, leases.replica_id, self.retention_ms, len(by_run)]
        cursors: dict[str, str] = {}
        finished: list[str] = []
        for run_id, rs in by_run.items():
            token = leases.token(run_id)
            cursor = ""
            for r in rs:
                d = getattr(r, "delivery", None)
                if d is not None and d.cursor:
                    cursor = _later(cursor, d.cursor)
            o = leases.owned[run_id]
            cursor = _later(o.cursor, cursor) if cursor else ""
            cursors[run_id] = cursor
            args += [run_id, token, cursor, len(rs)]
            for r in rs:
                kind, body, meta = _record_body(r)
                args += [kind, body, json.dumps(meta)]
                if kind == "finished":
                    finished.append(run_id)
        try:
            ok, who = await self.scripts["journal"](args=args)
        except Exception:
            self.metrics.cluster_errors.labels("journal").inc()
            raise
        if not int(ok):
            self.metrics.cluster_fenced.labels("write").inc()
            raise Fenced(
                f"run {_text(who)!r} was taken over by another replica; its records "
                "were not journaled"
            )
        for run_id, cursor in cursors.items():
            leases.advance(run_id, cursor)
        for run_id in finished:
            self.finished(run_id)

    def finished(self, run_id: str) -> None:
        """The run finished here (its end record journaled): it left the directory, so the lease
        goes too."""
        o = self.leases.close(run_id)
        if o is not None:
            self.release(run_id, o.token)

    def mark_signal(self, run_id: str, step: int) -> None:
        """The broker acknowledged a run's signal: note it, so that a new owner publishes it
        again only if it was not."""
        token = self.leases.last_token(run_id)
        if token:
            self.later(self.scripts["mark"], [self.prefix, run_id, token, step, "signal_sent"])

    def mark_progress(self, run_id: str, step: int) -> None:
        """The broker acknowledged a run's progress message: note its step (a new owner
        republishes only a later one)."""
        token = self.leases.last_token(run_id)
        if token:
            self.later(self.scripts["mark"], [self.prefix, run_id, token, step, "progress_sent"])

    def release(self, run_id: str, token: int) -> None:
        """Free a run's lease once the writes queued before are written (the writer keeps order)."""
        self.later(self.scripts["release"], [self.prefix, run_id, self.leases.replica_id, token])

    def record_progress(self, run_id: str, step: int, data: dict[str, Any]) -> None:
        """Queue a score for the run's journal (fenced; written in order, in the background)."""
        o = self.leases.get(run_id)
        if o is None:
            self.metrics.cluster_fenced.labels("write").inc()
            return
        meta = {
            "last_step": step,
            "last_score": data.get("score") if data.get("ok") else "",
            "signal": data.get("signal") or "",
            "updated_at": time.time(),
        }
        self.later(
            self.scripts["progress"],
            [self.prefix, run_id, o.token, step, json.dumps(data), json.dumps(meta)],
        )

    def later(self, script: Any, args: list[Any]) -> None:
        """Queue a script call for the writer (in order, without waiting)."""
        self._queue((script, args))

    def _queue(self, item: tuple[Any, list[Any]] | Callable[[], Awaitable[None]]) -> None:
        self._pending.append(item)
        self._idle.clear()
        self._ready.set()

    async def writer(self) -> None:
        """Write what was queued, in order, in pipelines (the cluster-writer task)."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._pending:
                # Consecutive script calls share one pipeline; a write of its own runs alone, in its
                # place.
                n = 0
                while n < min(512, len(self._pending)) and isinstance(self._pending[n], tuple):
                    n += 1
                batch, self._pending = self._pending[: max(n, 1)], self._pending[max(n, 1) :]
                try:
                    if n == 0:
                        call = batch[0]
                        assert callable(call)
                        await call()
                        continue
                    calls = [item for item in batch if isinstance(item, tuple)]
                    await piped(self.redis, calls, raise_on_error=False)
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    # Scores are kept in memory by the owner; a lost write costs a rescoring after a
                    # failover.
                    self.metrics.cluster_errors.labels("progress").inc()
                    log.warning(
                        "cluster_progress_not_written",
                        writes=len(batch),
                        error=f"{type(e).__name__}: {e}",
                    )
            self._idle.set()

    async def flush(self) -> None:
        """Wait until the queued writes are written (bounded by the caller)."""
        if self._pending:
            self._ready.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await self._idle.wait()

    async def read_runs(
        self, runs: Sequence[str]
    ) -> dict[str, tuple[Replay, str, int | None, int | None]]:
        """Runs' records, scores, inbox cursors and last signal and progress out, as a new owner
        takes them over."""
        c = self
        async with self.redis.pipeline(transaction=False) as pipe:
            for run_id in runs:
                pipe.lrange(c.key("rec", run_id), 0, -1)
                pipe.hgetall(c.key("prog", run_id))
                pipe.get(c.key("cur", run_id))
                pipe.hmget(c.key("meta", run_id), ["signal_sent", "progress_sent"])
            got = await pipe.execute()
        out: dict[str, tuple[Replay, str, int | None, int | None]] = {}
        for k, run_id in enumerate(runs):
            recs, prog, cur, (sent, shown) = got[4 * k : 4 * k + 4]
            replay = Replay(records=[_record_of(run_id, _text(b)) for b in recs])
            if prog:
                replay.progress[run_id] = [
                    json.loads(prog[i]) for i in sorted(prog, key=lambda i: int(i))
                ]
            out[run_id] = (
                replay,
                _text(cur) if cur else "",
                int(sent) if sent else None,
                int(shown) if shown else None,
            )
        return out

    async def replay(self) -> Replay:
        """Nothing at start-up: runs are taken one by one as the directory places them here."""
        return Replay()

    def record_sample(self, sample: Sample, keep: int, total: int) -> None:
        """Keep a calibration sample for every replica (and tell the others now, through the
        notes)."""
        c = self
        body = json.dumps(sample.to_json())

        async def write() -> None:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.rpush(c.key("samples"), body)
                pipe.ltrim(c.key("samples"), -total, -1)
                pipe.xadd(c.key("note"), {"s": body}, maxlen=NOTES_MAXLEN, approximate=True)
                await pipe.execute()

        self._queue(write)

    async def samples(self) -> list[Sample]:
        """Every calibration sample the cluster kept, oldest first."""
        return await _samples(self.redis, self.prefix)

    async def reset_family(self, name: str) -> int:
        """Delete the samples of every family called `name`; how many."""
        return await _reset_family(self.redis, self.prefix, name)

    def record_ranking(self, group: str, ranking: Mapping[str, Any] | None) -> None:
        """Keep a group's ranking (its owner's); None clears it."""
        c = self

        async def write() -> None:
            if ranking is None:
                await self.redis.hdel(c.key("rankings"), group)
            else:
                await self.redis.hset(c.key("rankings"), group, json.dumps(dict(ranking)))

        self._queue(write)

    async def rankings(self) -> dict[str, dict[str, Any]]:
        """None at start-up: a group's ranking is its owner's, rebuilt from the runs it takes."""
        return {}

    async def aclose(self) -> None:
        """Nothing to close: the cluster owns the connection."""


# -- reading the shared journal (agent-monitor runs / export --cluster, no replica needed) --


class ClusterJournal:
    """A cluster's shared journal, read without joining it: what `runs`, `export` and `calibration
    --cluster` show.

    ```python
    async with ClusterJournal(ClusterSettings(url="redis://127.0.0.1:6379/0")) as journal:
        rows = await journal.list_runs()
    ```
    The same rows and forms as `SqliteStore`'s readers. Entering raises ClusterUnavailable with a
    one-line reason.
    """

    def __init__(self, settings: ClusterSettings) -> None:
        self.settings = settings
        self.redis, self.prefix = cluster_redis(settings)
        self.where = f"cluster {settings.name} on {settings.url}"
        """Where the journal is, for messages."""

    async def __aenter__(self) -> ClusterJournal:
        await self._call(self.redis.ping())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.redis.aclose()

    async def _call(self, aw: Awaitable[T]) -> T:
        from redis.exceptions import RedisError

        try:
            return await aw
        except (OSError, RedisError) as e:
            raise ClusterUnavailable(
                f"cannot read the {self.where}: {type(e).__name__}: {e}; check the URL "
                "(--cluster) and that Redis "
                "runs there"
            ) from None

    async def list_runs(self, limit: int = 100) -> list[dict[str, Any]]:
        """Live and recent runs, most recently updated first (the rows SqliteStore.list_runs
        gives)."""
        return await self._call(list_runs(self.redis, self.prefix, limit))

    async def export(self, run_id: str) -> dict[str, Any] | None:
        """A run as the cluster journaled it (the form SqliteStore.export gives), or None."""
        return await self._call(export_run(self.redis, self.prefix, run_id))

    async def samples(self) -> list[Sample]:
        """Every calibration sample the cluster kept, oldest first."""
        return await self._call(_samples(self.redis, self.prefix))

    async def reset_family(self, name: str) -> int:
        """Delete the calibration samples of every family called `name` (any model or rubric);
        how many."""
        return await self._call(_reset_family(self.redis, self.prefix, name))


async def _samples(redis: aioredis.Redis, prefix: str) -> list[Sample]:
    return [Sample.from_json(json.loads(b)) for b in await redis.lrange(prefix + "samples", 0, -1)]


async def _reset_family(redis: aioredis.Redis, prefix: str, name: str) -> int:
    key = prefix + "samples"
    kept, gone = [], 0
    for b in await redis.lrange(key, 0, -1):
        if json.loads(b).get("family") == name:
            gone += 1
        else:
            kept.append(b)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(key)
        if kept:
            pipe.rpush(key, *kept)
        await pipe.execute()
    return gone


def cluster_redis(settings: ClusterSettings) -> tuple[aioredis.Redis, str]:
    """A Redis client for a cluster's URL and the cluster's key prefix (ImportError names the
    extra)."""
    try:
        import redis.asyncio as aioredis
    except ImportError as e:
        raise ImportError(
            f"cluster mode needs the redis client ({e}); pip install -e '.[cluster]' (in the "
            "agent-monitor checkout)"
        ) from None
    if settings.url is None:
        raise ValueError("no cluster URL; pass --cluster redis://HOST:PORT/DB")
    # A reply slower than the lease is as good as none (the lease is gone by then): time out, say
    # so, try again. At least 2 s: the notes are read with a blocking XREAD of one second.
    timeout = max(2.0, settings.lease_s)
    client = aioredis.Redis.from_url(
        settings.url, socket_timeout=timeout, socket_connect_timeout=timeout
    )
    return client, f"am:{settings.name}:"


async def list_runs(redis: aioredis.Redis, prefix: str, limit: int = 100) -> list[dict[str, Any]]:
    """Live and recent runs of a cluster, most recently updated first (the rows
    SqliteStore.list_runs gives)."""
    live = [_text(r) for r in await redis.hkeys(prefix + "assign")]
    ended = [_text(r) for r in await redis.zrevrange(prefix + "ended", 0, limit - 1)]
    ids = list(dict.fromkeys([*live, *ended]))
    async with redis.pipeline(transaction=False) as pipe:
        for run_id in ids:
            pipe.hgetall(f"{prefix}meta:{run_id}")
            pipe.hvals(f"{prefix}prog:{run_id}")
        got = await pipe.execute()
    rows = []
    for k, run_id in enumerate(ids):
        meta = {_text(a): _text(b) for a, b in got[2 * k].items()}
        if not meta.get("started_at"):
            continue  # steps with no start yet: not a run
        curve = [json.loads(b) for b in got[2 * k + 1]]
        rows.append(
            {
                "run_id": run_id,
                "task": meta.get("task"),
                "started_at": _float(meta.get("started_at")),
                "updated_at": _float(meta.get("updated_at")),
                "ended_at": _float(meta.get("ended_at")),
                "outcome": meta.get("outcome") or None,
                "last_step": int(meta["last_step"]) if meta.get("last_step") else None,
                "last_score": _float(meta.get("last_score")),
                "signal": meta.get("signal") or None,
                "totals": stored_totals([totals_row(p) for p in curve]),
            }
        )
    rows.sort(key=lambda r: r["updated_at"] or 0.0, reverse=True)  # type: ignore[arg-type,return-value]
    return rows[:limit]


async def export_run(redis: aioredis.Redis, prefix: str, run_id: str) -> dict[str, Any] | None:
    """A run as the cluster journaled it: task, steps in index order (placeholders marked),
    curve, totals; or None."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hgetall(f"{prefix}meta:{run_id}")
        pipe.lrange(f"{prefix}rec:{run_id}", 0, -1)
        pipe.hgetall(f"{prefix}prog:{run_id}")
        meta_raw, recs, prog = await pipe.execute()
    meta = {_text(a): _text(b) for a, b in meta_raw.items()}
    if not meta.get("started_at"):
        return None
    steps: dict[int, dict[str, Any]] = {}
    # steps that came before the start: placed by it, unless dropped before
    early: list[dict[str, Any]] = []
    for b in recs:
        d = json.loads(b)
        if d["k"] == "orphan":
            early.append(d["e"])
        elif d["k"] == "dropped":
            early = []
        elif d["k"] == "start":
            for e in early:
                index = int(e.get("index") or max(steps, default=0) + 1)
                steps.setdefault(index, _exported_step(index, e))
            early = []
        elif d["k"] == "gap":
            for i in range(1, int(d["upto"])):
                steps.setdefault(
                    i, {"index": i, "placeholder": True, "text": None, "ts": None, "images": []}
                )
        elif d["k"] == "step":
            index = int(d["e"]["index"])
            steps[index] = _exported_step(index, d["e"])
        elif d["k"] == "amend" and int(d["e"]["index"]) in steps:  # the step's text replaced
            steps[int(d["e"]["index"])]["text"] = d["e"].get("text", "")
    curve = [json.loads(prog[k]) for k in sorted(prog, key=lambda k: int(k))]
    return {
        "run_id": run_id,
        "task": meta.get("task"),
        "started_at": _float(meta.get("started_at")),
        "ended_at": _float(meta.get("ended_at")),
        "outcome": meta.get("outcome") or None,
        "labels": json.loads(meta.get("labels") or "{}"),
        "steps": [steps[i] for i in sorted(steps)],
        "curve": curve,
        # The rubric's pass / review / fail on the final score (a rubric with thresholds, a run that
        # ended scored).
        "verdict": curve[-1].get("verdict") if curve else None,
        "totals": stored_totals([totals_row(p) for p in curve]),
    }


def _exported_step(index: int, e: Mapping[str, Any]) -> dict[str, Any]:
    digests = [
        hashlib.sha256(base64.b64decode(im["data"])).hexdigest() for im in e.get("images") or ()
    ]
    return {"index": index, "text": e.get("text", ""), "ts": e.get("ts"), "images": digests}


def _float(v: str | None) -> float | None:
    try:
        return float(v) if v not in (None, "") else None
    except ValueError:
        return None

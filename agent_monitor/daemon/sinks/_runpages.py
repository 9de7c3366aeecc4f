"""A page per run and the history of ended runs: what the web server answers at /runs, /runs/<id>
and their JSON.

`RunPages` reads the run store (`SqliteStore.export` and `.history`: the journal of each run's
steps, its scores with their decisions, its outcome), so a run can be looked into while it runs,
after it ended and after a restart, until `--retention` drops it. Without a store that keeps runs
(serve --no-store, a cluster replica) a run's page falls back to what the board holds of it.

Everything here is bounded: a run's JSON carries its newest `max_steps` steps with texts cut to
`step_chars`, a history page at most `max_page` runs. Run ids, tasks, step texts and labels come
from the network: the pages put them in the DOM with `textContent` only, never as markup.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import difflib
import json
import math
import re
import urllib.parse
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ...judges.base import FRAMES_NOT_SEEN
from ..stores import HistoryQuery

if TYPE_CHECKING:
    from ._board import Board

STEP_CHARS = 20_000
"""A step's text in a run's JSON is cut to this many characters (its length is given)."""
MAX_STEPS = 2_000
"""A run's JSON carries its newest this many steps (and how many it left out)."""
MAX_PAGE = 200
"""The most runs one page of history lists."""
DEFAULT_PAGE = 50
RUN_ID_CHARS = 1024
"""A longer run id in a path is answered 404 without a look-up (no front door accepts one that
long)."""
DETAIL_CHARS = 2_000
"""A criterion's detail (a rule's output, the judge's words) is cut to this many characters."""
_IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")
"""What a frame is served as (what ingest accepts, by magic number): never anything a browser
would run."""
FRAMES_SHOWN = 4
"""A step's newest frames the run page shows as thumbnails."""
_DIGEST = re.compile(r"[0-9a-f]{64}")
HISTORY_KEYS = ("outcome", "signal", "family", "label", "since", "until", "limit", "cursor")
"""The query keys of /api/runs?...: the history's filters and paging."""


class QueryError(ValueError):
    """A history query the server cannot answer (an unknown key, a bad value): answered 400 with
    this message."""


def _cut(text: str | None, n: int) -> str | None:
    if text is None:
        return None
    return text if len(text) <= n else text[: n - 1] + "…"


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and math.isfinite(x) else None


def encode_cursor(cursor: tuple[float, str]) -> str:
    """The opaque cursor of the next history page (url-safe)."""
    return base64.urlsafe_b64encode(json.dumps(list(cursor)).encode()).decode().rstrip("=")


def _decode_cursor(text: str) -> tuple[float, str]:
    try:
        ended, run_id = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
        return float(ended), str(run_id)
    except (ValueError, TypeError, binascii.Error):
        raise QueryError(
            "cursor: not a cursor this server gave; use the `next` of the previous page"
        ) from None


def _time(key: str, text: str) -> float:
    """A time given as Unix seconds or ISO 8601 (UTC when it names no zone)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        at = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise QueryError(
            f"{key}={text[:40]!r}: give Unix seconds or an ISO 8601 time (2026-01-31T12:00)"
        ) from None
    if at.tzinfo is None:
        at = at.replace(tzinfo=datetime.UTC)
    return at.timestamp()


def parse_history(query: str, *, max_page: int = MAX_PAGE) -> HistoryQuery:
    """The history query a URL's query string asks for; QueryError names what is wrong and what
    to give."""
    try:
        params = urllib.parse.parse_qs(
            query, keep_blank_values=False, strict_parsing=False, max_num_fields=40
        )
    except ValueError:
        raise QueryError("too many query fields (at most 40)") from None
    for key in params:
        if key not in HISTORY_KEYS:
            near = difflib.get_close_matches(key, HISTORY_KEYS, n=1)
            hint = f"; did you mean {near[0]}?" if near else f"; known: {', '.join(HISTORY_KEYS)}"
            raise QueryError(f"unknown query key {key[:40]!r}{hint}")

    def one(key: str) -> str | None:
        values = params.get(key)
        if not values:
            return None
        if len(values) > 1:
            raise QueryError(f"{key} given {len(values)} times: give it once")
        return values[0]

    labels = []
    for item in params.get("label", []):
        k, sep, v = item.partition(":") if "=" not in item else item.partition("=")
        if not sep or not k:
            raise QueryError(f"label={item[:40]!r}: give key=value (e.g. label=team=search)")
        labels.append((k, v))
    limit_text = one("limit")
    try:
        limit = DEFAULT_PAGE if limit_text is None else int(limit_text)
    except ValueError:
        raise QueryError(
            f"limit={(limit_text or '')[:20]!r}: give a whole number from 1 to {max_page}"
        ) from None
    if not 1 <= limit <= max_page:
        raise QueryError(f"limit={limit}: give a whole number from 1 to {max_page}")
    since, until, cursor = one("since"), one("until"), one("cursor")
    return HistoryQuery(
        outcome=one("outcome"),
        signal=one("signal"),
        family=one("family"),
        labels=tuple(labels),
        since=None if since is None else _time("since", since),
        until=None if until is None else _time("until", until),
        limit=limit,
        cursor=None if cursor is None else _decode_cursor(cursor),
    )


def _criteria(progress: Mapping[str, Any]) -> dict[str, Any]:
    """The criterion and rule outputs of one scoring, their details cut."""
    out: dict[str, Any] = {}
    for name, c in (progress.get("criteria") or {}).items():
        if isinstance(c, Mapping):
            out[name] = {
                "score": _finite(c.get("score")),
                "uncertainty": _finite(c.get("uncertainty")),
                "weight": _finite(c.get("weight")),
                "source": c.get("source"),
                "detail": _cut(c.get("detail"), DETAIL_CHARS),
            }
    return out


def run_json(
    data: Mapping[str, Any],
    *,
    ranking: Mapping[str, Any] | None = None,
    max_steps: int = MAX_STEPS,
    step_chars: int = STEP_CHARS,
) -> dict[str, Any]:
    """A run's page as JSON from its export (`SqliteStore.export`): steps, curve, decisions with
    their evidence."""
    steps_all = list(data.get("steps") or [])
    steps = []
    for s in steps_all[-max_steps:]:
        text = s.get("text")
        steps.append(
            {
                "index": s.get("index"),
                "text": _cut(text, step_chars),
                "chars": len(text) if isinstance(text, str) else 0,
                "ts": s.get("ts"),
                "frames": len(s.get("images") or []),
                # Each frame's digest, for its thumbnail at /api/frames/<digest> (the newest few of
                # a step).
                "frame_digests": [
                    d for d in (s.get("images") or [])[-FRAMES_SHOWN:] if _DIGEST.fullmatch(str(d))
                ],
                "placeholder": bool(s.get("placeholder", False)),
            }
        )
    curve, decisions, seen = [], [], set()
    images_dropped = 0
    judge = model = None
    for p in data.get("curve") or []:
        d = p.get("decision") or None
        curve.append(
            {
                "step": p.get("step"),
                "score": _finite(p.get("score")),
                "uncertainty": _finite(p.get("uncertainty")),
                "ok": bool(p.get("ok")),
                "reason": p.get("reason"),
                "error": _cut(p.get("error"), DETAIL_CHARS),
                "signal": p.get("signal"),
                "abort_below": _finite(d.get("abort_below")) if d else None,
            }
        )
        images_dropped = max(images_dropped, int(p.get("images_dropped") or 0))
        judge, model = p.get("judge") or judge, p.get("model") or model
        if d is None:
            continue
        key = (d.get("signal"), d.get("step"), d.get("reason"))
        if key in seen or not (d.get("changed") or d.get("signal") != "continue"):
            continue
        seen.add(key)
        decisions.append(
            {
                "signal": d.get("signal"),
                "step": d.get("step"),
                "rule": d.get("stop_kind") or d.get("signal"),
                "reason": _cut(d.get("reason"), DETAIL_CHARS),
                "score": _finite(d.get("score")),
                "best_step": d.get("best_step"),
                "best_score": _finite(d.get("best_score")),
                "abort_below": _finite(d.get("abort_below")),
                "calibration": d.get("calibration"),
                "pruned": bool(d.get("pruned")),
                "leader": d.get("leader"),
                "criteria": _criteria(p),
            }
        )
    labels = dict(data.get("labels") or {})
    group = data.get("group") or labels.get("group")
    last = curve[-1] if curve else None
    return {
        "run_id": data["run_id"],
        "task": _cut(data.get("task"), step_chars),
        "labels": labels,
        "group": group,
        "family": data.get("family"),
        "policy": data.get("policy"),
        "started_at": data.get("started_at"),
        "ended_at": data.get("ended_at"),
        "live": data.get("ended_at") is None,
        # Only an ended run has an outcome: while it runs nobody knows it, the monitor included.
        "outcome": data.get("outcome") if data.get("ended_at") is not None else None,
        "verdict": data.get("verdict"),
        "score": last["score"] if last else None,
        "uncertainty": last["uncertainty"] if last else None,
        "signal": next((c["signal"] for c in reversed(curve) if c["signal"]), None),
        "abort_below": next(
            (c["abort_below"] for c in reversed(curve) if c["abort_below"] is not None), None
        ),
        "steps": steps,
        "steps_total": len(steps_all),
        "steps_omitted": max(0, len(steps_all) - len(steps)),
        "curve": curve,
        "decisions": decisions,
        "totals": data.get("totals"),
        "judge": judge,
        "model": model,
        "images_dropped": images_dropped,
        "frames_note": FRAMES_NOT_SEEN if images_dropped else None,
        "ranking": dict(ranking) if ranking else None,
        "source": "store",
    }


def board_json(run: Mapping[str, Any]) -> dict[str, Any]:
    """A run's page from what the board holds of it (no store keeps its steps): its curve and
    signal only."""
    curve = [
        {"step": s, "score": sc, "uncertainty": u, "ok": sc is not None}
        for s, sc, u in run.get("curve", [])
    ]
    signal = run.get("signal")
    decisions = []
    if signal not in (None, "continue"):
        decisions.append(
            {
                "signal": signal,
                "step": run.get("signal_step"),
                "rule": signal,
                "reason": run.get("signal_reason"),
            }
        )
    return {
        "run_id": run["run_id"],
        "task": run.get("task"),
        "labels": run.get("labels") or {},
        "group": run.get("group"),
        "family": None,
        "policy": None,
        "started_at": run.get("started"),
        "ended_at": run.get("ended_at"),
        "live": run.get("outcome") is None,
        "outcome": run.get("outcome"),
        "verdict": None,
        "score": run.get("score"),
        "uncertainty": run.get("uncertainty"),
        "signal": run.get("signal"),
        "abort_below": None,
        "steps": [],
        "steps_total": run.get("step", 0),
        "steps_omitted": run.get("step", 0),
        "curve": curve,
        "decisions": decisions,
        "totals": run.get("tokens"),
        "judge": None,
        "model": None,
        "images_dropped": 0,
        "frames_note": None,
        "ranking": None,
        "source": "board",
    }


class RunPages:
    """Answers a run's page (`run`) and the history of ended runs (`history`) from the run store
    and the board."""

    def __init__(
        self,
        store: object | None,
        board: Board | None = None,
        *,
        max_steps: int = MAX_STEPS,
        step_chars: int = STEP_CHARS,
        max_page: int = MAX_PAGE,
    ) -> None:
        self.store = store
        self.board = board
        self.max_steps, self.step_chars, self.max_page = max_steps, step_chars, max_page

    @property
    def keeps_history(self) -> bool:
        """Whether the store lists ended runs (a SQLite run store does; none, memory and a
        cluster do not)."""
        return callable(getattr(self.store, "history", None))

    async def run(self, run_id: str) -> dict[str, Any] | None:
        """A run's page as JSON, from the store (its steps and decisions) or else the board;
        None: not known."""
        if len(run_id) > RUN_ID_CHARS:
            return None
        export = getattr(self.store, "export", None)
        data = await export(run_id) if callable(export) else None
        if data is not None:
            ranking = None
            group = data.get("group") or (data.get("labels") or {}).get("group")
            read = getattr(self.store, "ranking", None)
            if group and callable(read):
                ranking = await read(group)
            return run_json(
                data, ranking=ranking, max_steps=self.max_steps, step_chars=self.step_chars
            )
        shown = self.board.entry(run_id) if self.board is not None else None
        return board_json(shown) if shown is not None else None

    async def frame(self, digest: str) -> tuple[str, bytes] | None:
        """A stored frame (type and bytes) by its SHA-256 digest; None: not a digest, not stored,
        or pruned."""
        read = getattr(self.store, "frame", None)
        if not _DIGEST.fullmatch(digest) or not callable(read):
            return None
        found = await read(digest)
        return found if found is not None and found[0] in _IMAGE_TYPES else None

    async def history(self, query: str) -> dict[str, Any]:
        """One page of ended runs matching a query string (QueryError for a bad one; LookupError
        without a store)."""
        q = parse_history(query, max_page=self.max_page)
        history = getattr(self.store, "history", None)
        if not callable(history):
            raise LookupError(
                "no history here: this monitor keeps no run store (serve --no-store, or a "
                "--cluster replica); "
                "the board at / shows the live runs"
            )
        runs, cursor = await history(q)
        for r in runs:
            r["task"] = _cut(r.get("task"), 300)
        return {
            "runs": runs,
            "next": None if cursor is None else encode_cursor(cursor),
            "limit": q.limit,
        }


__all__ = ["QueryError", "RunPages", "parse_history", "run_json"]

"""The monitor's restore part: rebuild the live runs from the store, and (cluster mode) adopt and
release runs.

Handed the parts it drives, never the monitor: the ingest (its lock and `apply`, the same a live
record goes through), the scoring part (stored scores), the groups part, the calibration and the
store.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog

from ...calibration import Calibration, Family, Sample
from ...policy import Policy
from ..stores import Record, RunStore
from ._groups import Groups
from ._ingest import RunWriter
from ._scoring import Scoring
from ._views import FamilySeries

log = structlog.get_logger("agent_monitor.daemon")


class Restore:
    """Replay the journal on entering; take over and give up single runs while running (cluster
    mode)."""

    def __init__(
        self,
        *,
        store: RunStore,
        intake: RunWriter,
        scoring: Scoring,
        groups: Groups,
        calibration: Calibration,
        policy: Policy,
        on_family: Callable[[Family, float], FamilySeries],
    ) -> None:
        self.store = store
        self.intake = intake
        self.scoring = scoring
        self.groups = groups
        self.calibration = calibration
        self.policy = policy
        self.on_family = on_family
        """Told each family the calibration holds samples of, with its newest sample's time (its
        gauges)."""

    def learned(self, sample: Sample) -> None:
        """A calibration sample this monitor learnt: store it, update its family's gauges."""
        self.store.record_sample(sample, self.calibration.max_samples, self.calibration.max_total)
        now = self.on_family(sample.family, sample.at)
        log.info(
            "calibration_sample",
            run_id=sample.run_id,
            family=sample.family.name,
            success=sample.success,
            successes=now.successes,
            threshold=now.threshold,
        )

    def shared(self, sample: Sample) -> None:
        """A sample another replica learnt (cluster mode): every replica's "auto" thresholds use
        the same evidence."""
        if self.calibration.add(sample):
            self.on_family(sample.family, sample.at)
        if self.scoring.config.outcome_secret:
            self.scoring.replays.restore([sample.run_id])  # its signature is spent on every replica

    async def restore(self) -> tuple[str, ...]:
        """Rebuild the live runs by replaying the journal; take their stored scores; the runs live.

        Nothing is published or judged while replaying; afterwards each run's unscored steps (only
        those) are scheduled, a run that had ended but not finished scoring finishes, and each run's
        current signal is published again (it may have been decided but not yet published before the
        crash). With `rescore`, stored scores are ignored and each run's newest prefix is scored
        afresh.
        """
        # Samples first: the runs replayed below are scored against the calibration they had before.
        samples = await self.store.samples()
        for sample in samples:
            self.calibration.add(sample)
        if self.scoring.config.outcome_secret:
            # The signed outcomes taught before the restart stay spent (their sample key holds run
            # and started_at).
            self.scoring.replays.restore(s.run_id for s in samples)
        for f in self.calibration.families():
            self.on_family(f.family, f.last_at)
        replay = await self.store.replay()
        book = self.intake.book
        book.remember_ended(replay.ended)
        book.remember_deliveries(replay.deliveries)
        async with self.intake.lock:
            for record in replay.records:
                await self.intake.apply(record, replaying=True)
        for run_id in list(self.scoring.runs):
            self.scoring.restore(run_id, replay.progress.get(run_id, ()))
        self.groups.restore(await self.store.rankings(), self.policy)
        return tuple(book.live)

    async def adopt(
        self,
        run_id: str,
        records: Sequence[Record],
        progress: Sequence[Mapping[str, Any]],
        *,
        signal_sent: int | None = None,
        progress_sent: int | None = None,
    ) -> None:
        """Take over one run from its shared journal: replay its records, take its stored scores,
        score what is left.

        As on a restart, nothing is judged again that was scored. The run's signal is published
        again only when the previous owner may not have got it out: `signal_sent` is the step of the
        last signal the broker acknowledged, and a harness sees each abort once. Likewise the latest
        score, with `progress_sent` (the step of the last progress message acknowledged).
        """
        async with self.intake.lock:
            self._forget(run_id)
            for record in records:
                await self.intake.apply(record, replaying=True)
            scoring = self.scoring.runs.get(run_id)
            if scoring is not None:
                changes = [d["step"] for d in progress if (d.get("decision") or {}).get("changed")]
                lost = bool(changes) and changes[-1] != signal_sent
                # The previous owner journals a score before publishing it, and drops what it queued
                # for a run it lost: the latest score goes out again unless the broker acknowledged
                # it.
                last = progress[-1].get("step") if progress else None
                unseen = last is not None and last != progress_sent
                self.scoring.restore(run_id, progress, republish=lost, republish_score=unseen)
                if scoring.group is not None:
                    self.groups.changed(scoring.group, False)

    async def release(self, run_id: str) -> None:
        """Forget one run without ending it (another replica owns it now); nothing is published."""
        async with self.intake.lock:
            self._forget(run_id)

    def _forget(self, run_id: str) -> None:
        self.intake.book.forget(run_id)
        self.scoring.forget(run_id)

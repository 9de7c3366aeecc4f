"""`agent-monitor serve` that SIGKILLs itself next to the journaling of one chosen step (fault
injection).

    python tests/crash_points.py after-journal TEXT serve ARGS...
    python tests/crash_points.py before-journal TEXT serve ARGS...

The process dies on the first input step whose `text` equals TEXT:

- `before-journal`: the step has arrived from the broker but is neither in the run store nor
  acknowledged, so the broker delivers it again after the restart and the store has never seen it;
- `after-journal`: the step is committed to the run store but not yet acknowledged to the broker, so
  the broker delivers it again after the restart although the store already holds it.

The seam is the durable write of a batch of records of the run state (the group commit of the
messages handled together): `SqliteStore.journal_batch(records)` resolves only after COMMIT,
`Monitor.handle_batch` awaits it before applying the records, and the MQTT link acknowledges the
messages only after that returns.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

from agent_monitor import cli
from agent_monitor.daemon import SqliteStore
from agent_monitor.daemon.stores import Orphaned, Record, Stepped

POINTS = ("before-journal", "after-journal")


def die() -> None:
    """SIGKILL this process: no cleanup, no ack, no flush (as an OOM kill or a power cut would)."""
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    if len(sys.argv) < 4 or sys.argv[1] not in POINTS:
        print(f"usage: {sys.argv[0]} {{{'|'.join(POINTS)}}} TEXT serve ARGS...", file=sys.stderr)
        return 2
    point, text, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    journal_batch = SqliteStore.journal_batch

    async def journal_with_crash(self: SqliteStore, records: Sequence[Record]) -> None:
        chosen = any(isinstance(r, (Stepped, Orphaned)) and r.step.text == text for r in records)
        if chosen and point == "before-journal":
            die()
        await journal_batch(self, records)  # returns once the batch is committed
        if chosen and point == "after-journal":
            die()  # committed, and Monitor.handle_batch has not returned: the broker has no ack

    SqliteStore.journal_batch = journal_with_crash  # type: ignore[method-assign]
    return cli.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())

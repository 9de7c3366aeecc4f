"""`agent-monitor serve` that kills itself (SIGKILL) on receiving one chosen step, before journaling
it.

Fault injection for the crash test: `python tests/crash_daemon.py STEP serve ARGS...`. The step has
arrived from the broker but is neither journaled nor acknowledged when the process dies, which is
the narrowest window a crash can hit.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

from agent_monitor import cli
from agent_monitor.daemon import SqliteStore
from agent_monitor.daemon.stores import Record, Stepped


def main() -> int:
    crash_at = int(sys.argv[1])
    journal_batch = SqliteStore.journal_batch

    async def journal_or_die(self: SqliteStore, records: Sequence[Record]) -> None:
        if any(isinstance(r, Stepped) and r.step.index == crash_at for r in records):
            os.kill(os.getpid(), signal.SIGKILL)
        await journal_batch(self, records)

    SqliteStore.journal_batch = journal_or_die  # type: ignore[method-assign]
    return cli.main(sys.argv[2:])


if __name__ == "__main__":
    raise SystemExit(main())

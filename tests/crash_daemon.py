"""`agent-monitor serve` that kills itself (SIGKILL) on receiving one chosen step, before journaling it.

Fault injection for the crash test: `python tests/crash_daemon.py STEP serve ARGS...`. The step has
arrived from the broker but is neither journaled nor acknowledged when the process dies, which is
the narrowest window a crash can hit.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from agent_monitor import cli
from agent_monitor.events import StepIn
from agent_monitor.store import SqliteStore


def main() -> int:
    crash_at = int(sys.argv[1])
    journal = SqliteStore.journal

    async def journal_or_die(self: SqliteStore, run_id: str, event: Any) -> bool:
        if isinstance(event, StepIn) and event.index == crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return await journal(self, run_id, event)

    SqliteStore.journal = journal_or_die  # type: ignore[method-assign]
    return cli.main(sys.argv[2:])


if __name__ == "__main__":
    raise SystemExit(main())

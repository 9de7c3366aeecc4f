"""The `agent-monitor` command line: serve, score, eval, replay, demo, runs, export, schemas.

Settings are read here, at the edge, from flags and their `AGENT_MONITOR_*` environment twins
(generated from the settings classes), and passed inward as objects. May import anything.
"""

from ._main import main

__all__ = ["main"]

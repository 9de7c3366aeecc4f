"""Shared bits of the adapters' command-line entry points."""

from __future__ import annotations

import logging
import sys
from typing import Any


class _Stderr:
    def write(self, text: str) -> Any:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def quiet_logs(level: str = "warning") -> None:
    """Send the package's structured logs to stderr, from `level` up: stdout is the command's
    output.

    (For a Claude Code hook, stdout is read as the hook's answer, or even added to the model's
    context.)
    """
    import structlog

    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.WARNING)
        ),
        logger_factory=structlog.PrintLoggerFactory(_Stderr()),  # type: ignore[arg-type]
    )
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, level.upper(), logging.WARNING))

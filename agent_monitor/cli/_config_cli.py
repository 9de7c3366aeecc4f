"""`agent-monitor config`: serve's effective settings and where each came from (flag, env, file
or default)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from ._flags import _shown, file_key, leaves, origin, secret, value_of

MASK = "***"


def settings(
    args: argparse.Namespace, argv: Sequence[str], options: Sequence[type]
) -> list[dict[str, Any]]:
    """Each of serve's settings: its flag, file key, environment twin, effective value (secrets
    masked), origin.

    `options`: the settings classes serve's flags are made from (the command line's own, handed in
    by it).
    """
    out = []
    for cls in options:
        for leaf in leaves(cls):
            value = value_of(args, leaf)
            masked = secret(leaf.flag) and value not in (None, "", ())
            out.append(
                {
                    "flag": leaf.flag,
                    "key": file_key(leaf.flag),
                    "env": leaf.env,
                    "value": MASK
                    if masked
                    else (list(value) if isinstance(value, tuple) else value),
                    "from": origin(args, leaf, argv),
                }
            )
    return out


def print_config(args: argparse.Namespace, argv: Sequence[str], options: Sequence[type]) -> int:
    """Print the effective settings, a table (or JSON lines with --json); those not at their
    default first."""
    rows = settings(args, argv, options)
    rows.sort(key=lambda r: r["from"] == "default")  # stable: the file's order within each part
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    where = f"settings file {args.config}" if args.config else "no settings file (--config FILE)"
    print(
        f"# agent-monitor serve: {where}; precedence flag > env > file > default", file=sys.stderr
    )
    width = max(len(r["key"]) for r in rows)
    for r in rows:
        value = r["value"]
        shown = (
            value if value == MASK else _shown(tuple(value) if isinstance(value, list) else value)
        )
        print(f"{r['key']:<{width}}  {r['from']:<7}  {shown}")
    return 0


__all__ = ["print_config", "settings"]

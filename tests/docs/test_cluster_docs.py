"""docs/cluster.md says what the code does: its flag table, its Redis keys and its metrics, read
against the code.

The operator's page is where the names are looked up; a renamed flag, key or metric must fail here,
not in someone's deployment.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from agent_monitor.cli._flags import env_name, flag_name
from agent_monitor.daemon import ClusterSettings, Monitor
from agent_monitor.daemon.cluster import _cluster
from agent_monitor.daemon.cluster import _lua as _cluster_lua
from agent_monitor.daemon.cluster import _store as _cluster_store
from agent_monitor.testing import FakeJudge
from tests.paths import REPO

ROOT = REPO
DOC = (ROOT / "docs" / "cluster.md").read_text()


def table_rows(heading: str) -> list[list[str]]:
    """The rows (cells stripped) of the first Markdown table after a `## heading` line."""
    section = DOC[DOC.index(f"\n## {heading}\n") :]
    rows, started = [], False
    for line in section.splitlines()[2:]:
        if line.startswith("|"):
            started = True
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not set("".join(cells)) <= set("-: "):
                rows.append(cells)
        elif started:
            break
    return rows[1:]  # without the header


def test_the_flag_table_names_every_cluster_setting_with_its_env_twin_and_default() -> None:
    rows = {r[0].split()[0].strip("`"): r for r in table_rows("Running N replicas")}
    for f in dataclasses.fields(ClusterSettings):
        flag = flag_name(f)
        assert flag in rows, f"docs/cluster.md has no row for {flag}"
        row = rows[flag]
        assert row[1] == f"`{env_name(f)}`", (flag, row[1])
        default = f.default
        if default is None:
            assert row[2].startswith(("off", "`HOST-PID-RANDOM`")), (flag, row[2])
        else:
            shown = f"{default:g}" if isinstance(default, float) else f"`{default}`"
            assert row[2] == shown, (flag, row[2], default)
    assert set(rows) == {flag_name(f) for f in dataclasses.fields(ClusterSettings)}
    # The takeover time the page quotes is the defaults' lease + heartbeat.
    d = ClusterSettings()
    assert f"({d.lease_s + d.heartbeat_s:g} s by default)" in DOC


def test_every_redis_key_in_the_table_is_one_the_code_uses() -> None:
    source = "".join(Path(m.__file__).read_text() for m in (_cluster, _cluster_lua, _cluster_store))  # type: ignore[arg-type]
    used = set(re.findall(r"P \.\. '([a-z:]+?):?'", source)) | set(
        re.findall(r'key\("([a-z:]+)"', source)
    )
    documented = set()
    for row in table_rows("Redis"):
        for key in re.findall(r"`([a-z:]+)(?::\{[a-z]+\})?`", row[0]):
            documented.add(key)
    assert documented, "no keys found in docs/cluster.md's key table"
    assert documented <= used, f"documented but not in the code: {sorted(documented - used)}"
    assert used <= documented, f"in the code but not in the key table: {sorted(used - documented)}"


async def test_every_metric_in_the_table_is_exported() -> None:
    registry = CollectorRegistry()
    async with Monitor(judge=FakeJudge(), registry=registry):
        exposition = generate_latest(registry).decode()
    documented = {
        m for row in table_rows("Metrics") for m in re.findall(r"`(agent_monitor_\w+)", row[0])
    }
    assert len(documented) >= 6
    for name in documented:
        assert re.search(rf"^{name}(\{{| )", exposition, re.MULTILINE), f"{name} is not exported"

"""docs/phoenix.md: the fan-out Collector config is the checked file, and every Phoenix setting
is on the page."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from urllib.parse import urlsplit

import pytest
import yaml

from agent_monitor.cli._flags import env_name, flag_name
from agent_monitor.daemon import PhoenixSettings
from tests.paths import REPO

ROOT = REPO
PAGE = ROOT / "docs" / "phoenix.md"
CONFIG = ROOT / "docs" / "otel-collector-phoenix.yaml"


def test_the_page_shows_the_checked_config_verbatim() -> None:
    body = "\n".join(
        line for line in CONFIG.read_text().splitlines() if not line.startswith("#")
    ).strip()
    blocks = [b.strip() for b in re.findall(r"```yaml\n(.*?)```", PAGE.read_text(), re.DOTALL)]
    assert body in blocks


def test_the_collector_fans_each_trace_out_to_phoenix_and_to_the_receiver() -> None:
    c = yaml.safe_load(CONFIG.read_text())
    exporters, traces = c["exporters"], c["service"]["pipelines"]["traces"]
    assert traces["receivers"] == ["otlp"] and set(traces.get("processors", [])) <= set(
        c.get("processors", {})
    )
    assert sorted(traces["exporters"]) == ["otlphttp/agent-monitor", "otlphttp/phoenix"]
    ports = {}
    for name in traces["exporters"]:
        # otlphttp appends /v1/traces: Phoenix's OTLP/HTTP path on its web port, and the receiver's
        # one path.
        url = urlsplit(exporters[name]["endpoint"])
        assert (
            url.scheme == "http"
            and url.path in ("", "/")
            and exporters[name]["compression"] in ("gzip", "none")
        )
        ports[name] = url.port
    assert ports == {"otlphttp/phoenix": 6006, "otlphttp/agent-monitor": 4318}
    # The Collector's own HTTP port must not collide with the monitor's 4318 on one host.
    assert not c["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")


def test_every_phoenix_setting_is_on_the_page_with_its_environment_twin_and_default() -> None:
    text = PAGE.read_text()
    for f in dataclasses.fields(PhoenixSettings):
        row = next(
            (line for line in text.splitlines() if line.startswith(f"| `{flag_name(f)}` |")), None
        )
        assert row is not None, f.name
        assert f"`{env_name(f)}`" in row
        default = getattr(PhoenixSettings(), f.name)
        assert (
            "none"
            if default is None
            else f"{default:g}"
            if isinstance(default, float)
            else str(default)
        ) in row


@pytest.mark.skipif(
    shutil.which("otelcol") is None and shutil.which("otelcol-contrib") is None,
    reason="no collector binary",
)
def test_the_collector_validates_the_config() -> None:
    binary = shutil.which("otelcol-contrib") or shutil.which("otelcol")
    assert binary is not None
    subprocess.run([binary, "validate", f"--config={CONFIG}"], check=True, capture_output=True)

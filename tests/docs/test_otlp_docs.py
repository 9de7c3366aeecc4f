"""docs/opentelemetry.md: the Collector route's config is the checked file, wired from OTLP/gRPC
to our receiver."""

from __future__ import annotations

import re
import shutil
import subprocess
from urllib.parse import urlsplit

import pytest
import yaml

from agent_monitor.cli._flags import flag_name
from agent_monitor.daemon import OtlpReceiverSettings
from tests.paths import REPO

ROOT = REPO
PAGE = ROOT / "docs" / "opentelemetry.md"
CONFIG = ROOT / "docs" / "otel-collector.yaml"


def config() -> dict[str, object]:
    data = yaml.safe_load(CONFIG.read_text())
    assert isinstance(data, dict)
    return data


def test_the_page_shows_the_checked_config_verbatim() -> None:
    body = "\n".join(
        line for line in CONFIG.read_text().splitlines() if not line.startswith("#")
    ).strip()
    blocks = [b.strip() for b in re.findall(r"```yaml\n(.*?)```", PAGE.read_text(), re.DOTALL)]
    assert body in blocks


def test_the_collector_takes_grpc_and_forwards_traces_to_the_receivers_http_port() -> None:
    c = config()
    receivers, exporters, service = c["receivers"], c["exporters"], c["service"]
    assert isinstance(receivers, dict) and isinstance(exporters, dict) and isinstance(service, dict)
    grpc = receivers["otlp"]["protocols"]["grpc"]
    assert grpc["endpoint"].endswith(":4317")
    # The collector's own HTTP port must not collide with the monitor's conventional 4318 on one
    # host.
    assert not receivers["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")
    traces = service["pipelines"]["traces"]
    assert traces["receivers"] == ["otlp"]
    [name] = traces["exporters"]
    assert name.split("/")[0] == "otlphttp" and name in exporters
    exporter = exporters[name]
    url = urlsplit(exporter["endpoint"])
    # otlphttp appends /v1/traces to `endpoint`: the receiver's one path, on the port the page
    # serves it on.
    assert url.scheme == "http" and url.path in ("", "/") and url.port == 4318
    assert exporter["compression"] in ("gzip", "none")
    assert set(traces.get("processors", [])) <= set(c.get("processors", {}))


def test_every_receiver_setting_is_on_the_page() -> None:
    import dataclasses

    text = PAGE.read_text()
    for f in dataclasses.fields(OtlpReceiverSettings):
        if f.name != "address":
            assert f"`{flag_name(f)}`" in text, f.name


@pytest.mark.skipif(
    shutil.which("otelcol") is None and shutil.which("otelcol-contrib") is None,
    reason="no collector binary",
)
def test_the_collector_validates_the_config() -> None:
    binary = shutil.which("otelcol-contrib") or shutil.which("otelcol")
    assert binary is not None
    subprocess.run([binary, "validate", f"--config={CONFIG}"], check=True, capture_output=True)

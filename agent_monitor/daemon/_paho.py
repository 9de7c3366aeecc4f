"""paho-mqtt's MQTT v5 `Properties` with its constant tables built once instead of once per packet.

paho builds a `Properties` object for every v5 PUBLISH it decodes and every PUBACK it reports, and
each one rebuilds two 28-entry tables (property names and types) in `__init__`. Sampled with py-spy
in `bench/ingest.py`, that was 11% of the monitor's CPU, the largest single cost of ingesting a
burst. The tables are never written after `__init__` (paho only reads them), so one copy serves
every instance. `share_property_tables()` makes paho's packet decoder and client create instances
of a subclass that takes the shared tables: same class behaviour, same encoding, a fraction of
the cost. It is idempotent and touches nothing but those two module names in paho.
"""

from __future__ import annotations

from typing import Any

import paho.mqtt._packet as paho_packet
import paho.mqtt.client as paho_client
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

_TABLES = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]


class SharedTableProperties(Properties):
    """A paho `Properties` whose name and type tables are the shared read-only ones, not built anew."""

    def __init__(self, packetType: int) -> None:
        object.__setattr__(self, "packetType", packetType)
        object.__setattr__(self, "types", _TABLES.types)
        object.__setattr__(self, "names", _TABLES.names)
        object.__setattr__(self, "properties", _TABLES.properties)


def share_property_tables() -> None:
    """Have paho's decoder and client build `SharedTableProperties` (idempotent)."""
    module: Any
    for module in (paho_packet, paho_client):
        if getattr(module, "Properties", None) is Properties:
            module.Properties = SharedTableProperties

"""Count the monitor's own cross-module calls on one step's path, from the MQTT socket to its
published progress.

A real Mosquitto, a real daemon on it (instant scripted judge), one run: step 1 warms every path up,
then step 2 is published by a separate paho client and followed with `sys.setprofile` on the
daemon's event-loop thread until its progress message arrives back. A call counts when caller and
callee are both in `agent_monitor` and in different modules (the scripted judge's own module
excepted: it stands in for a model). Measured the same way on the first shape (commit 9fa90ce, with
the suite's scripted judge in place of FakeJudge): 15 modules, 34 cross-module calls, 33 distinct;
on issue 26's shape 13 modules, 25 calls; on issue 43's packages 17 modules, 34 calls (why:
docs/architecture.md). Prints the modules touched, the distinct cross-module call edges,
and the total cross-module calls; last line `key=value`.

    python bench/callpath.py [--edges] [--store]

Without `--store` the monitor keeps no journal (the path measured on every shape); with it, a SQLite
run store journals each record and keeps each score: four calls more (the journal's commit and
its record's journal form, the store sink and its write of the score).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import sys
import tempfile
import threading
import types
from collections import Counter
from typing import Any

from _common import kv_line, mosquitto

_RESUMABLE = inspect.CO_COROUTINE | inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR


def _module(frame: types.FrameType) -> str:
    return str(frame.f_globals.get("__name__", ""))


class CallTrace:
    """Cross-module call edges inside agent_monitor, recorded on the thread that starts it."""

    def __init__(self) -> None:
        self.edges: Counter[tuple[str, str]] = Counter()
        self.modules: set[str] = set()
        self._entered: dict[int, types.FrameType] = {}

    def _profile(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        if frame.f_code.co_flags & _RESUMABLE:
            # A resumed coroutine or generator fires "call" again (its f_back is whoever resumed
            # it): only the first entry of each frame is a call. Frames are held until the end, so
            # their ids are not reused.
            if id(frame) in self._entered:
                return
            self._entered[id(frame)] = frame
        callee = _module(frame)
        # The scripted judge stands in for a model: its own calls are not the monitor's path.
        if not callee.startswith("agent_monitor") or callee == "agent_monitor.testing":
            return
        self.modules.add(callee)
        back = frame.f_back
        if back is None:
            return
        caller = _module(back)
        # A resumed coroutine's f_back is the event loop: not a call made by the monitor's code.
        if caller.startswith("agent_monitor") and caller not in (callee, "agent_monitor.testing"):
            self.edges[(f"{caller}.{back.f_code.co_name}", f"{callee}.{frame.f_code.co_name}")] += 1

    def start(self) -> None:
        sys.setprofile(self._profile)

    def stop(self) -> None:
        sys.setprofile(None)


async def measure(url: str, port: int, store_path: str | None = None) -> CallTrace:
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    from agent_monitor.daemon import Monitor, MonitorConfig
    from agent_monitor.testing import FakeJudge
    from agent_monitor.wire import BrokerSettings

    try:  # the second shape: Monitor(config, judge=...)
        from agent_monitor.daemon import Monitor, MonitorConfig
        from agent_monitor.wire import BrokerSettings

        config = MonitorConfig(
            broker=BrokerSettings.from_url(url), client_id="callpath", sweep_interval_s=3600
        )
        store = None
        if store_path is not None:
            from agent_monitor.daemon import SqliteStore

            store = SqliteStore(store_path)
        monitor = Monitor(config, judge=FakeJudge(), store=store)
    except ImportError:  # the first shape (before the re-layout), for the baseline
        from agent_monitor.daemon import Monitor  # type: ignore[no-redef]
        from agent_monitor.wire import BrokerSettings  # type: ignore[no-redef]

        monitor = Monitor(  # type: ignore[call-arg]
            judge=FakeJudge(),
            broker=BrokerSettings.from_url(url),
            client_id="callpath",
            sweep_interval_s=3600,
        )
    trace = CallTrace()
    got: dict[int, asyncio.Event] = {1: asyncio.Event(), 2: asyncio.Event()}
    loop = asyncio.get_running_loop()

    def on_message(_c: Any, _u: Any, msg: Any) -> None:
        step = json.loads(msg.payload)["step"]
        if step == 2:
            # Stopped from the daemon's own thread, as soon as the loop runs again.
            loop.call_soon_threadsafe(trace.stop)
        if step in got:
            loop.call_soon_threadsafe(got[step].set)

    harness = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="callpath-harness")
    harness.on_message = on_message
    harness.connect("127.0.0.1", port)
    harness.loop_start()
    harness.subscribe("agents/cp/progress", qos=1)
    try:
        async with monitor:
            harness.publish(
                "agents/cp/start", json.dumps({"task": "count"}), qos=1
            ).wait_for_publish()
            harness.publish(
                "agents/cp/step", json.dumps({"index": 1, "text": "one"}), qos=1
            ).wait_for_publish()
            await asyncio.wait_for(got[1].wait(), 30)
            await asyncio.sleep(0.3)
            trace.start()
            threading.Thread(
                target=lambda: harness.publish(
                    "agents/cp/step", json.dumps({"index": 2, "text": "two"}), qos=1
                )
            ).start()
            await asyncio.wait_for(got[2].wait(), 30)
            trace.stop()
    finally:
        harness.loop_stop()
        harness.disconnect()
    return trace


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--edges", action="store_true", help="print every edge with its count")
    ap.add_argument(
        "--store",
        action="store_true",
        help="journal into a SQLite run store (the default measures a monitor without one)",
    )
    args = ap.parse_args()
    with mosquitto() as broker, tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "runs.db") if args.store else None
        trace = asyncio.run(measure(broker.url, broker.port, store_path))
    modules = sorted(trace.modules)
    print(
        f"modules on the path ({len(modules)}): "
        f"{', '.join(m.removeprefix('agent_monitor.') for m in modules)}"
    )
    if args.edges:
        for (a, b), n in sorted(trace.edges.items()):
            print(f"  {n:>3}  {a} -> {b}")
    print(
        kv_line(
            modules=len(modules),
            distinct_cross_module_calls=len(trace.edges),
            cross_module_calls=sum(trace.edges.values()),
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

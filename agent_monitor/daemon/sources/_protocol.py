"""The front doors' one protocol: a source hands a run's start, step and end events to ingest.

MQTT, the OTLP traces receiver, the LLM API proxy, the reward endpoints and the cluster inbox are
sources. Each turns what it receives into the same input events, in their wire form (the topic
`{prefix}/{run_id}/{kind}` and the JSON payload a harness would publish), and hands them to
`SourceInput`: the wire form is the one vocabulary of input, so every bound, refusal, duplicate
rule, journal record and cluster inbox applies to a run whatever door it came in by, and nothing
downstream knows which. A source runs as one named task in the monitor's TaskGroup (`source-{name}`)
until cancelled; it reads back what it needs through `RunsView` (a run's signal, its latest result)
and, when it wants every result as it happens, gives the monitor a `sink`.

```python
@dataclass(frozen=True, slots=True)
class MySourceStatistics:
    batches: int

class MySource:
    name = "mine"
    sink = None                                   # or a callable taking each MonitorEvent

    async def run(self, ingest: SourceInput, runs: RunsView) -> None:
        errors = await ingest.events([Inbound("run-1", "start", {"task": "Do it"})])

    def statistics(self) -> MySourceStatistics:
        return MySourceStatistics(batches=0)

async with Monitor(config, judge=judge, sources=[MySource()]) as monitor: ...
```
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from ...calibration import Family, Point
from ...groups import UniformJSON
from ...progress import Progress, Signal
from ...wire import Topics
from .._events import Sink
from ..stores import Delivery

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "Host",
    "Inbound",
    "Ingest",
    "Receive",
    "RunsView",
    "Source",
    "SourceInput",
    "statistics_json",
]

Kind = Literal["start", "step", "end"]

Receive = Callable[
    [Sequence[tuple[str, bytes, Delivery | None]]], Awaitable[list[BaseException | None]]
]
"""What ingest does with wire-form messages: per message, None (handled: safe to acknowledge) or
why not."""


@dataclass(frozen=True, slots=True)
class Inbound:
    """One input event from a source: the run, the kind, and the payload a harness would publish
    for it."""

    run_id: str
    """The run's id, already a valid MQTT run id (see `agent_monitor.wire.check_run_id`)."""
    kind: Kind
    data: Mapping[str, Any] = field(default_factory=dict)
    """The payload: the fields of `RunStart`, `StepIn` or `RunEnd` (validated by ingest, as
    MQTT's are)."""
    key: str | None = None
    """What makes this event the same event when the source sends it again (a span id, a request
    id): the delivery's digest, so a repeat is recognised as a duplicate. None: the payload's own
    digest."""


class SourceInput:
    """The monitor's input, as a source sees it: hand it events, learn per event whether they
    were taken."""

    def __init__(self, receive: Receive, topics: Topics) -> None:
        self._receive = receive
        self.topics = topics

    async def messages(
        self, messages: Sequence[tuple[str, bytes, Delivery | None]]
    ) -> list[BaseException | None]:
        """Hand over wire-form messages (topic, payload, delivery), as the MQTT source does."""
        return await self._receive(messages)

    async def events(self, events: Sequence[Inbound]) -> list[BaseException | None]:
        """Hand over events in their wire form; per event None (accepted, refused or a duplicate) or
        a store error.

        A refusal is reported the way MQTT input's are (the run's `error` topic, the invalid
        counter); an error returned here means the event was not journaled and must be sent again.
        """
        return await self._receive([self.wire(e) for e in events])

    def wire(self, event: Inbound) -> tuple[str, bytes, Delivery]:
        """The event as an MQTT message: its topic, its JSON payload and a delivery whose digest
        is its key."""
        topic = self.topics.of(event.run_id, event.kind)
        payload = json.dumps(dict(event.data), separators=(",", ":"), ensure_ascii=False).encode()
        if event.key is None:
            return topic, payload, Delivery.of(0, topic, payload)
        return topic, payload, Delivery.of(0, topic, event.key.encode())


Ingest = SourceInput
"""The old name of `SourceInput` (kept: `agent_monitor.daemon` exports it, and sources written
for it work)."""


@runtime_checkable
class RunsView(Protocol):
    """What a source may read back about the runs this monitor scores (live runs only)."""

    def is_live(self, run_id: str) -> bool:
        """Whether the run is live here (started, not yet ended and finished)."""
        ...

    def signal(self, run_id: str) -> Signal | None:
        """The run's current signal (`continue`, `abort`, `resample`), or None when it is not
        live here."""
        ...

    def latest(self, run_id: str) -> Progress | None:
        """The run's newest result (a score or a failure), or None before its first or when it is
        not live."""
        ...

    def step_meta(self, run_id: str) -> tuple[Mapping[str, Any], ...] | None:
        """The `meta` of each step of a live run, in index order (what a source put there), or
        None when not live."""
        ...

    def step_texts(self, run_id: str) -> tuple[str, ...] | None:
        """The text of each step of a live run, in index order, or None when it is not live."""
        ...

    def points(self, run_id: str) -> tuple[Point, ...] | None:
        """Every result of a live run as (step, score, uncertainty) in step order (None where
        none), or None."""
        ...

    def family(self, run_id: str) -> Family | None:
        """A live run's calibration key (its family, the judge's model, the rubric's hash), or
        None."""
        ...

    def uniform(self, run_id: str) -> UniformJSON | None:
        """The early all_fail / all_pass call of a live run's group (docs/groups.md), or None."""
        ...


@runtime_checkable
class Source(Protocol):
    """A front door of the monitor: runs as one task until cancelled, handing the events it
    receives to ingest."""

    name: str
    """Short and unique among the monitor's sources: its task is `source-{name}`."""
    sink: Sink | None
    """Called with every `MonitorEvent` (after the monitor's own sinks) when not None."""

    async def run(self, ingest: SourceInput, runs: RunsView) -> None:
        """Receive until cancelled; a failure to start raises (the monitor's entering fails with
        it)."""
        ...

    def statistics(self) -> DataclassInstance:
        """Counters and gauges of this source, a frozen dataclass record, read at scrape time and by
        `Monitor.status()`.

        A record's counters whose names are open (an upstream's status, a reason) go in a field
        named `counts` (a mapping): its JSON form (`statistics_json`) lists them beside the other
        fields.
        """
        ...


def statistics_json(record: DataclassInstance) -> dict[str, Any]:
    """A source's statistics as JSON (`Monitor.status()`, /healthz): its fields, with its
    `counts` among them."""
    out = dataclasses.asdict(record)
    counts = out.pop("counts", None)
    return {**counts, **out} if isinstance(counts, dict) else out


@runtime_checkable
class Host(Protocol):
    """What a cluster replica needs of the monitor it feeds: hand it events, give it runs, take
    them back."""

    async def handle_batch(
        self, messages: Sequence[tuple[str, bytes, Delivery | None]]
    ) -> list[BaseException | None]:
        """Decide, journal and apply wire-form messages; per message None (handled) or why not."""
        ...

    async def adopt(
        self,
        run_id: str,
        records: Sequence[Any],
        progress: Sequence[Mapping[str, Any]],
        *,
        signal_sent: int | None = None,
        progress_sent: int | None = None,
    ) -> None:
        """Take one run over from its journal (records and stored scores)."""
        ...

    async def release(self, run_id: str) -> None:
        """Forget one run without ending it."""
        ...

    def is_live(self, run_id: str) -> bool:
        """Whether the run is live here or holds steps waiting for their start."""
        ...

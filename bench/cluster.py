"""Cluster mode: scored steps per second with 1, 2 and 3 `agent-monitor serve --cluster` replicas,
same workload.

Everything is real and private: a Mosquitto with its stock limits, a Redis (`tests/redis_server.py`,
the one definition the cluster tests use too), an OpenAI-compatible judge (bench/_common.py's
scripted judge: a threaded HTTP server in its own process; every call answers after `--latency-s`,
100 ms, with unlimited parallel slots), and the replicas as `python -m agent_monitor serve --cluster
redis://... --max-concurrency 4` processes, so one replica can have at most 4 judge calls in flight:
40 scorings/s at 100 ms.

The workload, the same for every replica count: `--runs` (300) runs start, then a publisher (its own
process, paho, QoS 1) sends steps round-robin over the runs at `--rate` (200) steps/s, more than
three replicas can score, so the judge slots stay busy and each scoring covers the steps that
arrived since the run's last one (newest prefix wins). After `--warmup-s` (10 s) the bench counts,
for `--window-s` (30 s), the progress messages a subscriber on `agents/+/progress` receives (scored
steps/s) and the steps they cover (their `coalesced`), and the CPU each process used
(/proc/<pid>/stat: replicas, judge, Mosquitto, Redis, publisher). A progress message published twice
for the same step of a run would mean two owners: it is counted (`duplicates`). What became of the
judge calls is read from the replicas' metrics over the same window: scorings made, scorings
superseded in flight (newer steps came while the judge read them), scorings held while the run's
last score waited to be published, steps folded into a later scoring, progress messages dropped for
room; "unread" is the share of judge calls without a progress message at the subscriber. Each
replica count gets a fresh broker and Redis. `--plain` adds a row for one `serve` without
`--cluster` (SQLite journal): what cluster mode costs a single daemon. `--equal-slots` (on) adds the
baseline a user would try before adding replicas: one plain `serve` and one cluster replica with all
the judge slots of the largest cluster (`--max-concurrency` x replicas); against a judge with free
parallel slots and a fixed latency, more replicas only win over that baseline when one process runs
out of CPU. For that, the CPU-bound configuration: an instant judge with many slots, e.g.
`--latency-s 0 --max-concurrency 16 --rate 3000 --runs 300`.

    .venv/bin/python bench/cluster.py [--replicas 1,2,3] [--runs 300] [--rate 200] [--latency-s 0.1]
    [--plain]

Last line: `replicas1=.. replicas2=.. replicas3=.. speedup2=.. speedup3=.. ...` (scored steps/s).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from _common import (
    REPO,
    Broker,
    ScriptedJudge,
    cleanup_on_sigterm,
    cpu_seconds,
    free_port,
    kv_line,
    load1,
    mosquitto,
    scripted_judge,
)

# The private Redis of the cluster tests: one definition for tests and benchmarks.
sys.path.insert(0, str(REPO))
from tests.redis_server import RedisServer

PREFIX = "agents"
TASK = (
    "Make the failing test pass in the repository: find the bug in the parser, fix it, "
    "and run the test suite."
)


def run_id(i: int) -> str:
    return f"cl-{i:04d}"


def step_text(run: int, index: int) -> str:
    return (
        f"$ python -m pytest -q tests/test_parser.py  # attempt {index} on run {run}\n"
        f"F.. [100%] FAILED tests/test_parser.py::test_nested - expected {index % 7 + 2} "
        f"tokens, got {index % 5 + 1}"
    )


# -- the harness: a publisher process
# ----------------------------------------------------------------------------


def publisher(port: int, conn: Connection, runs: int, rate: float) -> None:
    """On "go": every run's start, then steps round-robin at `rate` per second until "stop";
    report the counts."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

    c = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id="cluster-publisher",
        protocol=MQTTProtocolVersion.MQTTv311,
    )
    c.max_inflight_messages_set(1000)
    c.max_queued_messages_set(0)
    c.connect("127.0.0.1", port, keepalive=60)
    c.loop_start()
    try:
        conn.recv()
        start = json.dumps({"task": TASK}).encode()
        for r in range(runs):
            c.publish(f"{PREFIX}/{run_id(r)}/start", start, qos=1)
        conn.send(("started", time.time()))
        index = [0] * runs
        sent, t0 = 0, time.monotonic()
        while not conn.poll():
            # Paced in slices of 10 ms: the steps due by now go out, then a short sleep.
            due = int((time.monotonic() - t0) * rate)
            while sent < due:
                r = sent % runs
                index[r] += 1
                payload = json.dumps({"index": index[r], "text": step_text(r, index[r])}).encode()
                c.publish(f"{PREFIX}/{run_id(r)}/step", payload, qos=1)
                sent += 1
            time.sleep(0.01)
        conn.recv()
        conn.send(("sent", sent, time.monotonic() - t0))
    finally:
        c.disconnect()
        c.loop_stop()


# -- the progress subscriber
# -------------------------------------------------------------------------------------


class Progress:
    """Every progress message the harness side receives: (arrival, run, step, steps covered)."""

    def __init__(self, port: int) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

        self.seen: list[tuple[float, str, int, int, bool]] = []
        self._lock = threading.Lock()
        subscribed = threading.Event()
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id="cluster-progress",
            protocol=MQTTProtocolVersion.MQTTv311,
        )
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *a: subscribed.set()
        self.client.connect("127.0.0.1", port, keepalive=60)
        self.client.loop_start()
        self.client.subscribe(f"{PREFIX}/+/progress", qos=1)
        if not subscribed.wait(10):
            raise TimeoutError("no SUBACK for the progress subscription")

    def _on_message(self, _c: Any, _u: Any, msg: Any) -> None:
        t = time.time()
        d = json.loads(msg.payload)
        with self._lock:
            self.seen.append(
                (
                    t,
                    str(d["run_id"]),
                    int(d["step"]),
                    int(d.get("coalesced") or 1),
                    bool(d.get("ok")),
                )
            )

    def between(self, t0: float, t1: float) -> list[tuple[float, str, int, int, bool]]:
        with self._lock:
            return [m for m in self.seen if t0 <= m[0] < t1]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


# -- the replicas
# ------------------------------------------------------------------------------------------------


@dataclass
class Replica:
    name: str
    process: subprocess.Popen[bytes]
    metrics_port: int
    log: Path

    def metrics(self) -> dict[str, float]:
        """This replica's /metrics, summed per series name (labels dropped)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5
        ) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[s.name] = out.get(s.name, 0.0) + float(s.value)
        return out


def start_replica(
    name: str,
    broker: Broker,
    judge: ScriptedJudge,
    workdir: Path,
    args: argparse.Namespace,
    cluster: str | None,
    slots: int | None = None,
) -> Replica:
    port = free_port()
    log = workdir / f"{name}.log"
    cmd = [
        sys.executable,
        "-m",
        "agent_monitor",
        "serve",
        "--broker",
        broker.url,
        "--judge",
        "openai",
    ]
    cmd += [
        "--judge-url",
        judge.url,
        "--max-concurrency",
        str(slots or args.max_concurrency),
        "--metrics-port",
        str(port),
    ]
    cmd += ["--client-id", "bench", "--no-board", "--log-level", "warning"]
    if cluster is not None:
        cmd += ["--cluster", cluster, "--replica-id", name]
    env = {**os.environ, "AGENT_MONITOR_STATE_DIR": str(workdir / f"{name}-state")}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
    return Replica(name, proc, port, log)


def wait_serving(replicas: list[Replica], clustered: bool, timeout_s: float = 60.0) -> None:
    """Until every replica printed its `serving` line and (in a cluster) sees all the others
    live."""
    deadline = time.monotonic() + timeout_s
    pending = list(replicas)
    while pending:
        r = pending[0]
        if r.process.poll() is not None:
            raise RuntimeError(
                f"replica {r.name} exited with {r.process.returncode}:\n{r.log.read_text()[-3000:]}"
            )
        if "agent-monitor: serving" in r.log.read_text(errors="replace"):
            pending.pop(0)
        elif time.monotonic() > deadline:
            raise TimeoutError(
                f"replica {r.name} not serving in {timeout_s:g}s:\n{r.log.read_text()[-3000:]}"
            )
        else:
            time.sleep(0.1)
    while clustered:
        try:
            seen = [r.metrics().get("agent_monitor_cluster_replicas", 0.0) for r in replicas]
        except OSError:
            seen = []
        if seen and all(n == len(replicas) for n in seen):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the replicas see {seen} live replicas, not {len(replicas)} each")
        time.sleep(0.2)


def stop_all(replicas: list[Replica]) -> None:
    for r in replicas:
        if r.process.poll() is None:
            r.process.terminate()
    for r in replicas:
        try:
            r.process.wait(30)
        except subprocess.TimeoutExpired:
            r.process.kill()
            r.process.wait()


def redis_memory(server: RedisServer | None) -> int:
    """Redis' used memory in bytes (0 without a cluster)."""
    if server is None:
        return 0
    import redis

    client = redis.Redis(port=server.port)
    try:
        return int(client.info("memory")["used_memory"])
    finally:
        client.close()


@contextlib.contextmanager
def private_redis(workdir: Path) -> Iterator[RedisServer]:
    server = RedisServer(workdir / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


# -- one configuration
# -------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    label: str
    replicas: int
    progress_per_s: float
    steps_per_s: float
    published_per_s: float
    judge_calls_per_s: float
    failed: int
    duplicates: int
    # process -> share of one core over the window
    cpu: dict[str, float] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)  # the replicas' names (keys of cpu)
    owned: list[int] = field(default_factory=list)
    takeovers: int = 0
    fenced: int = 0
    timeline: list[int] = field(default_factory=list)  # progress messages per 5 s of the window
    # Redis' used memory at the end over the steps published (cluster only)
    redis_bytes_per_step: float = 0.0
    # the replicas' scoring counters over the window, per second
    flow: dict[str, float] = field(default_factory=dict)


def measure(
    label: str,
    n: int,
    clustered: bool,
    judge: ScriptedJudge,
    args: argparse.Namespace,
    slots: int | None = None,
) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp, mosquitto() as broker:
        workdir = Path(tmp)
        with private_redis(workdir) if clustered else contextlib.nullcontext() as redis:
            cluster = redis.url if redis is not None else None
            replicas = [
                start_replica(f"r{i + 1}", broker, judge, workdir, args, cluster, slots)
                for i in range(n)
            ]
            ctx = mp.get_context("spawn")
            parent, child = ctx.Pipe()
            pub = ctx.Process(
                target=publisher, args=(broker.port, child, args.runs, args.rate), daemon=True
            )
            progress: Progress | None = None
            try:
                wait_serving(replicas, clustered)
                memory0 = redis_memory(redis)
                progress = Progress(broker.port)
                pub.start()
                parent.send("go")
                kind, _t_started = parent.recv()
                assert kind == "started"
                time.sleep(args.warmup_s)
                assert pub.pid is not None
                procs = {r.name: r.process.pid for r in replicas}
                procs |= {
                    "judge": judge.process.pid,
                    "mosquitto": broker.process.pid,
                    "publisher": pub.pid,
                }
                if redis is not None and redis.proc is not None:
                    procs["redis"] = redis.proc.pid
                cpu0 = {k: cpu_seconds(pid) for k, pid in procs.items()}
                flow0 = flow_counts(replicas)
                calls0, t0 = judge.calls, time.time()
                time.sleep(args.window_s)
                calls1, t1 = judge.calls, time.time()
                flow1 = flow_counts(replicas)
                cpu = {k: (cpu_seconds(pid) - cpu0[k]) / (t1 - t0) for k, pid in procs.items()}
                parent.send("stop")
                _, sent, pub_s = parent.recv()
                # Once the last steps are in (a few heartbeats): the journals' size, per step
                # published.
                time.sleep(2)
                memory = redis_memory(redis) - memory0
                window = progress.between(t0, t1)
                seen_pairs: set[tuple[str, int]] = set()
                duplicates = 0
                for m in progress.between(0, time.time() + 1):
                    duplicates += (m[1], m[2]) in seen_pairs
                    seen_pairs.add((m[1], m[2]))
                slices = [0] * max(1, int(args.window_s // 5))
                for m in window:
                    slices[min(len(slices) - 1, int((m[0] - t0) // 5))] += 1
                stats = [r.metrics() for r in replicas]
                owned_metric = (
                    "agent_monitor_runs_owned" if clustered else "agent_monitor_runs_active"
                )
                span = t1 - t0
                return Outcome(
                    label=label,
                    replicas=n,
                    progress_per_s=sum(1 for m in window if m[4]) / span,
                    steps_per_s=sum(m[3] for m in window if m[4]) / span,
                    published_per_s=sent / pub_s,
                    judge_calls_per_s=(calls1 - calls0) / span,
                    failed=sum(1 for m in window if not m[4]),
                    duplicates=duplicates,
                    cpu=cpu,
                    names=[r.name for r in replicas],
                    # Outside cluster mode runs_owned stays 0: the one daemon's live runs are its
                    # runs.
                    owned=[int(s.get(owned_metric, 0)) for s in stats],
                    takeovers=int(
                        sum(s.get("agent_monitor_run_takeovers_total", 0) for s in stats)
                    ),
                    fenced=int(sum(s.get("agent_monitor_cluster_fenced_total", 0) for s in stats)),
                    timeline=slices,
                    redis_bytes_per_step=memory / max(1, sent),
                    flow={k: (flow1[k] - flow0[k]) / span for k in flow1},
                )
            finally:
                if progress is not None:
                    progress.close()
                stop_all(replicas)
                pub.join(10)
                if pub.is_alive():
                    pub.kill()


FLOW = {
    "scorings": "agent_monitor_scorings_total",
    "superseded": "agent_monitor_scorings_superseded_total",
    "held": "agent_monitor_scorings_held_total",
    "coalesced": "agent_monitor_coalesced_steps_total",
    "outbox_dropped": "agent_monitor_outbox_dropped_total",
}
"""The replicas' counters that say what became of the judge calls: scorings made, superseded in
flight (published, then replaced), steps folded into a later scoring before it started, progress
messages dropped for room."""


def flow_counts(replicas: list[Replica]) -> dict[str, float]:
    """The FLOW counters now, summed over the replicas."""
    stats = [r.metrics() for r in replicas]
    return {k: sum(s.get(name, 0.0) for s in stats) for k, name in FLOW.items()}


# -- report
# --------------------------------------------------------------------------------------------------


def _key(r: Outcome) -> str:
    """The kv-line name of a row: replicasN, plain, or plain_xS / replicas1_xS for the
    equal-slots baselines."""
    if "-x" in r.label:
        slots = r.label.rsplit("-x", 1)[1]
        return f"{'replicas1' if r.label.startswith('cluster') else 'plain'}_x{slots}"
    return f"replicas{r.replicas}" if r.label.startswith("cluster") else "plain"


def report(results: list[Outcome], args: argparse.Namespace, load_start: str) -> int:
    print(
        f"\ncluster: {args.runs} runs, steps at {args.rate:g}/s, judge "
        f"{args.latency_s * 1000:.0f} ms per call, "
        f"--max-concurrency {args.max_concurrency} per replica, window {args.window_s:g} s "
        f"after {args.warmup_s:g} s"
    )
    head = (
        f"{'config':<10} {'scored/s':>9} {'x':>6} {'steps/s':>8} {'sent/s':>7} "
        f"{'judge/s':>8} {'dup':>4} "
    )
    head += f"{'redis B/step':>12} {'runs owned':<16}"
    print(head)
    base = next(
        (r.progress_per_s for r in results if r.label == "cluster-1"), results[0].progress_per_s
    )
    # nothing scored in the window (a starved machine): no ratio, not a crash
    base = base or float("nan")
    for r in results:
        owned = "/".join(str(o) for o in r.owned)
        print(
            f"{r.label:<10} {r.progress_per_s:>9.1f} {r.progress_per_s / base:>6.2f} "
            f"{r.steps_per_s:>8.1f} "
            f"{r.published_per_s:>7.1f} {r.judge_calls_per_s:>8.1f} {r.duplicates:>4} "
            f"{r.redis_bytes_per_step:>12.0f} {owned:<16}"
        )
    print("\nCPU over the window (share of one core; the machine has", os.cpu_count(), "cores):")
    reps_all = sorted({k for r in results for k in r.names})
    names = reps_all + sorted({k for r in results for k in r.cpu} - set(reps_all))
    print(
        f"{'config':<10} " + " ".join(f"{k:>9}" for k in names) + f" {'total':>7} "
        f"{'replica ms/scored':>18}"
    )
    for r in results:
        reps = [r.cpu[k] for k in r.names]
        per_scoring = 1000 * sum(reps) / max(1e-9, r.progress_per_s)
        cells = " ".join(f"{r.cpu[k]:>9.2f}" if k in r.cpu else f"{'':>9}" for k in names)
        print(f"{r.label:<10} {cells} {sum(r.cpu.values()):>7.2f} {per_scoring:>18.2f}")
    print(
        "\nwhat became of the judge calls over the window (per second; unread: calls "
        "without a progress message):"
    )
    head = (
        f"{'config':<10} {'judge':>7} {'scorings':>9} {'received':>9} {'unread':>7} "
        f"{'superseded':>11} "
    )
    print(head + f"{'held':>7} {'folded':>7} {'dropped':>8}")
    for r in results:
        received = r.progress_per_s + r.failed / args.window_s
        unread = 1 - received / r.judge_calls_per_s if r.judge_calls_per_s else 0.0
        f = r.flow
        print(
            f"{r.label:<10} {r.judge_calls_per_s:>7.1f} {f.get('scorings', 0):>9.1f} "
            f"{received:>9.1f} {unread:>7.1%} "
            f"{f.get('superseded', 0):>11.1f} {f.get('held', 0):>7.1f} "
            f"{f.get('coalesced', 0):>7.1f} "
            f"{f.get('outbox_dropped', 0):>8.1f}"
        )
    print("\nscored progress messages per 5 s of the window:")
    for r in results:
        print(f"{r.label:<10} " + " ".join(str(x) for x in r.timeline))
    print(f"machine load (1-min average) at start {load_start}, at end {load1()}")
    pairs: dict[str, object] = {}
    for r in results:
        pairs[_key(r)] = r.progress_per_s
    for r in results:
        if r.label.startswith("cluster") and r.replicas > 1 and "-x" not in r.label:
            pairs[f"speedup{r.replicas}"] = r.progress_per_s / base
    for r in results:
        key = _key(r)
        pairs[f"{key}_steps"] = r.steps_per_s
        received = r.progress_per_s + r.failed / args.window_s
        pairs[f"{key}_unread"] = 1 - received / r.judge_calls_per_s if r.judge_calls_per_s else 0.0
        pairs[f"{key}_superseded"] = r.flow.get("superseded", 0.0) / max(
            1e-9, r.flow.get("scorings", 0.0)
        )
        reps = [r.cpu[k] for k in r.names]
        pairs[f"{key}_cpu"] = sum(reps) / max(1, len(reps))
        if r.label.startswith("cluster"):
            pairs[f"{key}_redis_bytes_per_step"] = round(r.redis_bytes_per_step)
    pairs["duplicates"] = sum(r.duplicates for r in results)
    pairs["failed"] = sum(r.failed for r in results)
    pairs["takeovers"] = sum(r.takeovers for r in results)
    pairs["fenced"] = sum(r.fenced for r in results)
    pairs |= {"runs": args.runs, "rate": args.rate, "judge_latency_s": args.latency_s}
    pairs |= {"max_concurrency": args.max_concurrency, "broker": "stock"}
    print(kv_line(**pairs))
    return 0


def main() -> int:
    cleanup_on_sigterm()
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--replicas", default="1,2,3", help="replica counts to measure, comma-separated (1,2,3)"
    )
    ap.add_argument("--runs", type=int, default=300, help="live runs (300)")
    ap.add_argument(
        "--rate",
        type=float,
        default=200.0,
        help="steps published per second, all runs together (200)",
    )
    ap.add_argument(
        "--latency-s", type=float, default=0.1, help="the judge's latency per call (0.1)"
    )
    ap.add_argument(
        "--max-concurrency", type=int, default=4, help="each replica's --max-concurrency (4)"
    )
    ap.add_argument(
        "--warmup-s", type=float, default=10.0, help="seconds of steps before the window (10)"
    )
    ap.add_argument("--window-s", type=float, default=30.0, help="the measured window (30)")
    ap.add_argument(
        "--plain", action="store_true", help="also one serve without --cluster (SQLite journal)"
    )
    ap.add_argument(
        "--equal-slots",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also one plain serve and one cluster replica with all the judge slots of the "
        "largest cluster (on)",
    )
    args = ap.parse_args()
    counts = [int(x) for x in args.replicas.split(",") if x.strip()]
    if (not counts and not args.plain) or min(counts, default=1) < 1:
        ap.error("--replicas: counts >= 1 (empty only with --plain)")
    if args.runs < 1 or args.rate <= 0 or args.window_s < 5:
        ap.error("--runs >= 1, --rate > 0, --window-s >= 5")
    load_start = load1()
    results: list[Outcome] = []
    with contextlib.suppress(KeyboardInterrupt), scripted_judge(args.latency_s) as judge:
        configs: list[tuple[str, int, bool, int | None]] = (
            [("plain", 1, False, None)] if args.plain else []
        )
        configs += [(f"cluster-{n}", n, True, None) for n in counts]
        if args.equal_slots and max(counts, default=1) > 1:
            # The baseline a user picks before adding replicas: one process with all the judge
            # slots.
            total = max(counts) * args.max_concurrency
            configs += [
                (f"plain-x{total}", 1, False, total),
                (f"cluster-1-x{total}", 1, True, total),
            ]
        for label, n, clustered, slots in configs:
            print(f"{label}: {n} replica(s) ..", file=sys.stderr, flush=True)
            out = measure(label, n, clustered, judge, args, slots)
            print(
                f"{label}: {out.progress_per_s:.1f} scored/s, {out.steps_per_s:.1f} steps/s "
                "covered, "
                f"cpu {', '.join(f'{k} {v:.2f}' for k, v in out.cpu.items())}",
                file=sys.stderr,
                flush=True,
            )
            results.append(out)
        return report(results, args, load_start)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())

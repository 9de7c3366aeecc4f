"""A robot control loop at 10 Hz that streams each action and camera frame to the monitor and stops
on abort.

    python -m agent_monitor.adapters.robot_loop --broker mqtt://127.0.0.1:1883 --steps 100

The "robot" is a toy: a dot that moves across a small camera image toward a goal square. What
matters is the loop's shape, the same for a real robot:

- every tick: act, grab a frame, hand both to the monitor without waiting (`ProgressTracker.submit`
  in-process, or `Run.step` over MQTT, QoS 1 with no wait for the broker), then sleep until the next
  tick on a fixed schedule (a late tick is not caught up with a burst);
- a frame goes with every step: the monitor's `FrameBudget` chooses which frames the judge sees
  (anchors whose stride doubles as the episode grows, so they span all of it, plus the newest 4), so
  the loop never has to;
- scoring runs beside the loop: steps that arrive while the judge is busy are folded into its next
  call (`coalesced`), so a slow judge lowers how often the run is scored, never the loop's rate;
- before each tick the loop reads the monitor's latest signal and stops when it is `abort`.

Each step's text is the action and the robot's state; `meta={"distance_to_goal": d}` is there for a
`rule.metric_curve` criterion (the judge never sees meta).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from PIL import Image, ImageDraw

if TYPE_CHECKING:
    from agent_monitor import AsyncProgressTracker, ProgressTracker
    from agent_monitor.wire import Run

    Sink = ProgressTracker | AsyncProgressTracker | Run

DEFAULT_TASK = (
    "Drive the red dot into the green goal square in the lower right corner of the camera image."
)
EXIT_ABORTED = 3


class DotWorld:
    """A dot on a small camera image, moving toward a goal square with a little wobble;
    deterministic."""

    def __init__(
        self,
        size: tuple[int, int] = (64, 48),
        start: tuple[float, float] = (6.0, 6.0),
        goal: tuple[float, float] = (54.0, 38.0),
        speed: float = 1.5,
        drift: float = 0.0,
    ) -> None:
        """`drift` (radians per step) bends the heading away from the goal: 0 reaches it, ~0.3
        circles forever."""
        self.size = size
        self.x, self.y = start
        self.goal = goal
        self.speed = speed
        self.drift = drift
        self.t = 0

    @property
    def distance(self) -> float:
        return math.hypot(self.goal[0] - self.x, self.goal[1] - self.y)

    @property
    def reached(self) -> bool:
        return self.distance < 2.0

    def act(self) -> str:
        """Take one step toward the goal; return what was done, as the step's text."""
        self.t += 1
        heading = math.atan2(self.goal[1] - self.y, self.goal[0] - self.x) + self.drift * self.t
        # wobble, so that frames differ even on a straight path
        heading += 0.2 * math.sin(self.t / 3.0)
        step = min(self.speed, self.distance)
        dx, dy = step * math.cos(heading), step * math.sin(heading)
        self.x = min(max(self.x + dx, 0.0), self.size[0] - 1.0)
        self.y = min(max(self.y + dy, 0.0), self.size[1] - 1.0)
        return (
            f"t={self.t}: move dx={dx:+.2f} dy={dy:+.2f}; dot at ({self.x:.1f}, {self.y:.1f}), "
            f"goal at ({self.goal[0]:.0f}, {self.goal[1]:.0f}), distance {self.distance:.1f}"
        )

    def frame(self) -> bytes:
        """The camera image now, as PNG bytes."""
        img = Image.new("RGB", self.size, (235, 235, 235))
        draw = ImageDraw.Draw(img)
        gx, gy = self.goal
        draw.rectangle((gx - 3, gy - 3, gx + 3, gy + 3), fill=(40, 170, 60))
        draw.ellipse((self.x - 2, self.y - 2, self.x + 2, self.y + 2), fill=(210, 40, 40))
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return buf.getvalue()


@dataclass
class LoopResult:
    """What a control loop did."""

    steps: int = 0
    """Steps (each with one frame) handed to the monitor."""
    aborted: bool = False
    abort_signal_step: int | None = None
    """The monitor's step that the abort was decided at."""
    reached_goal: bool = False
    periods: list[float] = field(default_factory=list)
    """Time between consecutive tick starts, in seconds."""
    overruns: int = 0
    """Ticks whose work took longer than the period (the schedule was then restarted, not caught
    up)."""
    send_s: list[float] = field(default_factory=list)
    """Time each hand-off to the monitor took, in seconds."""


def _abort(sink: Any) -> tuple[bool, int | None]:
    """Whether the monitor's latest signal is abort, and the step it was decided at."""
    if hasattr(sink, "submit"):
        latest = sink.latest
        decision = latest.signal if latest is not None else None
    else:
        decision = sink.signal
    if decision is None or decision.signal != "abort":
        return False, None
    return True, decision.step


def control_loop(
    sink: Sink,
    *,
    steps: int,
    hz: float = 10.0,
    world: DotWorld | None = None,
    stop_at_goal: bool = True,
    on_tick: Callable[[int, str], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> LoopResult:
    """Run up to `steps` ticks at `hz`, sending each action and frame to `sink`; stop on abort or
    at the goal."""
    if hz <= 0 or steps < 0:
        raise ValueError("hz must be > 0 and steps >= 0")
    world = world or DotWorld()
    period = 1.0 / hz
    result = LoopResult()
    submit = sink.submit if hasattr(sink, "submit") else sink.step
    start = clock()
    next_tick = start
    last_tick: float | None = None
    for k in range(steps):
        now = clock()
        if last_tick is not None:
            result.periods.append(now - last_tick)
        last_tick = now
        aborted, at = _abort(sink)
        if aborted:
            result.aborted, result.abort_signal_step = True, at
            break
        text = world.act()
        frame = world.frame()
        t_send = clock()
        submit(text, images=[frame], meta={"distance_to_goal": round(world.distance, 3)})
        result.send_s.append(clock() - t_send)
        result.steps += 1
        if on_tick is not None:
            on_tick(k + 1, text)
        if stop_at_goal and world.reached:
            result.reached_goal = True
            break
        next_tick += period
        delay = next_tick - clock()
        if delay > 0:
            sleep(delay)
        else:
            result.overruns += 1
            next_tick = clock()  # do not try to catch up with a burst of ticks
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m agent_monitor.adapters.robot_loop",
        description="A toy robot control loop that streams actions and camera frames to "
        "agent-monitor over MQTT.",
    )
    ap.add_argument("--broker", default="mqtt://127.0.0.1:1883", help="MQTT broker URL")
    ap.add_argument("--steps", type=int, default=100, help="maximum number of ticks")
    ap.add_argument("--hz", type=float, default=10.0, help="control rate")
    ap.add_argument("--run-id", default=None, help="run id (default: robot-<unix time>)")
    ap.add_argument("--task", default=DEFAULT_TASK)
    ap.add_argument("--criteria", default="robot", help="bundled rubric for the run")
    ap.add_argument(
        "--abort-below",
        type=float,
        default=None,
        help="policy: abort when progress stays below this",
    )
    ap.add_argument(
        "--drift", type=float, default=0.0, help="heading drift per step (0.3 makes a hopeless run)"
    )
    args = ap.parse_args(argv)
    from agent_monitor.wire import MonitorClient

    from ._cli import quiet_logs

    quiet_logs()
    run_id = args.run_id or f"robot-{int(time.time())}"
    policy = {"abort_below": args.abort_below} if args.abort_below is not None else None
    world = DotWorld(drift=args.drift)
    try:
        with MonitorClient(args.broker) as client:
            run = client.start_run(
                run_id,
                task=args.task,
                criteria=args.criteria,
                policy=policy,
                images=[world.frame()],
            )
            result = control_loop(run, steps=args.steps, hz=args.hz, world=world)
            outcome: Literal["success", "failure"] | None = None
            if not result.aborted:
                outcome = "success" if result.reached_goal else "failure"
            run.end(outcome)
    except (ConnectionError, TimeoutError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    mean = sum(result.periods) / len(result.periods) if result.periods else None
    summary = {
        "run_id": run_id,
        "steps": result.steps,
        "aborted": result.aborted,
        "abort_signal_step": result.abort_signal_step,
        "reached_goal": result.reached_goal,
        "outcome": outcome,
        "mean_period_s": round(mean, 4) if mean is not None else None,
        "overruns": result.overruns,
    }
    print(json.dumps(summary))
    return EXIT_ABORTED if result.aborted else 0


if __name__ == "__main__":
    sys.exit(main())

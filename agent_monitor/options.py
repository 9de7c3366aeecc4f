"""The trackers' options, written once: each field's name, default, help and check.

`TrackerOptions` is every option of `ProgressTracker`, `AsyncProgressTracker`, `track` and
`atrack`: those four take exactly its fields as keywords (their signatures are generated
from it, see `tracker`), or a `TrackerOptions` whole as `options=`. Its base,
`ScoringOptions`, holds the options that are settings rather than objects (a number, a
rubric file's name): `MonitorConfig` inherits them, and `agent-monitor serve` generates
their flags from these fields, so a default changed here changes everywhere.

```python
from agent_monitor import ProgressTracker, TrackerOptions

careful = TrackerOptions(repeats=3, policy={"abort_below": 0.2})
tracker = ProgressTracker("Fix the failing test", judge=judge, options=careful, run_id="run-7")
```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

from ._runtime.budget import DEFAULT_BUDGET_S
from .images import FrameBudget
from .scale import DEFAULT_MIN_MASS

if TYPE_CHECKING:
    from opentelemetry._logs import LoggerProvider

    from .calibration import Calibration
    from .criteria import CriteriaSpec
    from .policy import Policy
    from .progress import Decision, Prices, Progress

DEFAULT_REPEATS = 1
"""Judge calls per criterion and prefix."""
DEFAULT_EXTRACT_BUDGET_S: float = DEFAULT_BUDGET_S
"""Seconds a step's extractors, or a criterion's rules on one prefix, may take (then:
`extractor_timeout`)."""
DEFAULT_MAX_SIDE: int | None = 1024
"""Images are downscaled so their longer side is at most this many pixels (None: never)."""
DEFAULT_ALLOW_FILES = True
"""Whether a step's images may name local files (the daemon turns it off: network events never
may)."""
DEFAULT_CURVE_WINDOW = 100
"""Results `tracker.curve` keeps (the newest steps); `summary` and `points` cover the whole run
whatever its length."""

ProgressCallback = Callable[["Progress"], object]


@dataclass(frozen=True, slots=True, kw_only=True)
class ScoringOptions:
    """The scoring options that are settings: a tracker's, and a monitor's for every run
    (`MonitorConfig`)."""

    repeats: int = field(default=DEFAULT_REPEATS, metadata={"help": "judge repeats per criterion"})
    min_mass: float | None = field(
        default=None,
        metadata={
            "help": "minimum probability mass on scale letters for an answer to count; none: "
            "the judge's "
            "recommendation (the packaged tiny local models recommend a low one), else "
            f"{DEFAULT_MIN_MASS}"
        },
    )
    criteria: CriteriaSpec = field(
        default=None,
        metadata={
            "flag_type": str | None,
            "help": "the rubric: a bundled name or a rubric file (.md, .json, .yaml; in "
            "Python also a mapping, a "
            "list or a Rubric); for the monitor, the rubric of runs whose start names none, "
            "read at start-up; "
            "none: the bundled progress rubric",
        },
    )
    frame_budget: FrameBudget = field(
        default_factory=FrameBudget,
        metadata={
            "cli": False,
            "help": "which of a run's images the judge sees (the newest, then every n-th)",
        },
    )
    extract_budget_s: float = field(
        default=DEFAULT_EXTRACT_BUDGET_S,
        metadata={
            "flag": "--extract-budget",
            "help": "seconds a step's extractors, or a criterion's rules on one prefix, may "
            "take before that step "
            "or score reports extractor_timeout (patterns come from the network and may "
            "backtrack for ever)",
        },
    )

    prompt_budget: int | None = field(
        default=None,
        metadata={
            "flag": "--prompt-budget",
            "help": "most tokens a judge prompt may hold: older steps are folded into a "
            "digest to stay under it; "
            "none: the judge's context (when known) less room for the answer, else no limit "
            "(the whole run)",
        },
    )
    digest: str | None = field(
        default=None,
        metadata={
            "help": "how folded steps are digested: none (default) one deterministic line "
            "per step, free; 'judge' "
            "each folded chunk summarised once by the judge's model (a text completion, its "
            "tokens in the run's "
            "usage and cost; a failed one keeps the chunk's lines); a model name: by that "
            "model on the judge's "
            "server"
        },
    )

    def __post_init__(self) -> None:
        """Check the settings (every form that takes them checks them here, once)."""
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats={self.repeats!r}; use 1 or more")
        if self.min_mass is not None and not 0.0 <= self.min_mass <= 1.0:
            raise ValueError(
                f"min_mass={self.min_mass}; use a number in [0, 1], or None for the judge's "
                "recommendation"
            )
        if self.prompt_budget is not None and (
            isinstance(self.prompt_budget, bool)
            or not isinstance(self.prompt_budget, int)
            or self.prompt_budget < 1
        ):
            raise ValueError(
                f"prompt_budget={self.prompt_budget!r}; use a number of tokens >= 1, or None"
            )
        if self.digest is not None and (
            not isinstance(self.digest, str) or not self.digest.strip()
        ):
            raise ValueError(
                f"digest={self.digest!r}; use None (the deterministic digest), 'judge' (the "
                "judge's model "
                "summarises) or a model name on the judge's server"
            )
        if not self.extract_budget_s > 0:
            raise ValueError(
                f"extract_budget_s={self.extract_budget_s}; use a number of seconds > 0 "
                f"(default {DEFAULT_EXTRACT_BUDGET_S})"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class TrackerOptions(ScoringOptions):
    """Every option of the four tracker forms (`ProgressTracker`, `AsyncProgressTracker`, `track`,
    `atrack`).

    Built from a form's keywords (unknown ones are a TypeError naming the form, bad values a
    ValueError), or given whole as `options=` (keywords given beside it win).
    """

    max_side: int | None = field(
        default=DEFAULT_MAX_SIDE,
        metadata={
            "help": "images are downscaled so their longer side is at most this many "
            "pixels (None: never)"
        },
    )
    allow_files: bool = field(
        default=DEFAULT_ALLOW_FILES,
        metadata={
            "help": "whether images may name local files (the monitor never lets "
            "network events do so)"
        },
    )
    expected: str | None = field(
        default=None,
        metadata={"help": "the expected answer, for rule criteria that compare with it"},
    )
    run_id: str | None = field(
        default=None,
        metadata={"help": "the run's id: in results, logs, judge calls and calibration"},
    )
    on_progress: ProgressCallback | None = field(
        default=None, metadata={"help": "called with every result"}
    )
    policy: Policy | Mapping[str, Any] | None = field(
        default=None,
        metadata={
            "help": "continue / abort / resample thresholds (a Policy or a mapping of its "
            "settings); a rubric's "
            "thresholds fill the levels it leaves open (a mapping's keys and a Policy's "
            "non-default settings "
            "win); None: the rubric's thresholds, if any"
        },
    )
    on_signal: Callable[[Decision], object] | None = field(
        default=None, metadata={"help": "called with a decision whenever the run's signal changes"}
    )
    calibration: Calibration | None = field(
        default=None,
        metadata={"help": 'learns abort_below="auto" thresholds from finished runs (see `finish`)'},
    )
    family: str | None = field(
        default=None, metadata={"help": "the run's calibration family (None: the task)"}
    )
    prices: Prices | None = field(
        default=None,
        metadata={"help": "the judge's prices: results then carry the run's cost in USD"},
    )
    otel: bool | LoggerProvider = field(
        default=False,
        metadata={
            "help": "emit OpenTelemetry gen_ai.evaluation.result events for every result "
            "(True: through the "
            "global LoggerProvider; a LoggerProvider: through that one)"
        },
    )
    curve_window: int = field(
        default=DEFAULT_CURVE_WINDOW,
        metadata={
            "help": "results `curve` keeps (the newest steps); `summary` and `points` "
            "cover every result"
        },
    )

    def __post_init__(self) -> None:
        """Check the options (the settings' checks first)."""
        # (zero-argument super() fails in slotted dataclasses before 3.14)
        ScoringOptions.__post_init__(self)
        if (
            isinstance(self.curve_window, bool)
            or not isinstance(self.curve_window, int)
            or self.curve_window < 1
        ):
            raise ValueError(
                f"curve_window={self.curve_window!r}; use a number of results >= 1 (default "
                f"{DEFAULT_CURVE_WINDOW})"
            )
        if (
            self.otel
            and self.otel is not True
            and not callable(getattr(self.otel, "get_logger", None))
        ):
            raise TypeError(
                f"otel={self.otel!r}; use True (the global LoggerProvider) or a LoggerProvider"
            )

    @classmethod
    def of(cls, owner: str, options: ScoringOptions | None = None, **given: Any) -> Self:
        """The options a form was called with: `options`' fields (any `ScoringOptions`, a
        `MonitorConfig` too), then `given`.

        `owner` names the form in the TypeError for a keyword that is no option.
        """
        unknown = sorted(set(given) - OPTION_NAMES)
        if unknown:
            raise TypeError(
                f"{owner}() got an unexpected keyword argument {unknown[0]!r}; its options are "
                f"TrackerOptions' fields: {', '.join(sorted(OPTION_NAMES))}"
            )
        if options is None:
            return cls(**given)
        if not isinstance(options, ScoringOptions):
            raise TypeError(
                f"{owner}(options={options!r}); use a TrackerOptions (or a MonitorConfig)"
            )
        taken = {
            f.name: getattr(options, f.name)
            for f in dataclasses.fields(options)
            if f.name in OPTION_NAMES
        }
        return cls(**{**taken, **given})

    def settings(self) -> dict[str, Any]:
        """The options as keywords, as a tracker form takes them."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


OPTION_NAMES: frozenset[str] = frozenset(f.name for f in dataclasses.fields(TrackerOptions))
"""The names of every tracker option."""

__all__ = [
    "DEFAULT_ALLOW_FILES",
    "DEFAULT_CURVE_WINDOW",
    "DEFAULT_EXTRACT_BUDGET_S",
    "DEFAULT_MAX_SIDE",
    "DEFAULT_REPEATS",
    "OPTION_NAMES",
    "ProgressCallback",
    "ScoringOptions",
    "TrackerOptions",
]

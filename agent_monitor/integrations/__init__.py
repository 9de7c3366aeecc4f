"""In-process integrations for Python RL trainers: verl, verifiers 0.4, Ray.

Each module imports its framework only when used (verl needs none at all):
`agent_monitor.integrations.verl` (`make_compute_score`), `.verifiers` (`monitor_hooks`), `.ray`
(`MonitorActor`). What they share is here: a `Verdict` says whether to stop, the reward so far, and
`stop_kind` ("judged" or "infra": a judge failure, which never stops or penalises a rollout);
`RewardUnavailable` is a reward a failed judge could not give.
"""

from ._common import (
    DEFAULT_MAX_CHARS,
    DEFAULT_MAX_STEPS,
    RewardUnavailable,
    StopKind,
    Verdict,
    split_turns,
    verdict,
)

__all__ = [
    "DEFAULT_MAX_CHARS",
    "DEFAULT_MAX_STEPS",
    "RewardUnavailable",
    "StopKind",
    "Verdict",
    "split_turns",
    "verdict",
]

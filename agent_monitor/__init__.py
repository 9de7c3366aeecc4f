"""agent-monitor: live, fine-grained progress scores for running AI agents and robots.

This module is the in-process hook and its vocabulary: trackers, judges, results, policy,
calibration, criteria, best-of-N selection. It loads neither the daemon nor any MQTT or Prometheus
library; `Monitor` and `MonitorClient` are loaded on first use (PEP 562), as are the judges' SDKs.
"""

from typing import TYPE_CHECKING, Any

from .calibration import Calibration, CalibrationError, Family, Threshold
from .criteria import CriteriaError, Criterion, Rubric, bundled_criteria, load_criteria
from .extractors import register_extractor
from .group_tracker import AsyncGroupTracker, GroupTracker
from .images import Frame, FrameBudget, ImageError, load_image
from .judges.base import BaseJudge, Judge, JudgeError, JudgeRequest, JudgeResponse
from .options import TrackerOptions
from .policy import Policy, PolicyError
from .progress import Decision, Prices, Progress, Signal, Usage
from .prompts import Prompt, Step, build_prompt
from .rules import RuleInput, RuleScore, register_rule
from .scale import (
    LETTERS,
    CriterionScore,
    LetterDistribution,
    ScoreError,
    distribution,
    read_letter,
)
from .selection import Comparison, Selection, Tournament, aselect, compare, select, tournament
from .tracker import AsyncProgressTracker, ProgressTracker, atrack, score_prefix, track

if TYPE_CHECKING:
    from .daemon import Monitor, MonitorConfig
    from .judges.gemini import GeminiJudge
    from .judges.llamacpp import LlamaCppJudge
    from .judges.openai import OpenAIJudge
    from .wire import MonitorClient

__version__ = "0.2.0"

# Judges import their SDKs (openai, google-genai, llama-cpp), and the daemon side its MQTT
# libraries, only when asked for.
_LAZY = {
    "Monitor": "agent_monitor.daemon",
    "MonitorConfig": "agent_monitor.daemon",
    "MonitorClient": "agent_monitor.wire",
    "OpenAIJudge": "agent_monitor.judges.openai",
    "GeminiJudge": "agent_monitor.judges.gemini",
    "LlamaCppJudge": "agent_monitor.judges.llamacpp",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'agent_monitor' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "LETTERS",
    "AsyncGroupTracker",
    "AsyncProgressTracker",
    "BaseJudge",
    "Calibration",
    "CalibrationError",
    "Comparison",
    "CriteriaError",
    "Criterion",
    "CriterionScore",
    "Decision",
    "Family",
    "Frame",
    "FrameBudget",
    "GeminiJudge",
    "GroupTracker",
    "ImageError",
    "Judge",
    "JudgeError",
    "JudgeRequest",
    "JudgeResponse",
    "LetterDistribution",
    "LlamaCppJudge",
    "Monitor",
    "MonitorClient",
    "MonitorConfig",
    "OpenAIJudge",
    "Policy",
    "PolicyError",
    "Prices",
    "Progress",
    "ProgressTracker",
    "Prompt",
    "Rubric",
    "RuleInput",
    "RuleScore",
    "ScoreError",
    "Selection",
    "Signal",
    "Step",
    "Threshold",
    "Tournament",
    "TrackerOptions",
    "Usage",
    "__version__",
    "aselect",
    "atrack",
    "build_prompt",
    "bundled_criteria",
    "compare",
    "distribution",
    "load_criteria",
    "load_image",
    "read_letter",
    "register_extractor",
    "register_rule",
    "score_prefix",
    "select",
    "tournament",
    "track",
]

"""agent-monitor: live, fine-grained progress scores for running AI agents and robots."""

from typing import TYPE_CHECKING, Any

from .criteria import CriteriaError, Criterion, Rubric, bundled_criteria, load_criteria
from .extractors import register_extractor
from .images import Frame, FrameBudget, ImageError, load_image
from .judges.base import BaseJudge, Judge, JudgeError, JudgeRequest, JudgeResponse, Usage
from .metrics import Metrics
from .policy import Decision, Policy, PolicyError
from .prompts import Prompt, Step, build_prompt
from .rules import RuleInput, RuleScore, register_rule
from .runs import RunLimits
from .scale import LETTERS, CriterionScore, LetterDistribution, ScoreError, distribution, read_letter
from .settings import BrokerSettings
from .tracker import AsyncProgressTracker, Progress, ProgressTracker, atrack, score_prefix, track

if TYPE_CHECKING:
    from .broker import EmbeddedBroker
    from .client import MonitorClient
    from .daemon import Monitor
    from .judges.gemini import GeminiJudge
    from .judges.llamacpp import LlamaCppJudge
    from .judges.openai import OpenAIJudge

__version__ = "0.1.0"

# Judges import their SDKs (openai, google-genai, llama-cpp), and the daemon side its MQTT libraries, only when asked for.
_LAZY = {
    "Monitor": "agent_monitor.daemon",
    "MonitorClient": "agent_monitor.client",
    "EmbeddedBroker": "agent_monitor.broker",
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


__all__ = [
    "LETTERS",
    "AsyncProgressTracker",
    "BaseJudge",
    "BrokerSettings",
    "CriteriaError",
    "Criterion",
    "CriterionScore",
    "Decision",
    "EmbeddedBroker",
    "Frame",
    "FrameBudget",
    "GeminiJudge",
    "ImageError",
    "Judge",
    "JudgeError",
    "JudgeRequest",
    "JudgeResponse",
    "LetterDistribution",
    "LlamaCppJudge",
    "Metrics",
    "Monitor",
    "MonitorClient",
    "OpenAIJudge",
    "Policy",
    "PolicyError",
    "Progress",
    "ProgressTracker",
    "Prompt",
    "Rubric",
    "RuleInput",
    "RuleScore",
    "RunLimits",
    "ScoreError",
    "Step",
    "Usage",
    "__version__",
    "atrack",
    "build_prompt",
    "bundled_criteria",
    "distribution",
    "load_criteria",
    "load_image",
    "read_letter",
    "register_extractor",
    "register_rule",
    "score_prefix",
    "track",
]

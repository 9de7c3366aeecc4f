"""`agent-monitor judge-server`: a local GGUF judge behind an OpenAI-compatible HTTP API."""

from ._server import JudgeServer, JudgeServerSettings

__all__ = [
    "JudgeServer",
    "JudgeServerSettings",
]

"""The LLM API proxy door: forwards an agent's API calls and watches every turn."""

from ._proxy import ProxySource

__all__ = [
    "ProxySource",
]

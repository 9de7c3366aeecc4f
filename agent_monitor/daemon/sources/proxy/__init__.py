"""The LLM API proxy door: forwards an agent's API calls and watches every turn."""

from ._proxy import ProxySource
from ._turns import Item, Role, parse_request

__all__ = [
    "Item",
    "ProxySource",
    "Role",
    "parse_request",
]

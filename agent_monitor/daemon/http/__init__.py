"""The daemon's one HTTP server (h11 on asyncio streams) and its connection admission."""

from ._h11 import H11Conn, H11Server, declared_length
from ._server import HttpRequest, HttpResponse, HttpServer, HttpServerStatistics, Route

__all__ = [
    "H11Conn",
    "H11Server",
    "HttpRequest",
    "HttpResponse",
    "HttpServer",
    "HttpServerStatistics",
    "Route",
    "declared_length",
]

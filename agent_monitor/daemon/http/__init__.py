"""The daemon's one HTTP server (h11 on asyncio streams), its connection admission and each
door's bounds."""

from ._h11 import H11Conn, H11Server, declared_length
from ._server import (
    GET_HEAD,
    HttpRequest,
    HttpResponse,
    HttpServer,
    HttpServerStatistics,
    Route,
    Site,
    text,
)
from ._settings import (
    BOARD_PORT,
    HttpSettings,
    board_port,
    judge_server_door,
    otlp_door,
    proxy_door,
)

__all__ = [
    "BOARD_PORT",
    "GET_HEAD",
    "H11Conn",
    "H11Server",
    "HttpRequest",
    "HttpResponse",
    "HttpServer",
    "HttpServerStatistics",
    "HttpSettings",
    "Route",
    "Site",
    "board_port",
    "declared_length",
    "judge_server_door",
    "otlp_door",
    "proxy_door",
    "text",
]

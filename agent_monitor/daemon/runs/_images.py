"""Image sources the operator allowed: files under chosen directories, URLs on chosen hosts (never
by default).

`decode_event` checks a path or URL against the allow-lists; `fetch_images` then reads or fetches
the bytes in a worker thread, with the same size limit and type sniffing as inline images. A file is
opened only after resolving symlinks (it must still be under an allowed directory); a URL is fetched
without following redirects (a redirect could leave the allowed host) and with a timeout.
"""

from __future__ import annotations

import os
import stat
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

from ...images import sniff_mime
from ...wire import EventError, ImageIn, InputEvent


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None  # the caller sees the 3xx as an error: no hop to a host nobody allowed


def fetch_images(
    run_id: str,
    event: InputEvent,
    *,
    image_dirs: Sequence[str | Path],
    max_bytes: int,
    timeout_s: float = 10.0,
) -> None:
    """Read or fetch every path/URL image of `event` (blocking: run it in a worker thread); raise
    EventError."""
    for i, image in enumerate(getattr(event, "images", [])):
        if not isinstance(image, ImageIn) or not image.remote:
            continue
        where = f"images[{i}]"
        try:
            raw = (
                _read(image.path, image_dirs, max_bytes)
                if image.path
                else _get(image.url or "", max_bytes, timeout_s)
            )
        except (OSError, ValueError) as e:
            raise EventError("bad_image", f"{where}: {e}", run_id=run_id) from None
        mime = sniff_mime(raw)
        if mime is None:
            raise EventError(
                "bad_image", f"{where}: the bytes are not PNG, JPEG, GIF or WebP", run_id=run_id
            )
        image.set_fetched(raw, mime)


def _read(path: str, image_dirs: Sequence[str | Path], max_bytes: int) -> bytes:
    real = os.path.realpath(path)
    roots = [os.path.realpath(d) for d in image_dirs]
    if not any(real.startswith(r.rstrip("/") + "/") for r in roots):
        raise ValueError(f"{path!r} resolves outside the allowed directories")
    # O_NONBLOCK: a FIFO planted under the directory must not hang the reader; only regular files
    # are read.
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path!r} is not a regular file")
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise ValueError(f"{path!r} is over the limit of {max_bytes} bytes")
    return raw


def _get(url: str, max_bytes: int, timeout_s: float) -> bytes:
    opener = urllib.request.build_opener(_NoRedirect)
    # scheme checked on decode
    request = urllib.request.Request(url, headers={"User-Agent": "agent-monitor"})
    try:
        with opener.open(request, timeout=timeout_s) as resp:
            raw: bytes = resp.read(max_bytes + 1)
    except urllib.error.HTTPError as e:
        raise ValueError(f"fetching {urlsplit(url).hostname} answered HTTP {e.code}") from None
    except urllib.error.URLError as e:
        raise ValueError(f"cannot fetch from {urlsplit(url).hostname}: {e.reason}") from None
    if len(raw) > max_bytes:
        raise ValueError(
            f"the image at {urlsplit(url).hostname} is over the limit of {max_bytes} bytes"
        )
    return raw

"""Image paths and URLs in events: refused unless the operator allowed their directory or host."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

from ._common import clip, err

IMAGE_SUFFIX = re.compile(r"\.(png|jpe?g|gif|webp|bmp|tiff?|heic|avif)$", re.IGNORECASE)


def looks_like_path(s: str) -> bool:
    """Whether image data looks like a file path rather than base64 (for a helpful message)."""
    return (
        s.startswith(("/", "~", "./", "../", "file:"))
        or re.match(r"[A-Za-z]:[\\/]", s) is not None
        or "\\" in s
        or IMAGE_SUFFIX.search(s) is not None
    )


def check_image_path(path: str, allowed_dirs: Sequence[str | Path]) -> str:
    """Refuse an image path unless it is absolute, plain and under a directory the operator
    allowed."""
    if not allowed_dirs:
        raise err(
            "bad_image",
            f"image path {clip(path, 60)!r} refused: the monitor reads no files named in events "
            "unless its operator allows a directory (--allow-image-dir); send the bytes "
            "inline as base64",
        )
    norm = posixpath.normpath(path)
    if (
        not path.startswith("/")
        or "\x00" in path
        or ".." in path.split("/")
        or norm != path.rstrip("/")
    ):
        raise err(
            "bad_image",
            f"image path {clip(path, 60)!r} must be absolute and plain (no '..', no '//')",
        )
    if not any(norm.startswith(str(d).rstrip("/") + "/") for d in allowed_dirs):
        raise err(
            "bad_image",
            f"image path {clip(path, 60)!r} is not under a directory the operator allowed",
        )
    return norm


def check_image_url(url: str, allowed_hosts: Sequence[str]) -> str:
    """Refuse an image URL unless it is http(s) on a host the operator allowed."""
    if not allowed_hosts:
        raise err(
            "bad_image",
            f"image URL {clip(url, 60)!r} refused: the monitor fetches no URLs named in "
            "events unless its "
            "operator allows the host (--allow-image-host); send the bytes inline as base64",
        )
    parts = urlsplit(url)
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.username
        or parts.password
    ):
        raise err(
            "bad_image",
            f"image URL {clip(url, 60)!r} must be http(s)://host/... without credentials",
        )
    if parts.hostname.lower() not in {h.lower() for h in allowed_hosts}:
        raise err("bad_image", f"image URL host {parts.hostname!r} is not one the operator allowed")
    return url

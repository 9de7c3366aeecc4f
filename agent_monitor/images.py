"""Images: load once, sniff the type, downscale, and keep a per-run frame budget."""

from __future__ import annotations

import base64
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage

ImageInput: TypeAlias = "str | Path | bytes | PILImage | Frame"
"""What the in-process hook accepts as an image: a file path, encoded bytes, a PIL image, or a
Frame."""

DEFAULT_MAX_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_PIXELS = 50_000_000

_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)


class ImageError(ValueError):
    """An image that cannot be used: unknown type, undecodable, too large, or not allowed."""


@dataclass(frozen=True, slots=True)
class Frame:
    """An encoded image held in memory, with its type, size and content digest."""

    data: bytes
    mime: str
    width: int
    height: int
    digest: str

    def data_url(self) -> str:
        """The image as a base64 data URL, as OpenAI-compatible chat APIs take it."""
        return f"data:{self.mime};base64,{base64.b64encode(self.data).decode('ascii')}"

    def describe(self) -> str:
        """A short text stand-in for judges without vision."""
        return f"[image {self.width}x{self.height} {self.mime} {self.digest[:12]}]"


def sniff_mime(data: bytes) -> str | None:
    """The MIME type of encoded image bytes from their magic number, or None."""
    for magic, mime in _MAGIC:
        if data.startswith(magic):
            return mime
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def load_image(
    src: ImageInput,
    *,
    max_side: int | None = None,
    allow_files: bool = True,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> Frame:
    """Load an image once into a Frame, downscaling so its longer side is at most `max_side`.

    Blocking (file I/O and decoding): call it from a worker thread in async code.
    `allow_files=False` refuses paths, for input that came from a network.
    """
    if isinstance(src, Frame):
        return (
            src
            if max_side is None or max(src.width, src.height) <= max_side
            else _encode(_decode(src.data, max_pixels), max_side, src.mime)
        )
    if isinstance(src, (str, Path)):
        if not allow_files:
            raise ImageError("image file paths are not allowed here; send the image bytes inline")
        path = Path(src)
        try:
            size = path.stat().st_size
            if size > max_bytes:
                raise ImageError(
                    f"image file {path} has {size} bytes, over the limit of {max_bytes}"
                )
            data = path.read_bytes()
        except OSError as e:
            raise ImageError(f"cannot read image file {path}: {e.strerror}") from None
        return _from_bytes(data, max_side, max_pixels, max_bytes)
    if isinstance(src, (bytes, bytearray, memoryview)):
        return _from_bytes(bytes(src), max_side, max_pixels, max_bytes)
    if hasattr(src, "save") and hasattr(src, "size"):
        return _encode(src, max_side, "image/png")
    raise ImageError(
        f"unsupported image type {type(src).__name__}; pass a path, bytes or a PIL image"
    )


def _from_bytes(data: bytes, max_side: int | None, max_pixels: int, max_bytes: int) -> Frame:
    if len(data) > max_bytes:
        raise ImageError(f"image has {len(data)} bytes, over the limit of {max_bytes}")
    mime = sniff_mime(data)
    if mime is None:
        raise ImageError("image bytes are not PNG, JPEG, GIF or WebP")
    img = _decode(data, max_pixels)
    if max_side is not None and max(img.size) > max_side:
        return _encode(img, max_side, mime)
    return Frame(
        data=data,
        mime=mime,
        width=img.size[0],
        height=img.size[1],
        digest=hashlib.sha256(data).hexdigest(),
    )


def _decode(data: bytes, max_pixels: int) -> Any:
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data))
        w, h = img.size
        if w * h > max_pixels:
            raise ImageError(f"image is {w}x{h} pixels, over the limit of {max_pixels}")
        img.load()
    except ImageError:
        raise
    except Exception as e:  # PIL raises many types for corrupt data
        raise ImageError(f"image cannot be decoded: {e}") from None
    return img


def _encode(img: Any, max_side: int | None, mime: str) -> Frame:
    if max_side is not None and max(img.size) > max_side:
        img = img.copy()
        img.thumbnail((max_side, max_side))
    fmt = "JPEG" if mime == "image/jpeg" else "PNG"
    if fmt == "JPEG" and img.mode not in ("RGB", "L"):
        img = img.convert("RGB")
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    data = buf.getvalue()
    return Frame(
        data=data,
        mime="image/jpeg" if fmt == "JPEG" else "image/png",
        width=img.size[0],
        height=img.size[1],
        digest=hashlib.sha256(data).hexdigest(),
    )


@dataclass(frozen=True, slots=True)
class FrameBudget:
    """Which frames of a run go to the judge: strided anchors spanning the whole run, plus the last
    `recent`.

    The rule: frame `o` (0-based, counted over the run) is an *anchor* when it is a multiple of the
    stride in force at `o`. The stride is `every` for the first `per_stride * every` frames and
    doubles each time the run's length doubles after that (frames `[per_stride * every * 2**(j-1),
    per_stride * every * 2**j)` have stride `every * 2**j`). Anchors are placed after their own
    step's text and never leave the prompt (appended only, so the prompt stays a prefix of the next
    one), and the gap between two anchors is at most `2 / per_stride` of the run so far: the frames
    the judge sees always span the whole run.

    Cost: after `n` frames the prompt holds `per_stride + per_stride / 2 * ceil(log2(n / (per_stride
    * every)))` anchors plus `recent` tail frames (defaults: 51 images at 500 frames, 108 at 6,000,
    124 at 12,000; at 10 Hz the widest gap between anchors is 25.6 s at 10 minutes). The `recent`
    newest frames that are not anchors go in the prompt's tail, where changes cost nothing for
    prefix reuse.
    """

    every: int = 8
    recent: int = 4
    per_stride: int = 32

    def __post_init__(self) -> None:
        if self.every < 1 or self.recent < 0 or self.per_stride < 2 or self.per_stride % 2:
            raise ValueError(
                "FrameBudget needs every >= 1, recent >= 0 and an even per_stride >= 2"
            )

    def stride(self, ordinal: int) -> int:
        """The anchor stride in force at frame `ordinal`."""
        return self.every << (ordinal // (self.per_stride * self.every)).bit_length()

    def is_anchor(self, ordinal: int) -> bool:
        """Whether frame `ordinal` (0-based) is an anchor: shown inline from its step on, for
        good."""
        return ordinal >= 0 and ordinal % self.stride(ordinal) == 0

    def anchors(self, total: int) -> list[int]:
        """The ordinals of the anchors among a run's first `total` frames, in order."""
        out: list[int] = []
        start, end, stride = 0, self.per_stride * self.every, self.every
        while start < total:
            out.extend(range(start, min(end, total), stride))
            start, end, stride = end, 2 * end, 2 * stride
        return out

    def select(self, total: int) -> tuple[list[int], list[int]]:
        """Given a run's frame count, the ordinals (0-based) of anchor frames and of recent tail
        frames."""
        anchors = self.anchors(total)
        recent = [i for i in range(max(0, total - self.recent), total) if not self.is_anchor(i)]
        return anchors, recent

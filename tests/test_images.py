"""Images: sniffing, downscaling, limits, corrupt data, no file access where refused."""

import io
from pathlib import Path

import pytest
from PIL import Image

from agent_monitor.images import Frame, ImageError, load_image, sniff_mime


def png(w: int = 64, h: int = 32, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (10, 200, 30)).save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("fmt", "mime"),
    [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("GIF", "image/gif"), ("WEBP", "image/webp")],
)
def test_sniff_by_magic_number(fmt: str, mime: str) -> None:
    data = png(fmt=fmt)
    assert sniff_mime(data) == mime
    f = load_image(data)
    assert f.mime == mime and (f.width, f.height) == (64, 32) and f.data == data


def test_downscale_keeps_aspect_and_type() -> None:
    f = load_image(png(400, 200, "JPEG"), max_side=100)
    assert (f.width, f.height) == (100, 50) and f.mime == "image/jpeg"
    assert Image.open(io.BytesIO(f.data)).size == (100, 50)
    small = load_image(png(40, 20), max_side=100)
    assert small.data == png(40, 20)  # untouched when already small


def test_pil_image_and_path(tmp_path: Path) -> None:
    img = Image.new("RGBA", (10, 20))
    f = load_image(img)
    assert f.mime == "image/png" and (f.width, f.height) == (10, 20)
    p = tmp_path / "x.png"
    p.write_bytes(png())
    g = load_image(p)
    assert g.digest == load_image(png()).digest
    assert g.data_url().startswith("data:image/png;base64,")
    assert isinstance(load_image(g), Frame)


def test_bad_input_gets_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="not PNG, JPEG, GIF or WebP"):
        load_image(b"hello")
    with pytest.raises(ImageError, match="cannot be decoded"):
        load_image(png()[:40])
    with pytest.raises(ImageError, match="over the limit"):
        load_image(png(), max_bytes=10)
    with pytest.raises(ImageError, match="pixels, over the limit"):
        load_image(png(100, 100), max_pixels=100)
    with pytest.raises(ImageError, match="cannot read image file"):
        load_image(tmp_path / "missing.png")
    with pytest.raises(ImageError, match="paths are not allowed"):
        load_image(str(tmp_path / "x.png"), allow_files=False)
    with pytest.raises(ImageError, match="unsupported image type"):
        load_image(123)  # type: ignore[arg-type]

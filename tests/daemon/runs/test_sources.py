"""No ambient authority: image paths and URLs in events are refused unless the operator allows
them, then bounded."""

from __future__ import annotations

import io
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from prometheus_client import CollectorRegistry

from agent_monitor.daemon import MemoryStore, Monitor, MonitorConfig
from agent_monitor.daemon.runs._images import fetch_images
from agent_monitor.daemon.stores import Stepped
from agent_monitor.testing import FakeJudge
from agent_monitor.wire import EventError, decode_event


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (6, 6), (0, 200, 0)).save(buf, format="PNG")
    return buf.getvalue()


def step(image: dict[str, Any]) -> str:
    return json.dumps({"index": 1, "text": "look", "images": [image]})


@contextmanager
def http_server(routes: dict[str, tuple[int, bytes, dict[str, str]]]) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            status, body, headers = routes.get(self.path, (404, b"no", {}))
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    "image", [{"path": "/etc/shadow"}, {"url": "http://169.254.169.254/latest"}]
)
def test_paths_and_urls_are_refused_by_default(image: dict[str, Any]) -> None:
    with pytest.raises(EventError) as e:
        decode_event("agents/r/step", step(image))
    assert e.value.reason == "bad_image" and "operator" in e.value.message


def test_allowed_directory_reads_files_under_it_only(tmp_path: Path) -> None:
    allowed, outside = tmp_path / "frames", tmp_path / "secret"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "f1.png").write_bytes(png())
    (outside / "s.png").write_bytes(png())
    (allowed / "link.png").symlink_to(outside / "s.png")
    (allowed / "notes.txt").write_text("not an image")
    (allowed / "big.png").write_bytes(png() + b"\0" * 5000)
    os.mkfifo(allowed / "fifo.png")
    dirs = (str(allowed),)

    run_id, ev = decode_event(
        "agents/r/step", step({"path": str(allowed / "f1.png")}), image_dirs=dirs
    )
    fetch_images(run_id, ev, image_dirs=dirs, max_bytes=1 << 20)
    assert ev.images[0].decoded() == png() and ev.images[0].mime == "image/png"  # type: ignore[union-attr]

    refused_on_decode = [str(outside / "s.png"), f"{allowed}/../secret/s.png", "relative/f1.png"]
    for path in refused_on_decode:
        with pytest.raises(EventError):
            decode_event("agents/r/step", step({"path": path}), image_dirs=dirs)
    for name, needle in [
        ("link.png", "outside"),
        ("notes.txt", "not PNG"),
        ("big.png", "over the limit"),
        ("fifo.png", "not a regular file"),
        ("missing.png", "No such file"),
    ]:
        run_id, ev = decode_event(
            "agents/r/step", step({"path": str(allowed / name)}), image_dirs=dirs
        )
        with pytest.raises(EventError) as e:
            fetch_images(run_id, ev, image_dirs=dirs, max_bytes=len(png()) + 100)
        assert e.value.reason == "bad_image" and needle in e.value.message, (name, e.value.message)


def test_allowed_host_is_fetched_without_following_redirects() -> None:
    image = png()
    routes = {
        "/cam/1.png": (200, image, {"Content-Type": "image/png"}),
        "/moved": (302, b"", {"Location": "http://169.254.169.254/"}),
        "/big": (200, image + b"\0" * 10_000, {}),
    }
    with http_server(routes) as base:
        hosts = ("127.0.0.1",)
        run_id, ev = decode_event(
            "agents/r/step", step({"url": f"{base}/cam/1.png"}), image_hosts=hosts
        )
        fetch_images(run_id, ev, image_dirs=(), max_bytes=1 << 20)
        assert ev.images[0].decoded() == image  # type: ignore[union-attr]
        for path, needle in [
            ("/moved", "HTTP 302"),
            ("/nope", "HTTP 404"),
            ("/big", "over the limit"),
        ]:
            run_id, ev = decode_event(
                "agents/r/step", step({"url": base + path}), image_hosts=hosts
            )
            with pytest.raises(EventError) as e:
                fetch_images(run_id, ev, image_dirs=(), max_bytes=len(image) + 100)
            assert needle in e.value.message
        for url in [
            "http://localhost/x.png",
            "ftp://127.0.0.1/x.png",
            "http://u:p@127.0.0.1/x.png",
        ]:
            with pytest.raises(EventError):
                decode_event("agents/r/step", step({"url": url}), image_hosts=hosts)


async def test_monitor_reads_allowed_frames_off_the_loop_and_journals_their_bytes(
    tmp_path: Path,
) -> None:
    (tmp_path / "f.png").write_bytes(png())
    store = MemoryStore()
    reg = CollectorRegistry()
    config = MonitorConfig(image_dirs=(str(tmp_path),))
    async with Monitor(config, judge=FakeJudge(), store=store, registry=reg) as mon:
        await mon.handle("agents/r/start", b'{"task": "t"}')
        await mon.handle("agents/r/step", step({"path": str(tmp_path / "f.png")}).encode())
        await mon.handle(
            "agents/r/step",
            json.dumps({"index": 2, "text": "x", "images": [{"path": "/etc/passwd"}]}).encode(),
        )
        await mon.drain()
        tracker = mon.tracker("r")
        assert tracker is not None
        steps = tracker.steps
        assert len(steps) == 1 and len(steps[0].frames) == 1
        assert (
            reg.get_sample_value("agent_monitor_invalid_events_total", {"reason": "bad_image"}) == 1
        )
    (stepped,) = [r for r in (await store.replay()).records if isinstance(r, Stepped)]
    assert stepped.step.images[0].decoded() == png()

"""Robot metadata as untrusted input (issue 44, finding 6): `agent-monitor replay` of hostile
LeRobot datasets.

Each dataset is the toy one with one thing made hostile: a path template that would build a gigabyte
path or evaluate attributes, a path outside the dataset, a FIFO in place of a video, a deeply nested
info.json, a decompression-bomb PNG frame, a bit-flipped mp4. Each ends `agent-monitor replay`
(against a real Mosquitto) with exit 2 and a message naming the file, quickly, never a traceback or
a hang.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import struct
import time
import zlib
from pathlib import Path

import pytest

from agent_monitor.cli import main
from tests.brokers import Mosquitto
from tests.fixtures.robot_data import make_lerobot

pytestmark = pytest.mark.timeout(120)


def _info(root: Path, **changes: object) -> Path:
    path = root / "meta" / "info.json"
    info = json.loads(path.read_text())
    info.update(changes)
    path.write_text(json.dumps(info))
    return path


async def _replay(
    dataset: Path, broker: Mosquitto, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, float]:
    began = time.monotonic()
    rc = await asyncio.to_thread(
        main, ["replay", str(dataset), "--broker", broker.url, "--speed", "0"]
    )
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return rc, err, time.monotonic() - began


@pytest.mark.parametrize(
    ("template", "said"),
    [
        ("data/{chunk_index:0999999999d}.parquet", "formats chunk_index as '0999999999d'"),
        ("data/{chunk_index.__class__.__mro__}.parquet", "names {chunk_index.__class__.__mro__}"),
        ("data/{chunk_index[0]}.parquet", "names {chunk_index[0]}"),
        ("data/{chunk_index!r}.parquet", "no attributes, indexes or conversions"),
        ("../../../../../../etc/passwd", "outside the dataset"),
    ],
    ids=["huge-width", "attribute", "index", "conversion", "escape"],
)
async def test_a_hostile_path_template_is_exit_2_naming_the_file(
    broker: Mosquitto, tmp_path: Path, capsys: pytest.CaptureFixture[str], template: str, said: str
) -> None:
    dataset = make_lerobot(tmp_path / "toy")
    _info(dataset, data_path=template)
    rc, err, took = await _replay(dataset, broker, capsys)
    assert rc == 2 and said in err, err
    assert "info.json" in err or "passwd" in err
    assert took < 30  # before: 51 s and 8.7 GB building a gigabyte path


async def test_a_fifo_in_place_of_a_video_is_exit_2_not_a_hang(
    broker: Mosquitto, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = make_lerobot(tmp_path / "toy")
    video = dataset / "videos" / "observation.images.front" / "chunk-000" / "file-000.mp4"
    video.unlink()
    os.mkfifo(video)
    rc, err, _ = await _replay(dataset, broker, capsys)
    assert rc == 2 and "file-000.mp4: not a regular file" in err, err


async def test_a_deeply_nested_info_json_is_exit_2_naming_it(
    broker: Mosquitto, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = make_lerobot(tmp_path / "toy")
    (dataset / "meta" / "info.json").write_text("[" * 200_000 + "]" * 200_000)
    rc, err, _ = await _replay(dataset, broker, capsys)
    assert rc == 2 and "info.json: nests too deeply" in err, err


def _png(width: int, height: int) -> bytes:
    """A PNG whose header says `width` x `height` gray pixels (the data is a stub: the size alone
    is the bomb)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
    )


async def test_a_decompression_bomb_frame_is_exit_2_naming_the_file(
    broker: Mosquitto, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    dataset = make_lerobot(tmp_path / "toy")
    info = json.loads((dataset / "meta" / "info.json").read_text())
    features = {k: v for k, v in info["features"].items() if v.get("dtype") != "video"}
    features["observation.images.top"] = {
        "dtype": "image",
        "shape": [30000, 30000, 1],
        "names": None,
    }
    _info(dataset, features=features)
    data = dataset / "data" / "chunk-000" / "file-000.parquet"
    table = pq.read_table(data)
    bomb = {"bytes": _png(30_000, 30_000), "path": None}
    column = pa.array(
        [bomb] * table.num_rows, type=pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    )
    pq.write_table(table.append_column("observation.images.top", column), data)
    rc, err, _ = await _replay(dataset, broker, capsys)
    assert rc == 2 and "file-000.parquet: image column 'observation.images.top'" in err, err
    assert "too large" in err


async def test_a_bit_flipped_video_is_exit_2_naming_the_file(
    broker: Mosquitto, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = make_lerobot(tmp_path / "toy")
    video = dataset / "videos" / "observation.images.front" / "chunk-000" / "file-000.mp4"
    data = bytearray(video.read_bytes())
    rnd = random.Random(31)  # on main this corruption raised a bare UnicodeDecodeError (exit 1)
    for _ in range(20):
        i = rnd.randrange(len(data))
        data[i] ^= 1 << rnd.randrange(8)
    video.write_bytes(bytes(data))
    rc, err, _ = await _replay(dataset, broker, capsys)
    assert rc == 2 and "observation.images.front/chunk-000/file-000.mp4" in err, err

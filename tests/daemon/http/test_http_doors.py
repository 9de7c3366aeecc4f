"""The metrics port's door (the reward API's too) under hostile clients: deep JSON, trickling heads,
one greedy peer.

The real server (`HttpServer` with the reward endpoints mounted, as `serve --reward-api` builds it)
and real clients: aiohttp for requests, raw sockets for clients that trickle.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from agent_monitor.daemon import HttpServer, RewardApiSettings
from agent_monitor.daemon.http import HttpSettings
from agent_monitor.testing import FakeJudge
from tests.daemon.sources.reward.test_reward_api import daemon, sample

pytestmark = pytest.mark.timeout(120)


async def test_a_deeply_nested_body_on_v1_score_is_400_not_500() -> None:
    async with daemon(FakeJudge(lambda p: "K"), RewardApiSettings(reward_api=True)) as (
        _,
        _,
        url,
        registry,
    ):
        deep = b'{"task": ' + b"[" * 200_000 + b"]" * 200_000 + b', "steps": ["a"]}'
        async with aiohttp.ClientSession() as s:
            async with s.post(
                url + "/v1/score", data=deep, headers={"content-type": "application/json"}
            ) as r:
                assert r.status == 400, await r.text()
                assert "nests too deeply" in (await r.json())["error"]
            # The server goes on answering.
            async with s.post(url + "/v1/score", json={"task": "t", "steps": ["did it"]}) as r:
                assert r.status == 200
        assert (
            sample(
                registry,
                "agent_monitor_reward_refused_total",
                endpoint="/v1/score",
                reason="bad_json",
            )
            == 1
        )


async def test_trickling_heads_cannot_keep_metrics_from_being_served() -> None:
    registry = CollectorRegistry()
    async with HttpServer(
        registry, port=0, settings=HttpSettings(max_connections=8, head_timeout_s=30)
    ) as server:
        held = []
        for _ in range(20):  # more than the bound, each sending a head that never ends
            r, w = await asyncio.open_connection("127.0.0.1", server.port)
            w.write(b"GET /metrics HTTP/1.1\r\nhost: x\r\n")
            await w.drain()
            held.append((r, w))
        await asyncio.sleep(0.2)
        assert server.gate.connections <= 8 and server.gate.shed >= 12
        async with aiohttp.ClientSession() as s:
            for _ in range(3):
                async with s.get(f"{server.url}metrics") as resp:
                    assert resp.status == 200
        assert server.statistics().connections_refused == 0
        for _, w in held:
            with contextlib.suppress(Exception):
                w.close()


async def test_one_peer_past_its_bound_sheds_its_own_slowest_head() -> None:
    async with HttpServer(
        CollectorRegistry(),
        port=0,
        settings=HttpSettings(max_connections=100, max_connections_per_peer=4),
    ) as server:
        held = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(6)]
        await asyncio.sleep(0.2)
        assert server.gate.connections == 4 and server.gate.shed == 2
        for r, _ in held[:2]:  # the two oldest were closed
            assert await asyncio.wait_for(r.read(), 5) == b""
        for _, w in held:
            w.close()

"""The proxy's WebSocket to the node's gateway hands over whole messages, text as text and binary as
binary, however the upstream frames them, and answers the upstream's pings itself."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest
from websockets.asyncio.server import serve

from portal.upstream import UpstreamError, open_websocket


def _run_in_thread(coroutine):
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


async def _gateway(websocket) -> None:
    """Answers each message it gets with: the same back, a fragmented text, a binary, after a ping."""
    async for message in websocket:
        await websocket.send(message)
        await websocket.send(["frag", "mented ", "文字"])  # one message in three frames
        pong = await websocket.ping()
        await asyncio.wait_for(pong, 5)  # answered by the proxy's side, not by the test
        await websocket.send(b"\x00\xff" * 70_000)


def test_messages_arrive_whole_and_of_their_kind():
    async def run():
        async with serve(_gateway, "127.0.0.1", 0, process_request=_require_authorization) as server:
            port = server.sockets[0].getsockname()[1]
            websocket = await open_websocket(
                host="127.0.0.1",
                port=port,
                target="/jupyter/s/api/kernels/k/channels?session_id=1",
                authorization="Bearer node",
                origin=f"http://127.0.0.1:{port}",
                subprotocols=[],
            )
            await websocket.send('{"msg": "héllo"}')
            received = [await websocket.recv() for _ in range(3)]
            await websocket.send(b"\x01\x02")
            received += [await websocket.recv()]
            websocket.close()
            return received

    echoed, fragmented, binary, echoed_binary = _run_in_thread(run())
    assert echoed == '{"msg": "héllo"}'
    assert fragmented == "fragmented 文字"
    assert binary == b"\x00\xff" * 70_000
    assert echoed_binary == b"\x01\x02"


def test_a_refused_upgrade_is_an_upstream_error():
    async def run():
        async with serve(_gateway, "127.0.0.1", 0, process_request=_require_authorization) as server:
            port = server.sockets[0].getsockname()[1]
            await open_websocket(
                host="127.0.0.1",
                port=port,
                target="/jupyter/s/api/kernels/k/channels",
                authorization="Bearer wrong",
                origin=f"http://127.0.0.1:{port}",
                subprotocols=[],
            )

    with pytest.raises(UpstreamError):
        _run_in_thread(run())


def _require_authorization(connection, request):
    if request.headers.get("Authorization") != "Bearer node":
        return connection.respond(401, "no\n")
    return None

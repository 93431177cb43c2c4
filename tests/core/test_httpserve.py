"""Serving an aiohttp application: the bound URL while it listens, and a typed error where it cannot."""

import asyncio
import json
import socket

import aiohttp
import pytest
from aiohttp import web

from pipecast.core.httpserve import BodyTimeoutError, ListenError, listening, read_body, read_capped


def hello_app() -> web.Application:
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello")

    app = web.Application()
    app.add_routes([web.get("/", hello)])
    return app


async def test_listening_yields_the_bound_url_and_stops_listening_after():
    async with listening(hello_app(), "127.0.0.1", 0) as url:
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            assert await response.text() == "hello"
    port = int(url.rpartition(":")[2])
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0


async def test_a_port_in_use_is_a_listen_error_naming_the_address():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ListenError) as caught:
            async with listening(hello_app(), "127.0.0.1", port):
                pass
    assert str(caught.value) == f"cannot listen on 127.0.0.1:{port}: address already in use"


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
async def test_an_ipv6_host_is_bracketed_in_the_bound_url():
    """Finding 8: the URL was http://::1:PORT, which no URL parser reads as host ::1."""
    async with listening(hello_app(), "::1", 0) as url:
        assert url.startswith("http://[::1]:")
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            assert await response.text() == "hello"


async def answer_in_pieces(request: web.Request, body: bytes, content_type: str = "application/json",
                           piece_bytes: int = 1448, gap_s: float = 0.01) -> web.StreamResponse:
    """``body`` answered as a network path between hosts delivers it: in TCP-segment-sized pieces, a moment
    apart (loopback hands a whole write over at once, which hid answers read with one ``read(n)``)."""
    response = web.StreamResponse(headers={"Content-Type": content_type})
    response.content_length = len(body)
    await response.prepare(request)
    for start in range(0, len(body), piece_bytes):
        await response.write(body[start:start + piece_bytes])
        await asyncio.sleep(gap_s)
    await response.write_eof()
    return response


async def stalled_body_answer(url: str, path: str, declared: int = 1000, sent: int = 500) -> tuple[int, dict]:
    """POST to ``url`` + ``path`` a body that says ``declared`` bytes and stalls after ``sent``: the status and
    JSON answer the server gives it within 10 s, which must close the connection (the rest is never read)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {declared}\r\n\r\n".encode() + b" " * sent)
        async with asyncio.timeout(10):
            head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
            length = int(head.partition("content-length: ")[2].partition("\r\n")[0])
            body = await reader.readexactly(length)
    finally:
        writer.close()
        await writer.wait_closed()
    assert "\r\nconnection: close\r\n" in head, head
    return int(head.split()[1]), json.loads(body)


async def test_a_body_not_in_by_the_deadline_is_a_body_timeout_error_with_what_arrived():
    caught: list[BodyTimeoutError] = []

    async def handler(request: web.Request) -> web.Response:
        try:
            await read_body(request, 1 << 20, timeout_s=0.2)
        except BodyTimeoutError as exc:
            caught.append(exc)
            response = web.json_response({"error": str(exc)}, status=408)
            response.force_close()
            return response
        return web.json_response({})

    app = web.Application()
    app.add_routes([web.post("/", handler)])
    async with listening(app, "127.0.0.1", 0) as url:
        status, answer = await stalled_body_answer(url, "/")
    assert status == 408
    assert answer["error"] == ("the request body did not arrive within this server's deadline of 0.2 s "
                               "(500 of 1000 bytes received)")
    assert (caught[0].timeout_s, caught[0].received, caught[0].declared) == (0.2, 500, 1000)


async def test_an_answer_in_many_pieces_is_read_whole_and_one_over_the_cap_is_cut_past_it():
    body = bytes(range(256)) * 40  # 10 KiB: 8 pieces

    async def handler(request: web.Request) -> web.StreamResponse:
        return await answer_in_pieces(request, body)

    app = web.Application()
    app.add_routes([web.get("/", handler)])
    async with listening(app, "127.0.0.1", 0) as url, aiohttp.ClientSession() as session:
        async with session.get(url) as response:
            assert await read_capped(response.content, len(body)) == body
        async with session.get(url) as response:
            assert await read_capped(response.content, 3000) == body[:3001]  # the caller refuses it


async def test_a_drain_of_0_cuts_requests_in_flight_at_once_not_waits_for_them():
    """Found in review: aiohttp takes a shutdown timeout of 0 for none, so --drain-timeout 0 waited on a request
    in flight (one waiting for a block that never came) until SIGKILL."""
    import os
    import signal

    from pipecast.core.httpserve import serve_until_signalled

    started = asyncio.Event()

    async def forever(request: web.Request) -> web.Response:
        started.set()
        await asyncio.sleep(3600)
        return web.Response()

    app = web.Application()
    app.add_routes([web.get("/", forever)])
    urls: list[str] = []
    server = asyncio.create_task(serve_until_signalled(app, "127.0.0.1", 0, 0.0, urls.append))
    while not urls:
        await asyncio.sleep(0.01)
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(session.get(urls[0]))
        await asyncio.wait_for(started.wait(), 5)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(server, 10)  # before: for good
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)

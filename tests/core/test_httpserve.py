"""Serving an aiohttp application: the bound URL while it listens, and a typed error where it cannot."""

import socket

import aiohttp
import pytest
from aiohttp import web

from pipecast.core.httpserve import ListenError, listening


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

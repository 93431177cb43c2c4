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

"""The router keeps clients' credentials from the workers unless told otherwise (issue #12, finding 2).

On the old code the router sent the client's ``Authorization`` header to whatever serve URL a worker had
registered, so any worker collected every client's credentials.
"""

import aiohttp
import pytest
from aiohttp import web

from tests.router.test_app import BODY, CLIENT_TIMEOUT, router, serving

pytestmark = pytest.mark.timeout(30)


async def forwarded_authorization(**config) -> list[str | None]:
    """The Authorization header a worker saw for a request that carried one, through a router with ``config``."""
    seen: list[str | None] = []

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ready", "blocks_present": 1, "blocks_total": 1, "queue_depth": 0,
                                  "running": 0, "max_queue": 8})

    async def complete(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"choices": [{"text": "t"}]})

    app = web.Application()
    app.add_routes([web.get("/health", health), web.post("/v1/completions", complete)])
    async with serving(app) as worker, router([worker], **config) as (url, _), \
            aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as client:
        async with client.post(f"{url}/v1/completions", json=BODY,
                               headers={"Authorization": "Bearer client-secret"}) as response:
            assert response.status == 200
    return seen


async def test_the_clients_authorization_header_does_not_reach_the_worker():
    """Finding 2: by default the worker never sees the client's credentials."""
    assert await forwarded_authorization() == [None]


async def test_forward_auth_passes_the_clients_authorization_header_on():
    assert await forwarded_authorization(forward_auth=True) == ["Bearer client-secret"]

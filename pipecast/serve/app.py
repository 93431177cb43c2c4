"""The serving worker's HTTP server (aiohttp): an OpenAI-compatible front for one model that serves while
its weights arrive.

Endpoints:

- ``POST /v1/completions`` and ``POST /v1/chat/completions`` (the messages rendered with the package's
  chat template): JSON, or Server-Sent Events with ``"stream": true`` (``data: {...}`` per generated
  token, ``data: [DONE]`` at the end). 400 names the bad field; 413 a body over
  ``max_body_bytes`` (refused from its Content-Length, unread); 408 a body not whole within
  ``body_timeout_s`` of the start of its read (:data:`BODY_TIMEOUT_S`); 404 an unknown model; 429 with
  ``Retry-After`` when the queue is full; 503 while the worker cannot serve (model failed, shutting down).
  A request that arrives before the model is there waits for it. A client that goes away (even
  mid-answer), or reads nothing of its stream for ``body_timeout_s``, cancels its request in the engine.
- With the cluster's serving key (:mod:`pipecast.serve.worker`, "Credentials"), the completion and stage
  endpoints answer 401 to a request without it in :data:`~pipecast.core.credentials.SERVING_KEY_HEADER`
  (before its body is read), and 503 while the worker has not learned the key yet (after a wait);
  ``/health``, ``/v1/models`` and ``/metrics`` take none.
- ``GET /health``: ``{"status": "loading"|"partial"|"ready", "blocks_present", "blocks_total",
  "queue_depth", "running", "max_queue", ...}`` with 200, or ``failed``/``draining`` with 503.
- ``GET /v1/models`` and ``GET /metrics`` (Prometheus).

:func:`run_worker` serves until SIGTERM, SIGINT or SIGHUP, then drains: still listening, it refuses new requests
(503) and serves those that came before (running, or their body still arriving) and the pipelined sessions it holds
for other heads, for up to ``drain_timeout_s``; then it stops listening and closes the engine.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from pipecast.core.credentials import SERVING_KEY_HEADER
from pipecast.core.httpserve import (
    RUNNER_OPTIONS,
    BodyTimeoutError,
    BodyTooLargeError,
    decode_json_body,
    read_body,
    serve_until_signalled,
)
from pipecast.core.strictjson import JSONInputError, loads
from pipecast.engine.errors import EngineError, InvalidRequestError
from pipecast.engine.stage import StageCapacityError, StageSessionError
from pipecast.serve.errors import (
    RequestFieldError,
    RequestTooLargeError,
    ServeError,
    StageBusyError,
    StageFailedError,
    WorkerBusyError,
)
from pipecast.serve.openai_api import (
    SSE_DONE,
    CompletionRequest,
    chat_chunk_body,
    chat_completion_body,
    chunk_body,
    completion_body,
    error_body,
    json_error,
    models_body,
    parse_chat_request,
    parse_completion_request,
    sse,
    usage_chunk_body,
)
from pipecast.serve.pipeline import (
    PIPELINE_HEADER,
    STAGE_CLOSE_PATH,
    STAGE_HEADER_BYTES,
    STAGE_PATH,
    Hop,
    PipelineProtocolError,
    StageCall,
    decode_frame,
    decode_frame_header,
    encode_frame,
    parse_next,
    parse_route,
    parse_session,
    stage_body_limit,
    tensor_bytes,
)
from pipecast.serve.worker import Generation, ServingWorker

log = logging.getLogger(__name__)

WORKER = web.AppKey("worker", ServingWorker)
MAX_BODY = web.AppKey("max_body_bytes", int)
BODY_TIMEOUT = web.AppKey("body_timeout_s", float)
#: Largest request body accepted. A prompt of a million token ids is ~8 MB of JSON; decoding that many
#: numbers holds the GIL ~0.15 s per 8 MB, so the bound also bounds how long /health can wait. A stage
#: call may be larger: a prompt's hidden states, up to what the model's positions need (``stage_body_limit``).
MAX_BODY_BYTES = 16 << 20
#: Longest a client may take to send a completion request's (or a session close's) whole body, as the router's
#: default ``upstream_timeout_s``: a client stalled mid-body would else hold its handler and the bytes so far.
BODY_TIMEOUT_S = 300.0
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
#: How long a request waits for the worker to learn the cluster's serving key from its agent (s).
SERVING_KEY_WAIT_S = 30.0


class RequestBodyTimeoutError(ServeError):
    """A request body not whole within the worker's deadline (the client's fault), refused unread."""

    status = 408
    kind = "invalid_request_error"
    code = "request_timeout"


def _outcome(error: ServeError) -> str:
    if isinstance(error, (WorkerBusyError, StageBusyError)):
        return "rejected"
    return "invalid" if error.status < 500 else "failed"


def error_response(error: ServeError) -> web.Response:
    """The JSON error answer of ``error`` (with Retry-After on a 429)."""
    headers = {"Retry-After": str(error.retry_after_s)} if isinstance(error, (WorkerBusyError, StageBusyError)) \
        else None
    return web.json_response(error_body(error), status=error.status, headers=headers)


#: Set on each POST: whether it came before the worker began to drain (:meth:`ServingWorker.request`).
ADMITTED = web.RequestKey("admitted", bool)


@web.middleware
async def count_requests(request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Every POST is counted while its handler runs and its answer is written, if it came before the worker began to
    drain: the drain waits for those to end, and serves them (a stage call among them whose session opens after, a
    completion whose body was still arriving)."""
    if request.method != "POST":
        return await handler(request)
    with request.app[WORKER].request() as admitted:
        request[ADMITTED] = admitted
        response = await handler(request)
        # A whole answer is written here, counted (aiohttp would write it after): the cut after a drain follows it.
        await response.prepare(request)
        await response.write_eof()
        return response


@web.middleware
async def check_serving_key(request: web.Request,
                            handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Completion requests and stage calls present the cluster's serving key, if the worker has one."""
    stage = request.path in (STAGE_PATH, STAGE_CLOSE_PATH)
    if request.method != "POST" or not (stage or request.path in COMPLETION_PATHS):
        return await handler(request)
    worker = request.app[WORKER]
    try:
        await worker.check_serving_key(request.headers.get(SERVING_KEY_HEADER), SERVING_KEY_WAIT_S)
    except ServeError as exc:
        if not stage:
            worker.metrics.requests.labels(_outcome(exc)).inc()
        response = _stage_error(str(exc), exc.status) if stage else error_response(exc)
        response.force_close()  # the body is never read
        return response
    return await handler(request)


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``."""
    return await _generate(request, parse_completion_request)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    return await _generate(request, parse_chat_request)


async def _generate(request: web.Request, parse: Callable[[object], CompletionRequest]) -> web.StreamResponse:
    worker = request.app[WORKER]
    outcome = "cancelled"  # unless an answer ends: the handler was cancelled because the client went away
    try:
        try:
            route = _route(request)
            body = parse(await _decode(request))
            generation = await worker.generate(body, route, admitted=request[ADMITTED])
        except ServeError as exc:
            outcome = _outcome(exc)
            response = error_response(exc)
            if isinstance(exc, RequestTooLargeError | RequestBodyTimeoutError):
                response.force_close()  # the rest of the body is never read
            return response
        async with generation:
            response, outcome = await (_stream(request, body, generation) if body.stream
                                       else _whole(body, generation))
        return response
    finally:
        worker.metrics.requests.labels(outcome).inc()


def _route(request: web.Request) -> tuple[Hop, ...] | None:
    """The cross-node pipeline this request runs through (its :data:`PIPELINE_HEADER`), if any."""
    value = request.headers.get(PIPELINE_HEADER)
    if value is None:
        return None
    try:
        return parse_route(loads(value))
    except (JSONInputError, PipelineProtocolError) as exc:
        raise RequestFieldError(PIPELINE_HEADER, str(exc)) from None


async def stage_call(request: web.Request) -> web.Response:
    """``POST /v1/stage``: run this worker's layers of a pipelined request and call the next stage
    (:mod:`pipecast.serve.pipeline`); the answer is the last stage's token, or an error naming the stage
    that failed (``node``: null for this one)."""
    worker = request.app[WORKER]
    received = time.monotonic()
    session = None
    try:
        header, hidden = decode_frame(await _read_stage_frame(request, worker, received))
        call = StageCall.from_header(header)
        session, deadline = call.session, received + call.deadline_s
        if worker.called_back(session, url := str(request.url.origin())):  # its own session: would open twice
            return _stage_error(f"the route names this worker twice (as {url})", 400)
        runner = await worker.wait_stage_runner(deadline - time.monotonic(), session, request[ADMITTED])
        if call.package and call.package != runner.package_id:
            return _stage_error(f"this worker serves package {runner.package_id[:12]}, the call is for "
                                f"{call.package[:12]} (a route listed before a rollout)", 409)
        last = not call.following
        if last != (call.layers.stop == runner.model.num_layers):  # a route's stages must end at the model's end
            raise PipelineProtocolError(
                f"layers {call.layers.start}-{call.layers.stop - 1} of the model's {runner.model.num_layers} with "
                f"{len(call.following)} stage(s) after them: only the stage whose layers end the model's is the last")
        norm_only = call.norm_only and last
        out = await worker.stage_queue.call(runner.run, session, call.layers, call.position, hidden=hidden,
                                            params=call.params, norm_only=norm_only, deadline=deadline,
                                            wait=runner.waiter(runner.parts(call.layers, norm_only=norm_only)))
        if last:
            answer = out.hidden if call.norm_only else out.token
        else:
            answer = await worker.stage_client.forward(call.following, session, call.position, out.hidden,
                                                       params=call.params, norm_only=call.norm_only,
                                                       deadline=deadline, package=call.package)
        frame = encode_frame({}, answer) if call.norm_only else encode_frame({"token": answer})
        return web.Response(body=frame, content_type="application/octet-stream")
    except (StageFailedError, StageBusyError) as exc:  # a stage after this one (failed: 502; no room: 429)
        worker.forget_stage_session(session)
        return web.json_response({"error": {"message": str(exc), "problem": exc.problem, "node": exc.node}},
                                 status=exc.status if isinstance(exc, StageBusyError) else 502)
    except (BodyTooLargeError, BodyTimeoutError) as exc:
        response = _stage_error(str(exc), 413 if isinstance(exc, BodyTooLargeError) else 408)
        response.force_close()  # the rest of the body is never read
        return response
    except (PipelineProtocolError, InvalidRequestError, StageSessionError) as exc:
        return _unread_closes(request, _stage_error(str(exc), 400))
    except StageCapacityError as exc:  # load, not a failure: the caller answers its own caller 429 (StageBusyError)
        return _stage_error(str(exc), 429)
    except TimeoutError as exc:
        return _unread_closes(request, _stage_error(str(exc), 504))
    except ServeError as exc:
        return _unread_closes(request, _stage_error(str(exc), exc.status))
    except EngineError as exc:  # the model failed to load or was unloaded under the call: not the caller's fault
        worker.forget_stage_session(session)
        return _stage_error(str(exc), 503)
    except Exception as exc:  # torch's own errors (out of memory), or a bug: a JSON answer its caller names
        log.exception("stage call failed")
        worker.forget_stage_session(session)
        return _stage_error(f"the engine failed: {exc}", 500)


async def _read_stage_frame(request: web.Request, worker: ServingWorker, received: float) -> bytes:
    """A stage call's body. One within the worker's body limit is read as any body. A larger one (a long
    prompt's hidden states: Llama-3-8B's 2,048 float32 positions are 32 MiB) may be as large as the model's
    positions need (:func:`~pipecast.serve.pipeline.stage_body_limit`), which is known once the model is:
    the frame's header, at its front, is read first, and the call's deadline bounds that wait. The header and
    the rest of the body each have the body deadline (:class:`BodyTimeoutError`), as any body has."""
    floor, timeout_s = request.app[MAX_BODY], request.app[BODY_TIMEOUT]
    declared = request.content_length
    if declared is not None and declared <= floor:
        return await read_body(request, floor, timeout_s)
    prefix = bytearray()

    async def take(count: int) -> None:
        """``count`` more bytes of the body onto ``prefix`` (so that a timeout can say how many came)."""
        end = len(prefix) + count
        while len(prefix) < end:
            chunk = await request.content.read(end - len(prefix))
            if not chunk:
                raise PipelineProtocolError(f"a frame of {len(prefix)} bytes is shorter than its header says")
            prefix.extend(chunk)

    try:
        async with asyncio.timeout(timeout_s):
            await take(4)
            size = int.from_bytes(prefix, "big")
            if size > STAGE_HEADER_BYTES:
                raise PipelineProtocolError(f"a frame's header of {size} bytes is over a stage call's "
                                            f"{STAGE_HEADER_BYTES}")
            await take(size)
    except TimeoutError:
        raise BodyTimeoutError(timeout_s, len(prefix), declared) from None
    header = decode_frame_header(bytes(prefix[4:]))
    call = StageCall.from_header(header)
    # The frame's own size, from its tensor's dtype and shape: no more is read, whatever the model allows.
    size = len(prefix) + (tensor_bytes(header["tensor"]) if "tensor" in header else 0)
    runner = await worker.wait_stage_runner(received + call.deadline_s - time.monotonic(), call.session,
                                            request[ADMITTED])
    limit = stage_body_limit(runner.model.config, floor)
    if size > limit or (declared is not None and declared > limit):
        raise BodyTooLargeError(limit, max(size, declared or 0))
    if declared is not None and declared != size:
        raise PipelineProtocolError(f"a frame of {size} bytes by its header came in a body of {declared}")
    body = bytearray(prefix)
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.content.iter_any():
                body += chunk
                if len(body) > size:
                    raise PipelineProtocolError(f"more than the {size} bytes its header says follow a frame's "
                                                "header")
    except TimeoutError:
        raise BodyTimeoutError(timeout_s, len(body), declared or size) from None
    return bytes(body)


def _unread_closes(request: web.Request, response: web.Response) -> web.Response:
    """``response``, closing the connection if the call was answered before its body was read (a large
    frame's header was bad, or the model it waited for did not come): the rest is never read."""
    if not request.content.is_eof():
        response.force_close()
    return response


def _stage_error(message: str, status: int) -> web.Response:
    return web.json_response({"error": {"message": message, "node": None}}, status=status)


async def stage_close(request: web.Request) -> web.Response:
    """``POST /v1/stage/close``: forget a pipelined session here and at the stages after this one."""
    worker = request.app[WORKER]
    try:
        body = await _decode(request)
        session = parse_session(body.get("session") if isinstance(body, dict) else None)  # it is echoed: bounded
        hops = parse_next(body.get("next"), first=None)
    except (RequestFieldError, PipelineProtocolError) as exc:
        return _stage_error(str(exc), 400)
    except (RequestTooLargeError, RequestBodyTimeoutError) as exc:
        response = _stage_error(str(exc), exc.status)
        response.force_close()  # the rest of the body is never read
        return response
    worker.forget_stage_session(session)
    worker.stage_client.pass_close_on(hops, session)
    return web.json_response({"closed": session})


async def _decode(request: web.Request) -> object:
    """The request's JSON body, read within the size limit and the body deadline and decoded strictly (large ones
    off the loop)."""
    try:
        raw = await read_body(request, request.app[MAX_BODY], request.app[BODY_TIMEOUT])
    except BodyTooLargeError as exc:
        raise RequestTooLargeError(str(exc)) from None
    except BodyTimeoutError as exc:
        raise RequestBodyTimeoutError(str(exc)) from None
    try:
        return await decode_json_body(raw)
    except JSONInputError as exc:
        raise json_error(exc) from None


async def _whole(body: CompletionRequest, generation: Generation) -> tuple[web.Response, str]:
    texts, token_ids, reason = [], [], None
    try:
        async for piece in generation:
            texts.append(piece.text)
            token_ids += piece.token_ids
            reason = piece.finish_reason
    except ServeError as exc:
        return error_response(exc), _outcome(exc)
    answer = chat_completion_body if body.chat else completion_body
    return web.json_response(answer(
        generation.request_id, generation.created, generation.model, "".join(texts), reason,
        token_ids if body.return_token_ids else None, generation.prompt_tokens, generation.completion_tokens)), "ok"


class _ClientStalled(Exception):
    """A streaming client stopped reading: a write did not complete within the deadline."""


async def _stream(request: web.Request, body: CompletionRequest,
                  generation: Generation) -> tuple[web.StreamResponse, str]:
    g = generation
    pieces = aiter(g)
    try:  # the headers wait for the first token: a failure before it is an answer's status (a 503 the router
        ahead = [await anext(pieces)]  # retries on another worker), not a 200 whose one event is the error
    except StopAsyncIteration:
        ahead = []
    except ServeError as exc:
        log.warning("request %s failed before its first token: %s", g.request_id, exc)
        return error_response(exc), _outcome(exc)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    deadline_s = request.app[BODY_TIMEOUT]

    async def send(data: bytes) -> None:
        # A client that stays connected but stops reading would else hold the request's handler (and a drain
        # waiting for it) for good once the socket's buffers fill.
        try:
            async with asyncio.timeout(deadline_s):
                await response.write(data)
        except TimeoutError:
            raise _ClientStalled() from None

    try:
        try:
            first = True
            async for piece in _after(ahead, pieces):
                ids = list(piece.token_ids) if body.return_token_ids else None
                chunk = (chat_chunk_body(g.request_id, g.created, g.model, piece.text, piece.finish_reason, ids,
                                         first=first) if body.chat else
                         chunk_body(g.request_id, g.created, g.model, piece.text, piece.finish_reason, ids))
                await send(sse(chunk))
                first = False
            if body.include_usage:
                await send(sse(usage_chunk_body(g.request_id, g.created, g.model, g.prompt_tokens,
                                                g.completion_tokens, chat=body.chat)))
            await send(SSE_DONE)
            outcome = "ok"
        except ServeError as exc:  # the headers are gone: the error is the stream's last event
            log.warning("request %s failed mid-stream: %s", g.request_id, exc)
            await send(sse(error_body(exc)))
            outcome = "failed"
        async with asyncio.timeout(deadline_s):
            await response.write_eof()
    except ConnectionResetError:  # the client went away mid-answer; closing the generation cancels it
        return response, "cancelled"
    except (_ClientStalled, TimeoutError):
        log.info("request %s: the client read nothing of its stream for %g s; cancelled", g.request_id, deadline_s)
        if request.transport is not None:  # so that aiohttp's own end of the response does not wait on it too
            request.transport.abort()
        return response, "cancelled"
    return response, outcome


async def _after(ahead: list, rest: AsyncIterator) -> AsyncIterator:
    """The items of ``ahead``, then those of ``rest``."""
    for item in ahead:
        yield item
    async for item in rest:
        yield item


async def health(request: web.Request) -> web.Response:
    state = request.app[WORKER].health()
    return web.json_response(state.to_json(), status=state.http_status)


async def models(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    served = [(worker.model_name, worker.package_id)] if worker.model_name else []
    return web.json_response(models_body(served, int(time.time())))


async def metrics(request: web.Request) -> web.Response:
    payload, content_type = request.app[WORKER].metrics.render()
    return web.Response(body=payload, headers={"Content-Type": content_type})


def build_app(worker: ServingWorker, max_body_bytes: int = MAX_BODY_BYTES,
              body_timeout_s: float = BODY_TIMEOUT_S) -> web.Application:
    """The aiohttp application of ``worker``; the worker starts loading when the application starts.
    ``body_timeout_s``: the longest a completion request's body may take to arrive (:data:`BODY_TIMEOUT_S`)."""
    app = web.Application(client_max_size=max_body_bytes, middlewares=[count_requests, check_serving_key])
    app[WORKER] = worker
    app[MAX_BODY] = max_body_bytes
    app[BODY_TIMEOUT] = body_timeout_s
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post(STAGE_PATH, stage_call)
    app.router.add_post(STAGE_CLOSE_PATH, stage_close)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)

    async def start(app: web.Application) -> None:
        worker.start()

    async def drain(app: web.Application) -> None:
        worker.drain()

    async def close(app: web.Application) -> None:
        await worker.close()

    app.on_startup.append(start)
    app.on_shutdown.append(drain)
    app.on_cleanup.append(close)
    return app


async def run_worker(worker: ServingWorker, host: str, port: int, drain_timeout_s: float,
                     announce: Callable[[str], None]) -> None:
    """Serve ``worker`` on host:port (port 0: any free port) until SIGTERM, SIGINT or SIGHUP, then drain: still
    listening, it refuses new requests (503) and gives those running, and the pipelined sessions it holds for
    other heads, up to ``drain_timeout_s`` (:meth:`ServingWorker.drain_within`).

    ``announce`` gets the bound base URL as soon as the worker listens (before the model is in).
    """
    await serve_until_signalled(build_app(worker), host, port, drain_timeout_s, announce, drain=worker.drain_within,
                                **RUNNER_OPTIONS)

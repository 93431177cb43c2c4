"""Cross-node pipelines between serving workers: the route, the activation frames, the stage calls, and
the head stage that drives a request through them.

A pipelined request reaches its head stage (the worker holding layers 0..k with the embeddings) as an
ordinary ``POST /v1/completions`` with the route in the :data:`PIPELINE_HEADER` header: a JSON list of
``{"url": ..., "layers": [start, stop]}``, one per stage, in order, the first being the head itself.
For each token the head runs its layers (:class:`~pipecast.engine.stage.StageRunner`) and sends the
hidden states to the next stage's ``POST /v1/stage``; every stage runs its layers and calls the next one
in turn, and the last applies the head, samples and answers the token, which travels back along the
calls. With tied embeddings the last stage answers its final norm instead, and the head stage, which
holds the embeddings (the tied LM head), samples: the last stage then never needs the embeddings' block. Every stage
keeps its own layers' keys and values per session, so decoding goes on through the pipeline; when the request ends the
head closes the sessions along the route (``POST /v1/stage/close``; stages also drop sessions left idle).

Frames carry binary tensors: 4 bytes (big endian) of header length, the header as JSON, then the
tensor's raw bytes (dtype and shape in the header), so bf16 activations travel exactly. Every call has
a deadline that travels with it (``deadline_s``: the time left), bounding each stage's waits for its
layers and the calls after it. A stage that fails or does not answer in time fails the request with
:class:`~pipecast.serve.errors.StageFailedError` naming that stage, answered 503 before any token left,
so the router retries the request on another worker; a stage without room for it (its stage calls or sessions at
their bound) with :class:`~pipecast.serve.errors.StageBusyError`, 429, which the router takes as load.
"""

import asyncio
import heapq
import itertools
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from packager.manifest import HEX_DIGEST
from pipecast.core.errors import PipecastError
from pipecast.core.httpserve import read_capped
from pipecast.core.strictjson import JSONInputError, loads
from pipecast.core.urls import http_base_url
from pipecast.engine.errors import EngineClosedError, EngineError, InvalidRequestError
from pipecast.engine.sampling import SamplingParams
from pipecast.engine.stage import (MAX_SESSIONS, SAMPLE_PARTS, StageCapacityError, StageOutput, StageRunner,
                                   check_final_norm)
from pipecast.engine.streams import FINISH_CANCELLED, TokenStream, emit
from pipecast.serve.errors import (RequestFieldError, StageBusyError, StageFailedError, StageQueueFullError,
                                   WorkerClosingError)

if TYPE_CHECKING:
    import aiohttp
    import torch

    from pipecast.engine.engine import Engine


log = logging.getLogger(__name__)

PIPELINE_HEADER = "x-pipecast-pipeline"
STAGE_PATH = "/v1/stage"
STAGE_CLOSE_PATH = "/v1/stage/close"
#: Default time a token may take through the whole pipeline, waits for arriving layers included (s).
STEP_TIMEOUT_S = 30.0
#: What a head does with a request whose pipeline dissolves under it: move it to its own engine (the
#: tokens so far re-prefilled), finish it through the stages, or choose per request from what it measured
#: (:func:`move_pays`). ``pipecast bench pipelines`` measures all three.
DISSOLVE_AUTO, DISSOLVE_MOVE, DISSOLVE_FINISH = "auto", "move", "finish"
DISSOLVE_CHOICES = (DISSOLVE_AUTO, DISSOLVE_MOVE, DISSOLVE_FINISH)
#: The latest decode steps whose means auto's estimates use.
STEPS_KEPT = 8
#: Closing sessions along the route is best effort within this (s): stages drop idle sessions anyway.
CLOSE_TIMEOUT_S = 2.0
#: Closes a worker passes on at once (its own sessions' and those it was asked to pass on): one per session
#: it may hold, and as many again.
MAX_CLOSES_PASSING = 2 * MAX_SESSIONS
#: A stage passes the next one the step's time left less this (at most a tenth of it), so that a stage that
#: never answers is timed out by the one before it, which names it, before that one's caller gives up on it.
HOP_MARGIN_S = 0.2
#: Most stages a route may name.
MAX_ROUTE_STAGES = 64
#: Most characters of a pipelined session's id (a head names its sessions with 32 hex digits).
MAX_SESSION_CHARS = 64
#: Longest deadline a stage call may carry (s): a hostile caller cannot hold a stage's waits for longer.
MAX_DEADLINE_S = 3600
#: Stage calls of a worker that wait for arriving layers at once; more queue for a thread.
MAX_LAYER_WAITS = 64
#: Stage calls a worker holds at once (waiting or computing), each with its hidden states: as many as the
#: pipelined sessions a node keeps (one call in flight each); a caller beyond it gets 429 at once.
MAX_STAGE_CALLS = MAX_SESSIONS
#: Largest answer a stage call reads: a token and its header, or a last position's final norm (a float32 row
#: of a hidden size up to 64 Ki is 256 KiB).
MAX_ANSWER_BYTES = 1 << 20
_ITEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # the dtypes a frame's tensor may have
_DTYPES = tuple(_ITEM_BYTES)
#: A frame's tensor (hidden states: batch, positions, width) has at most this many sizes, each at most
#: MAX_FRAME_DIM: a shape torch cannot allocate (a size past int64, or an empty tensor whose sizes multiply
#: past it) is refused by name, not raised from torch.
MAX_FRAME_DIMS = 4
MAX_FRAME_DIM = (1 << 31) - 1
#: Room a stage call's frame takes beyond its tensor: the length prefix and the JSON header (the route after
#: the stage came in an HTTP header, which aiohttp caps at 8 KiB; the session, layers and sampling are small).
STAGE_HEADER_BYTES = 64 << 10
#: Positions assumed of a model whose config names none, for its stage calls' body limit (a bound, not its
#: context: without one a stage would take a body of any size).
STAGE_POSITIONS_UNKNOWN = 8192
#: Bytes of one element of the widest dtype a frame carries (float32).
_WIDEST_ITEMSIZE = 4


class PipelineProtocolError(PipecastError):
    """A malformed route or frame (the sender's fault); the message says which part and what is wrong."""


@dataclass(frozen=True)
class Hop:
    """One stage of a route: the worker's base URL and the layers it runs."""

    url: str
    layers: range

    def to_json(self) -> dict:
        return {"url": self.url, "layers": [self.layers.start, self.layers.stop]}


def parse_next(value: Any, *, first: int | None) -> tuple[Hop, ...]:
    """The stages after this one of a stage call or close (its ``next``): none for None or [], else
    :func:`parse_route`'s. Raises :class:`PipelineProtocolError` for anything but a list ({} or 0 must not read as
    "the last stage")."""
    if value is not None and not isinstance(value, list):
        raise PipelineProtocolError(f"'next' must be a list of the stages after this one, got {str(value)[:40]}")
    return parse_route(value, first=first) if value else ()


def parse_route(value: Any, *, first: int | None = 0) -> tuple[Hop, ...]:
    """The hops of a decoded route (a list of ``{"url", "layers"}``), checked: consecutive non-empty layer
    ranges starting at ``first`` (None: anywhere), http(s) URLs. Raises :class:`PipelineProtocolError`."""
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_ROUTE_STAGES:
        raise PipelineProtocolError(f"a route is a list of 1 to {MAX_ROUTE_STAGES} stages")
    hops, position = [], first
    for i, item in enumerate(value):
        if not isinstance(item, dict) or set(item) != {"url", "layers"}:
            raise PipelineProtocolError(f"stage {i} of the route must be an object with 'url' and 'layers'")
        url, layers = item["url"], item["layers"]
        base = http_base_url(url) if isinstance(url, str) else None
        if base is None:
            raise PipelineProtocolError(f"stage {i} of the route has no http(s) URL: {str(url)[:80]!r}")
        if position is None and isinstance(layers, list) and layers and type(layers[0]) is int:
            position = layers[0]
        if (not isinstance(layers, list) or len(layers) != 2 or not all(type(x) is int for x in layers)
                or layers[0] != position or not 0 <= layers[0] < layers[1]):
            raise PipelineProtocolError(f"stage {i} of the route must run layers [{position}, stop) with "
                                        f"stop > {position}, got {str(layers)[:80]}")
        if any(hop.url == base for hop in hops):  # one session per request at each worker: it would open twice
            raise PipelineProtocolError(f"stage {i} of the route names {base[:80]} again: a worker runs one stage "
                                        "of a route")
        hops.append(Hop(base, range(layers[0], layers[1])))
        position = layers[1]
    return tuple(hops)


def parse_session(value: Any) -> str:
    """The session id a stage call or close names; :class:`PipelineProtocolError` unless 1 to
    :data:`MAX_SESSION_CHARS` characters (each stage keeps it, and a close answers it)."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_SESSION_CHARS:
        raise PipelineProtocolError(f"'session' must be a string of 1 to {MAX_SESSION_CHARS} characters")
    return value


def route_header(hops: Sequence[Hop]) -> str:
    """The :data:`PIPELINE_HEADER` value of a route."""
    return json.dumps([h.to_json() for h in hops], separators=(",", ":"))


def encode_frame(header: dict, tensor: "torch.Tensor | None" = None) -> bytes:
    """A frame of ``header`` (JSON-able) and, optionally, one tensor's bytes."""
    meta = dict(header)
    data = b""
    if tensor is not None:
        import torch

        tensor = tensor.detach().to("cpu").contiguous()
        meta["tensor"] = {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    head = json.dumps(meta, separators=(",", ":")).encode()
    return len(head).to_bytes(4, "big") + head + data


def decode_frame_header(head: bytes) -> dict:
    """A frame's header (the JSON object after the length prefix); :class:`PipelineProtocolError`."""
    try:
        header = loads(head)
    except JSONInputError as exc:
        raise PipelineProtocolError(f"the frame's header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise PipelineProtocolError("the frame's header is not a JSON object")
    return header


def tensor_bytes(meta: object) -> int:
    """The bytes after a frame's header that its tensor ``meta`` (the header's ``tensor``: dtype and shape)
    takes; :class:`PipelineProtocolError` unless it names a dtype of :data:`_DTYPES` and a bounded shape."""
    dtype, shape = (meta.get("dtype"), meta.get("shape")) if isinstance(meta, dict) else (None, None)
    if (dtype not in _DTYPES or not isinstance(shape, list) or len(shape) > MAX_FRAME_DIMS
            or not all(type(n) is int and 0 <= n <= MAX_FRAME_DIM for n in shape)):
        raise PipelineProtocolError(f"the frame's tensor must name a dtype of {', '.join(_DTYPES)} and a shape of "
                                    f"at most {MAX_FRAME_DIMS} sizes from 0 to {MAX_FRAME_DIM}, got {str(meta)[:120]}")
    count = 1
    for n in shape:
        count *= n
    return count * _ITEM_BYTES[dtype]


def decode_frame(body: bytes) -> tuple[dict, "torch.Tensor | None"]:
    """The header and tensor of a frame; :class:`PipelineProtocolError` names what is malformed."""
    if len(body) < 4 or len(body) < 4 + int.from_bytes(body[:4], "big"):
        raise PipelineProtocolError(f"a frame of {len(body)} bytes is shorter than its header says")
    end = 4 + int.from_bytes(body[:4], "big")
    header = decode_frame_header(body[4:end])
    meta = header.pop("tensor", None)
    if meta is None:
        if end != len(body):
            raise PipelineProtocolError(f"{len(body) - end} bytes follow a header that names no tensor")
        return header, None
    import torch

    expected = tensor_bytes(meta)
    dtype, shape = meta["dtype"], meta["shape"]
    torch_dtype = getattr(torch, dtype)
    if len(body) - end != expected:
        raise PipelineProtocolError(f"the frame's tensor {dtype}{shape} needs {expected} bytes, "
                                    f"{len(body) - end} follow the header")
    if expected == 0:
        return header, torch.empty(shape, dtype=torch_dtype)
    flat = torch.frombuffer(bytearray(memoryview(body)[end:]), dtype=torch.uint8)  # one (writable) copy
    return header, flat.view(torch_dtype).reshape(shape)


def stage_body_limit(config: Any, floor: int) -> int:
    """The largest stage call body a worker of a model of ``config`` (a transformers config) takes: a whole
    prompt's hidden states at the model's longest (``max_position_embeddings`` x ``hidden_size`` x 4 bytes,
    float32 being the widest dtype a frame carries) plus :data:`STAGE_HEADER_BYTES`, never below ``floor``
    (the worker's limit on other bodies). A config naming no positions counts
    :data:`STAGE_POSITIONS_UNKNOWN`; one naming no width gets ``floor``."""
    positions = getattr(config, "max_position_embeddings", None)
    width = getattr(config, "hidden_size", None)
    if type(width) is not int or width < 1:
        return floor
    if type(positions) is not int or positions < 1:
        positions = STAGE_POSITIONS_UNKNOWN
    return max(floor, positions * width * _WIDEST_ITEMSIZE + STAGE_HEADER_BYTES)


def params_json(params: SamplingParams) -> dict:
    """What the last stage needs to sample as the head would (stops and lengths stay with the head)."""
    return {"temperature": params.temperature, "top_p": params.top_p, "seed": params.seed}


def params_from_json(value: Any) -> SamplingParams:
    """The sampling parameters of a stage call (:func:`params_json`); :class:`PipelineProtocolError`."""
    if not isinstance(value, dict) or set(value) != {"temperature", "top_p", "seed"}:
        raise PipelineProtocolError("'params' must be an object with temperature, top_p and seed")
    numbers = [value["temperature"], value["top_p"]]
    if not all(type(n) in (int, float) for n in numbers) or type(value["seed"]) not in (int, type(None)):
        raise PipelineProtocolError(f"bad 'params': temperature and top_p must be numbers, seed an integer or "
                                    f"null, got {str(value)[:120]}")
    try:
        return SamplingParams(max_tokens=1, temperature=float(numbers[0]), top_p=float(numbers[1]),
                              seed=value["seed"])
    except PipecastError as exc:
        raise PipelineProtocolError(f"bad 'params': {exc}") from None


@dataclass(frozen=True)
class StageCall:
    """One ``POST /v1/stage``: the session, this stage's layers, the position, the time left of the token's
    deadline, the stages after this one, how the last stage samples (position 0 only), whether it
    answers its final norm instead of a token, and the package the head serves ("": not said, from a head that
    predates it): a stage serving another package (a route listed before a rollout) refuses the call."""

    session: str
    layers: range
    position: int
    deadline_s: float
    following: tuple[Hop, ...] = ()
    params: SamplingParams | None = None
    norm_only: bool = False
    package: str = ""

    def header(self) -> dict:
        """The frame header of this call."""
        return {"session": self.session, "layers": [self.layers.start, self.layers.stop],
                "position": self.position, "deadline_s": self.deadline_s,
                "next": [h.to_json() for h in self.following],
                "params": params_json(self.params) if self.params is not None else None,
                "norm_only": self.norm_only, "package": self.package}

    @classmethod
    def from_header(cls, header: dict) -> "StageCall":
        """The call a frame header describes; :class:`PipelineProtocolError` names the bad field."""
        session, layers, position = parse_session(header.get("session")), header.get("layers"), header.get("position")
        deadline_s, params = header.get("deadline_s"), header.get("params")
        norm_only, package = header.get("norm_only", False), header.get("package", "")
        if type(position) is not int or position < 0:
            raise PipelineProtocolError(f"'position' must be an integer >= 0, got {str(position)[:40]}")
        if type(deadline_s) not in (int, float) or not 0 < deadline_s <= MAX_DEADLINE_S:  # true is no 1 s (bool is int)
            raise PipelineProtocolError(f"'deadline_s' must be a number of seconds in (0, {MAX_DEADLINE_S}], got "
                                        f"{str(deadline_s)[:40]}")
        if not isinstance(layers, list) or len(layers) != 2 or not all(type(x) is int for x in layers):
            raise PipelineProtocolError("'layers' must be [start, stop]")
        if not isinstance(norm_only, bool):
            raise PipelineProtocolError("'norm_only' must be true or false")
        if not isinstance(package, str) or not (package == "" or HEX_DIGEST.fullmatch(package)):
            raise PipelineProtocolError(f"'package' must be a package id (64 lower-case hex digits), got "
                                        f"{str(package)[:70]}")
        following = parse_next(header.get("next"), first=layers[1])
        return cls(session, range(*layers), position, float(deadline_s), following,
                   None if params is None else params_from_json(params), norm_only, package)


@dataclass
class RequestTiming:
    """What a head measured of one pipelined request, for the choice at dissolution: its own layers'
    computing (waits for arriving layers left out) at the prefill and at the latest decoded tokens, its
    sampling (the tied LM head, when it samples), each as (seconds, CPU seconds of its thread), and the
    latest tokens' times through the whole route."""

    own_layers: int
    prompt_tokens: int
    own_prefill: tuple[float, float] = (0.0, 0.0)
    own_decode: deque = field(default_factory=lambda: deque(maxlen=STEPS_KEPT))
    sample: deque = field(default_factory=lambda: deque(maxlen=STEPS_KEPT))
    route_s: deque = field(default_factory=lambda: deque(maxlen=STEPS_KEPT))


@dataclass(frozen=True)
class DissolveEstimate:
    """The two ways to finish a request whose head now holds the whole model, in seconds."""

    remaining: int      # tokens the request may still generate (its max_tokens left)
    route_s: float      # a token through the route, measured (the latest steps' mean)
    local_s: float      # a token on the head's engine: its own layers' time scaled to every layer
    reprefill_s: float  # the prompt prefilled again on the head's engine, and the tokens so far fed a step each

    @property
    def stay_s(self) -> float:
        return self.remaining * self.route_s

    @property
    def move_s(self) -> float:
        return self.reprefill_s + self.remaining * self.local_s


def _mean(pairs: deque) -> tuple[float, float]:
    return (sum(w for w, _ in pairs) / len(pairs), sum(c for _, c in pairs) / len(pairs)) if pairs else (0.0, 0.0)


def dissolve_estimate(timing: RequestTiming, total_layers: int, history: int, remaining: int,
                      cpus: float | None = None) -> DissolveEstimate | None:
    """Both ways' cost from what the head measured (``history``: prompt and tokens so far); None before a
    token was decoded through the route (nothing to compare yet).

    The head ran ``own_layers`` of ``total_layers``: its per-layer time, scaled to the whole model, is the
    local engine's on the same device; the re-prefill scales its own prefill by layers, and adds a local decode
    step for each token generated so far (``history`` past the prompt: fed as one node made them, so that the
    tokens after are one node's). Under a CPU quota of ``cpus``
    (a container's limit) work that is sustained runs at most at the quota while one stage's short burst
    ran at full speed: the local engine then takes at least its CPU time over ``cpus``. Where the last
    stage samples (untied LM head), the head's cost is left out of the local estimate.
    """
    if not timing.own_decode or not timing.route_s or timing.own_layers < 1:
        return None
    scale = total_layers / timing.own_layers
    sample = _mean(timing.sample)

    def sustained(wall: float, cpu: float) -> float:
        return max(wall, cpu / cpus) if cpus else wall

    decode = _mean(timing.own_decode)
    local = sustained(decode[0] * scale + sample[0], decode[1] * scale + sample[1])
    reprefill = sustained(timing.own_prefill[0] * scale + sample[0], timing.own_prefill[1] * scale + sample[1]) + \
        max(history - timing.prompt_tokens, 0) * local
    return DissolveEstimate(remaining, sum(timing.route_s) / len(timing.route_s), local, reprefill)


def move_pays(estimate: DissolveEstimate) -> bool:
    """Whether moving to the head's engine ends the request sooner than finishing through the route."""
    return estimate.move_s < estimate.stay_s


class StageQueue:
    """A worker's stage computations, run one at a time on one thread, the earliest deadline first.

    Calls run at once would share the worker's CPU and all end late: a burst of prefills through a
    pipeline would then move from stage to stage together, each stage idle while the others compute. One
    at a time, a stage passes each call on as soon as it is done and computes the next meanwhile, so the
    stages of a pipeline work on different requests at once. Every step of a pipelined request has one
    deadline across its stages (its start plus the step timeout), so the earliest deadline is the step
    that started first: a head's sample of a token whose step began before a burst of new prefills (its
    hidden states came back from the last stage) is computed before them, not after (arrival order would
    put it last). Calls of equal deadlines go in arrival order. A call that is cancelled before its turn
    never runs; one whose deadline passes while it waits fails with TimeoutError instead of running late.
    A call whose layers are still arriving waits for them before it queues, so it holds up no other call (it
    gives up computing its first layers while its last ones arrive, at most one block's time once a pipeline
    forms).
    """

    def __init__(self, max_calls: int = MAX_STAGE_CALLS) -> None:
        self.max_calls = max_calls
        self._calls = 0  # in this queue: waiting for layers, for the turn, or computing
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipecast-stage")
        # Waits for arriving layers get threads of their own: in the loop's default pool a burst of them held
        # every thread (tokenizing, the agent's status, other calls' waits) until their deadlines.
        self._waits = ThreadPoolExecutor(max_workers=MAX_LAYER_WAITS, thread_name_prefix="pipecast-stage-wait")
        self._waiting: list[tuple[float, int, asyncio.Future]] = []  # a heap: (deadline, arrival, turn)
        self._arrivals = itertools.count()
        self._busy = False
        self._closed = False

    async def call(self, function: Callable[..., StageOutput], *args: Any, deadline: float,
                   wait: Callable[[float], None] | None = None, **kwargs: Any) -> StageOutput:
        """``function(*args, timeout=..., **kwargs)`` in its turn, ``timeout`` what is left until
        ``deadline`` (a ``time.monotonic()`` instant) when the turn comes. ``wait(timeout)`` (a
        :meth:`~pipecast.engine.stage.StageRunner.waiter`), if given, runs first, off the queue: a call whose
        layers are still arriving holds up no other call while it waits for them. Beyond ``max_calls`` calls
        at once: :class:`StageQueueFullError`."""
        if self._calls >= self.max_calls:
            raise StageQueueFullError(self._calls)
        self._calls += 1
        try:
            return await self._call(function, *args, deadline=deadline, wait=wait, **kwargs)
        finally:
            self._calls -= 1

    async def _call(self, function: Callable[..., StageOutput], *args: Any, deadline: float,
                    wait: Callable[[float], None] | None, **kwargs: Any) -> StageOutput:
        if wait is not None:
            try:
                waited = asyncio.get_running_loop().run_in_executor(
                    self._waits, lambda: wait(max(deadline - time.monotonic(), 0.0)))  # its time left when it starts
            except RuntimeError:  # closed: the worker is shutting down
                raise WorkerClosingError() from None
            await waited

        def turn() -> StageOutput:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the step's deadline passed while the call waited for this worker's stage")
            return function(*args, timeout=left, **kwargs)

        await self._turn(deadline)
        try:
            try:
                computed = asyncio.get_running_loop().run_in_executor(self._thread, turn)
            except RuntimeError:  # closed: the worker is shutting down (not an error of the call's own)
                raise WorkerClosingError() from None
            return await computed
        finally:
            self._next()

    async def _turn(self, deadline: float) -> None:
        """Return once this call may compute: at once when nothing computes or waits, else when it is the
        earliest deadline waiting as the computing call ends."""
        if self._closed:
            raise WorkerClosingError()
        if not self._busy and not self._waiting:
            self._busy = True
            return
        granted = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (deadline, next(self._arrivals), granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():  # granted as it was cancelled: pass the turn on
                self._next()
            raise

    def _next(self) -> None:
        """The computing call ended: the earliest deadline waiting computes next."""
        while self._waiting:
            _, _, granted = heapq.heappop(self._waiting)
            if not granted.done():
                granted.set_result(None)
                return
        self._busy = False

    def close(self) -> None:
        """Drop the calls still waiting (their callers get CancelledError), refuse new ones
        (:class:`WorkerClosingError`); the running one ends."""
        self._closed = True
        for _, _, granted in self._waiting:
            granted.cancel()
        self._waiting.clear()
        self._thread.shutdown(wait=False, cancel_futures=True)
        self._waits.shutdown(wait=False, cancel_futures=True)


class StageClient:
    """Calls to the next stages of routes (one HTTP connection pool per worker); each call carries
    ``headers`` (the cluster's serving key, once the worker knows it)."""

    def __init__(self) -> None:
        self._session: "aiohttp.ClientSession | None" = None
        self.headers: dict[str, str] = {}
        self._passing: set[asyncio.Task] = set()  # closes passed on (see pass_close_on)

    def _http(self) -> "aiohttp.ClientSession":
        import aiohttp

        if self._session is None or self._session.closed:
            # No connection limit: aiohttp's default (100) queued the 101st call for a connection, which then
            # failed at its deadline naming a next stage it never reached; the sessions bound the calls instead.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def forward(self, hops: Sequence[Hop], session: str, position: int, hidden: "torch.Tensor", *,
                      params: SamplingParams | None, norm_only: bool, deadline: float,
                      package: str = "") -> "int | torch.Tensor":
        """Send ``hidden`` to ``hops[0]`` (which calls the rest) and return the token the last stage sampled,
        or with ``norm_only`` its final norm of the last position (for the first stage's tied LM head); every
        stage must serve ``package`` (the head's package id; "": not checked).

        ``deadline`` is a ``time.monotonic()`` instant. Raises :class:`StageFailedError` naming the stage
        that failed (the one called, or the one it reports).
        """
        import aiohttp

        hop = hops[0]
        left = deadline - time.monotonic()
        if left <= 0:
            raise StageFailedError(hop.url, "the step's deadline passed before the call")
        call = StageCall(session, hop.layers, position, left - min(HOP_MARGIN_S, left / 10), tuple(hops[1:]), params,
                         norm_only, package)
        try:
            async with self._http().post(hop.url + STAGE_PATH, data=encode_frame(call.header(), hidden),
                                         headers={**self.headers, "Content-Type": "application/octet-stream"},
                                         timeout=aiohttp.ClientTimeout(total=left)) as answer:
                body = await read_capped(answer.content, MAX_ANSWER_BYTES)
                status = answer.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            problem = "no answer within the step's deadline" if isinstance(exc, TimeoutError) else str(exc)
            raise StageFailedError(hop.url, problem or type(exc).__name__) from None
        if status != 200:
            raise _answered_error(hop.url, status, body)
        try:
            answer_header, normed = decode_frame(body)
        except PipelineProtocolError as exc:
            raise StageFailedError(hop.url, f"a malformed answer: {exc}") from None
        if norm_only:
            if normed is None:
                raise StageFailedError(hop.url, "an answer without the final norm")
            return normed
        token = answer_header.get("token")
        if type(token) is not int:
            raise StageFailedError(hop.url, f"an answer without a token: {str(answer_header)[:120]}")
        return token

    async def close_sessions(self, hops: Sequence[Hop], session: str) -> None:
        """Ask ``hops[0]`` to forget ``session`` and to pass it on; best effort (stages expire sessions). A stage
        that does not take it (dead, or not answering within :data:`CLOSE_TIMEOUT_S`) is passed over: the next
        one is asked, so that the stages after a dead one free their sessions now, not once they are idle."""
        import aiohttp

        for n, hop in enumerate(hops):
            body = {"session": session, "next": [h.to_json() for h in hops[n + 1:]]}
            try:
                async with self._http().post(hop.url + STAGE_CLOSE_PATH, json=body, headers=self.headers,
                                             timeout=aiohttp.ClientTimeout(total=CLOSE_TIMEOUT_S)) as answer:
                    await answer.read()
                    if answer.status == 200:
                        return
                    log.debug("closing session %s at %s: answered %d", session, hop.url, answer.status)
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.debug("closing session %s at %s: %s", session, hop.url, exc)

    def pass_close_on(self, hops: Sequence[Hop], session: str) -> None:
        """:meth:`close_sessions` in the background: a stage asked to close answers at once. Awaited, each stage
        answered only once the stages after it had, its caller timed it out and asked those itself (a close along
        hanging stages took minutes and thousands of calls). At most :data:`MAX_CLOSES_PASSING` at once: past
        them a close is dropped (best effort: the stages expire idle sessions), not a task and sockets more."""
        if not hops:
            return
        if len(self._passing) >= MAX_CLOSES_PASSING:
            log.debug("closing session %s: %d closes already passing on; left to expire", session, len(self._passing))
            return
        task = asyncio.get_running_loop().create_task(self.close_sessions(hops, session))
        self._passing.add(task)
        task.add_done_callback(self._passing.discard)

    async def aclose(self) -> None:
        for task in list(self._passing):
            task.cancel()
        await asyncio.gather(*self._passing, return_exceptions=True)
        if self._session is not None:
            await self._session.close()


def _answered_error(url: str, status: int, body: bytes) -> "StageFailedError | StageBusyError":
    """The error of a stage's non-200 answer: the stage it names (downstream), else ``url``; busy on a 429 (no
    room there: load, not a failure), failed otherwise."""
    try:
        error = loads(body).get("error", {})
        node, problem = error.get("node") or url, error.get("problem")
        message = str(error.get("message") or f"answered {status}")
    except (JSONInputError, AttributeError):
        node, problem, message = url, None, repr(body[:120])
    if status == 429:
        return StageBusyError(node, problem or message)
    if node != url:  # already "pipeline stage X failed: ..." from downstream: keep its words
        return StageFailedError(node, problem or message)
    return StageFailedError(url, f"answered {status}: {message}")


class EngineStageRunner(StageRunner):
    """The stages of ``engine``'s model, whose calls fail with :class:`EngineClosedError` (a 503) once the engine
    is closed: a call queued or running when the worker closes its model (released, or shutting down) would
    otherwise run on the meta tensors :meth:`Engine.close` leaves, and fail with torch's error (a 500)."""

    def __init__(self, engine: "Engine", **options: Any):
        super().__init__(engine.model, **options)
        self.engine = engine

    @property
    def package_id(self) -> str:
        """The package whose model this runs (a released model's, while its sessions end, is not the worker's)."""
        return self.engine.provider.manifest.package_id

    def run(self, *args: Any, **kwargs: Any) -> StageOutput:
        return self.engine.while_open(super().run, *args, **kwargs)

    def sample(self, *args: Any, **kwargs: Any) -> StageOutput:
        return self.engine.while_open(super().sample, *args, **kwargs)


class PipelineHead:
    """The head stage of pipelined requests on one worker: runs its own layers and drives the rest."""

    def __init__(self, runner: StageRunner, client: StageClient, queue: StageQueue, *,
                 step_timeout_s: float = STEP_TIMEOUT_S,
                 local: "Callable[[list[int], SamplingParams], TokenStream] | None" = None,
                 dissolve: str = DISSOLVE_AUTO, cpus: float | None = None, package_id: str = ""):
        """``package_id``: the package this worker serves, which every later stage must serve too; ``queue``
        runs this worker's stage computations (the head's own and the stage calls it is sent);
        ``local`` submits a prompt to this worker's own engine: given, a request whose pipeline dissolves
        under it (this worker came to hold the whole model after the request started) may move here with its
        tokens so far, re-prefilled, instead of finishing through the stages (:meth:`start`): always with
        ``dissolve`` :data:`DISSOLVE_MOVE`, where :func:`move_pays` says so with :data:`DISSOLVE_AUTO`,
        never with :data:`DISSOLVE_FINISH`; ``cpus``: this worker's CPU quota, if any (the estimate's)."""
        if dissolve not in DISSOLVE_CHOICES:
            raise ValueError(f"dissolve must be one of {', '.join(DISSOLVE_CHOICES)}, got {dissolve!r}")
        self.runner = runner
        self.client = client
        self.queue = queue
        self.package_id = package_id
        self.step_timeout_s = step_timeout_s
        self.local = local if dissolve != DISSOLVE_FINISH else None
        self.dissolve = dissolve
        self.cpus = cpus
        #: Requests moved off their pipeline to this worker's engine; and of them those still running there.
        self.moved = 0
        self.on_engine = 0
        #: Requests whose pipeline dissolved under them and that finished through it by choice (auto).
        self.kept = 0
        self._ids = iter(range(1 << 62))
        self._tasks: set[asyncio.Task] = set()
        #: The sessions this head heads, each with the URL a stage call of it came back to this worker by, if one did.
        self._headed: dict[str, str | None] = {}

    def called_back(self, session: str, url: str) -> bool:
        """Whether ``session`` is one this head heads, a stage call of which came back to this worker at ``url``: its
        route names this worker twice (after its first stage, under this name or another), and :meth:`start` fails its
        request as the route's fault."""
        if session not in self._headed:
            return False
        self._headed[session] = url
        return True

    async def start(self, route: Sequence[Hop], prompt: list[int], params: SamplingParams) -> TokenStream:
        """Run the prompt through the route and return the request's stream, its first token in.

        The request decodes through the route; if this worker did not hold the whole model when the request
        started and holds it later (the pipeline dissolves), the rest of it runs on the local engine from
        the prompt and its tokens so far (greedy and unseeded requests: a seeded one's generator lives in
        the sampling stage, so it finishes through the route).

        Raises :class:`StageFailedError` (the prefill failed: nothing was answered yet, retry elsewhere),
        :class:`RequestFieldError` for a route that names this worker again after its first stage (a call of its
        stages came back here: none failed, the route is wrong), or :class:`EngineClosedError` (this worker closed
        its model: the request's stream fails with it too, once under way).
        """
        movable = self.local is not None and not self.runner.model.fully_loaded and \
            (params.greedy or params.seed is None)
        session = uuid.uuid4().hex
        self._headed[session] = None
        task: list[asyncio.Task] = []
        stream = TokenStream(next(self._ids), lambda _: task and task[0].cancel())
        timing = RequestTiming(len(route[0].layers), len(prompt))
        try:
            token = await self._step(route, session, 0, prompt, params, timing)
        except BaseException as exc:
            url = self._headed.get(session)  # by which a call of its stages came back here, if one did
            self._close(route, session)
            if isinstance(exc, StageFailedError):
                if url is not None:  # the stage that failed refused this worker's own call: the route is wrong
                    raise RequestFieldError(PIPELINE_HEADER, f"the route names this worker twice (as {url})") from None
                log.warning("pipelined request failed before its first token: %s", exc)
            raise
        if emit(stream, token, 1, params):
            self._close(route, session)
            return stream
        decoding = self._spawn(self._decode(route, session, [*prompt, token], len(prompt), params, stream, movable,
                                            timing))
        # Cancelled before its first step (the first token completed a stop string, the worker was released), the
        # task never runs _decode's cleanup: the sessions of every stage would stay open until they expire.
        decoding.add_done_callback(lambda done: done.cancelled() and self._close(route, session))
        task.append(decoding)
        return stream

    async def _decode(self, route: Sequence[Hop], session: str, history: list[int], prompt_length: int,
                      params: SamplingParams, stream: TokenStream, movable: bool, timing: RequestTiming) -> None:
        """Decode after the first token: ``history`` is the prompt and the tokens so far."""
        closed = False
        try:
            while True:
                if movable and self.runner.model.fully_loaded:
                    move = self._should_move(timing, len(history), params.max_tokens - (len(history) - prompt_length))
                    local = self._move(history, prompt_length, params) if move else None
                    if local is not None:
                        self._close(route, session)  # the stages' sessions are no longer needed
                        closed = True
                        self.on_engine += 1  # the engine's batch and queue count it from here (found in review)
                        try:
                            await self._relay(local, len(history) - prompt_length, params, stream)
                        finally:
                            self.on_engine -= 1
                        return
                    movable = move is None  # undecided: nothing measured yet, one more step first
                started = time.monotonic()
                token = await self._step(route, session, len(history) - 1, [history[-1]], params, timing)
                timing.route_s.append(time.monotonic() - started)
                history.append(token)
                if emit(stream, token, len(history) - prompt_length, params):
                    return
        except asyncio.CancelledError:
            stream.finish(FINISH_CANCELLED)
        except PipecastError as exc:
            log.warning("pipelined request failed after %d tokens: %s", len(history) - prompt_length, exc)
            stream.fail(exc)
        except Exception as exc:  # torch's own errors, or a bug: the client's stream must still end, with an error
            log.exception("pipelined request failed after %d tokens", len(history) - prompt_length)
            stream.fail(EngineError(f"the engine failed while running this request: {exc}"))
        finally:
            if not closed:
                self._close(route, session)

    def _should_move(self, timing: RequestTiming, history: int, remaining: int) -> bool | None:
        """Move a request whose pipeline dissolved? None: auto, and no token measured through the route yet."""
        if self.dissolve == DISSOLVE_MOVE:
            return True
        estimate = dissolve_estimate(timing, self.runner.model.num_layers, history, remaining, self.cpus)
        if estimate is None:
            return None
        move = move_pays(estimate)
        if not move:
            self.kept += 1
        log.info("pipeline dissolved under a request: %s (%.0f ms a token through the route, about %.0f ms here "
                 "after a %.2f s re-prefill; %d tokens left at most)", "moving it here" if move else
                 "it finishes through the route", estimate.route_s * 1e3, estimate.local_s * 1e3,
                 estimate.reprefill_s, remaining)
        return move

    def _move(self, history: list[int], prompt_length: int, params: SamplingParams) -> TokenStream | None:
        """Submit the rest of a request to the local engine; None (it stays on its route) if refused."""
        generated = len(history) - prompt_length
        try:
            # Its tokens so far go through the engine's decode steps, as one node made them (a prefill of them
            # rounds otherwise in bf16, and the tokens after would differ).
            local = self.local(history[:prompt_length], replace(params, max_tokens=params.max_tokens - generated),
                               generated=history[prompt_length:])
        except PipecastError as exc:
            log.info("pipelined request stays on its route (the local engine refused it: %s)", exc)
            return None
        self.moved += 1
        log.info("pipeline dissolved under a request: %d tokens so far, re-prefilled here", generated)
        return local

    @staticmethod
    async def _relay(local: TokenStream, generated: int, params: SamplingParams, stream: TokenStream) -> None:
        """Pass the local engine's tokens on as the request's, counting on from ``generated``."""
        try:
            async for token in local:
                generated += 1
                if emit(stream, token, generated, params):
                    return
            stream.finish(local.finish_reason or FINISH_CANCELLED)  # the engine ended it (e.g. shutting down)
        finally:
            if not local.done:  # this request was cancelled: free the engine's slot
                local.cancel()

    async def _step(self, route: Sequence[Hop], session: str, position: int, tokens: list[int],
                    params: SamplingParams, timing: RequestTiming) -> int:
        deadline = time.monotonic() + self.step_timeout_s
        own = route[0]
        # A tied LM head is the embedding matrix, which this stage holds: the last stage sends back its
        # final norm and the token is sampled here, so the last stage never needs the embeddings' block.
        here = len(route) > 1 and self.runner.model.skeleton.tied_embeddings
        out = await self._own(own, self.runner.run, session, own.layers, position, tokens=tokens, params=params,
                              deadline=deadline, wait=self.runner.waiter(self.runner.parts(own.layers)))
        if position == 0:
            timing.own_prefill = (out.seconds, out.cpu_seconds)
        else:
            timing.own_decode.append((out.seconds, out.cpu_seconds))
        if len(route) == 1:
            return out.token
        answer = await self.client.forward(route[1:], session, position, out.hidden, norm_only=here,
                                           params=params if position == 0 and not here else None,
                                           deadline=deadline, package=self.package_id)
        if not here:
            vocab = self.runner.model.vocab_size
            if not 0 <= answer < vocab:  # a token no tokenizer decodes (a 500 there), nor any next step takes
                raise StageFailedError(route[-1].url, f"a malformed answer: token {answer} outside the vocabulary "
                                                      f"(0-{vocab - 1})")
            return answer
        try:  # the last stage's answer, checked here: its fault, not this stage's
            check_final_norm(answer, self.runner.model.config.hidden_size)
        except InvalidRequestError as exc:
            raise StageFailedError(route[-1].url, f"a malformed answer: {exc}") from None
        sampled = await self._own(own, self.runner.sample, session, answer, deadline=deadline,
                                  wait=self.runner.waiter(SAMPLE_PARTS))
        timing.sample.append((sampled.seconds, sampled.cpu_seconds))
        return sampled.token

    async def _own(self, own: Hop, compute: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One of this stage's own calls, through its queue; what fails it is this stage's: busy when its queue
        or sessions are full (load: a 429, the router sends the request elsewhere), failed otherwise (a 503 the
        router retries elsewhere; found in review: torch's own errors, out of memory, were a plain 500 the router
        neither retried nor held against the pipeline). Found in review: one cut as the worker closed its model was
        a failed stage too, which the router held against the worker; it is the worker's to answer
        (:class:`EngineClosedError`)."""
        try:
            return await self.queue.call(compute, *args, **kwargs)
        except EngineClosedError:  # its model closed (released, or the worker stops): the worker says which
            raise
        except (StageQueueFullError, StageCapacityError) as exc:
            raise StageBusyError(own.url, str(exc)) from None
        except (TimeoutError, PipecastError) as exc:
            raise StageFailedError(own.url, str(exc)) from None
        except Exception as exc:  # torch's own errors, or a bug
            log.exception("pipeline stage %s failed", own.url)
            raise StageFailedError(own.url, f"the engine failed: {exc}") from None

    def _close(self, route: Sequence[Hop], session: str) -> None:
        self._headed.pop(session, None)
        self.runner.close(session)
        if len(route) > 1:
            self.client.pass_close_on(route[1:], session)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)  # keep a reference until done (the loop holds tasks weakly)
        task.add_done_callback(self._tasks.discard)
        return task

"""The serving worker's model and admission control, apart from HTTP.

The worker serves at once: the model is loaded on a thread (``pipecast.load``: execute-while-load from
the node agent, or the package folder as the unicast fallback) while requests are already admitted.
Its health moves ``loading`` (no embeddings yet, or the package not known yet) -> ``partial`` (blocks
arriving; prompts run layer by layer as they do) -> ``ready`` (fully loaded). With ``wait_full_load``
(the load-then-serve baseline) requests wait for the whole model and the health stays ``loading`` until
then; everything else is the same.

Released and back: a worker serving a package from its node agent asks the agent every
``FOLLOW_AGENT_S`` whether it still holds it. Once the agent dropped it (the scaling daemon released this
replica), the worker takes no more requests, answers 503 (the router sends the request elsewhere), closes
the model once the requests running on it end (``RELEASE_DRAIN_S`` at most: those still running then fail, 503
``model_unavailable`` as the requests meanwhile, not ``shutting_down``) and waits, ``loading`` in stage
``waiting_for_package``, for the package to come back with the next scale-up. A worker started before the
scale-up that brings its package to the agent (a sidecar, or the README's recipe) waits so from the start.

Credentials: a worker fed by its node agent asks it for the cluster's serving key
(:func:`pipecast.core.credentials.serving_key`; the agent answers once it has registered with its control
plane) and from then on takes completion requests and pipeline stage calls only with that key
(:meth:`ServingWorker.check_serving_key`, which the HTTP layer calls; a key it does not hold sends it to
the agent again, rate-limited, as the cluster's credentials may have changed), and presents it to the
stages it calls. A worker without an agent, or serving its package folder while no agent answers, takes
them without one, and says so in its log: as an agent with auth off. Serving its folder so, it asks the agent
again every ``KEY_RECHECK_S`` and takes them only with the key once the agent answers.

Admission: requests admitted but not in the engine's batch (waiting for the model, or for one of
``max_batch`` slots, or being tokenized) form the queue; beyond ``max_queue`` of them a request is refused
(:class:`WorkerBusyError`, answered 429 with Retry-After). A request counts (running or queued) until its tokens are
all made, not until its answer is written: a client slow to read its stream holds no slot of the engine's.

A prompt is tokenized on a thread (a long one takes seconds: /health and other requests must not wait
for it), and a prompt that cannot fit the model's positions is refused before any work that grows with
it: token ids by their count, text by a lower bound on its tokens (:meth:`TextCodec.min_tokens`).
"""

import asyncio
import importlib
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pipecast.agent.errors import LocalApiError, PackageDroppedError
from pipecast.core.cpulimit import cpu_limit
from pipecast.core.credentials import presents_key, serving_headers
from pipecast.core.errors import PipecastError
from pipecast.engine.architectures import modeling_modules
from pipecast.engine.errors import (
    DeviceFaultError,
    EngineClosedError,
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
    ModelLoadError,
)
from pipecast.engine.providers import StreamingBlockProvider
from pipecast.engine.stage import SESSION_IDLE_S
from pipecast.engine.streams import TokenStream
from pipecast.engine.weights import EMBED
from pipecast.loading import SOURCE_AGENT, LoadedModel, load, local_folder
from pipecast.serve.errors import (
    ModelNotServedError,
    ModelUnavailableError,
    RequestFieldError,
    ServeError,
    ServingKeyError,
    ServingKeyUnknownError,
    WorkerBusyError,
    WorkerClosingError,
)
from pipecast.serve.health import MAX_COUNT, WorkerHealth
from pipecast.serve.metrics import ServeMetrics
from pipecast.serve.openai_api import CompletionRequest
from pipecast.serve.pipeline import (
    DISSOLVE_AUTO,
    PIPELINE_HEADER,
    STEP_TIMEOUT_S,
    EngineStageRunner,
    Hop,
    PipelineHead,
    StageClient,
    StageQueue,
)
from pipecast.serve.text import CompletionText, TextCodec

log = logging.getLogger(__name__)

STAGE_STARTING = "starting"           # importing torch and the model code
STAGE_WAITING = "waiting_for_package"  # for the agent's socket, then the package's manifest
STAGE_LOADING = "loading_weights"      # the engine runs; blocks arrive
STAGE_LOADED = "loaded"
STAGE_FAILED = "failed"
STAGE_DRAINING = "draining"

FINISH_STOP, FINISH_LENGTH = "stop", "length"
AGENT_SOCKET_POLL_S = 0.05
#: How often a worker fed by its agent checks that the agent still holds the package (s).
FOLLOW_AGENT_S = 1.0
#: A model its agent failed (the agent died or restarted: its client cannot follow it again) is loaded afresh
#: once the agent answers again, at most this often (s), so that a failure that comes back is no busy loop.
AGENT_RELOAD_MIN_S = 10.0
#: How often idle pipelined sessions are dropped (s): a quarter of their idle time.
EXPIRE_SESSIONS_S = SESSION_IDLE_S / 4
#: Each wait for a released package to come back asks the agent for this long, then again (s).
REWAIT_S = 30.0
#: A released package's model is closed once the requests running on it end, or after this long (s): the
#: router may have sent one just before the release (the daemon reads a replica idle, then releases it).
RELEASE_DRAIN_S = 30.0
RELEASE_DRAIN_POLL_S = 0.05
#: How often a worker draining before it stops looks whether its requests and pipelined sessions have ended.
DRAIN_POLL_S = 0.05
#: A request presenting a key the worker does not hold sends it to its agent again at most this often (s),
#: waiting at most KEY_RECHECK_TIMEOUT_S for the answer.
KEY_RECHECK_S = 5.0
KEY_RECHECK_TIMEOUT_S = 2.0
#: How often the loading thread checks whether the tokenizer is needed yet (s; a request wakes it at once).
CODEC_POLL_S = 0.1
#: A worker reads its tokenizer once it lacks at most this many blocks (it will serve whole requests soon),
#: and at most a quarter of them (see codec_blocks_left).
CODEC_BLOCKS_LEFT = 2
#: Prompts of up to this many characters are tokenized on the event loop (a thread hop costs more).
INLINE_TOKENIZE_CHARS = 4096
#: The most tokens a chat request without max_tokens may generate, whatever the model's positions leave.
UNBOUNDED_MAX_TOKENS = 4096


@dataclass(frozen=True)
class WorkerConfig:
    """What one serving worker serves and how (the ``serve`` command's options, resolved)."""

    package: str                       # a package folder, or a package id held by the agent
    agent: "Path | Any" = None         # the agent's local socket, or a connected client; None: the settings'
    device: str = "cpu"
    max_queue: int = 64
    max_batch: int = 16
    model_name: str | None = None      # default: the manifest's model name
    wait_full_load: bool = False       # the load-then-serve baseline
    agent_timeout_s: float = 60.0      # for the agent's socket to appear, and each agent request (pipecast.load)
    stall_timeout_s: float = 600.0     # loading fails after this long without a new block
    retry_after_s: int = 1
    pipeline_step_timeout_s: float = STEP_TIMEOUT_S  # a token through a cross-node pipeline, waits included
    pipeline_dissolve: str = DISSOLVE_AUTO  # a headed request whose pipeline dissolves: auto, move here, finish
    serving_key: bytes | None = None   # what callers must present; None: the agent's (b"": none, auth off)


@dataclass(frozen=True)
class Piece:
    """Output of a completion: the text and tokens one step added; ``finish_reason`` on the last piece."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None


def _warm_imports() -> None:
    """Import the engine's heavy dependencies before the package is asked for: on a cold start the
    weights are then the only thing still to come."""
    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    for module in modeling_modules():
        importlib.import_module(module)


def codec_blocks_left(num_blocks: int) -> int:
    """How few blocks a worker lacks when it reads its tokenizer unasked: ``CODEC_BLOCKS_LEFT``, but at most
    a quarter of the package (at least one): a pipeline's later stage holds half of a small package's blocks
    or more while it serves as a stage, and must not read it then."""
    return min(CODEC_BLOCKS_LEFT, max(1, num_blocks // 4))


class ServingWorker:
    """One model served with admission control. :meth:`start` inside the event loop, then
    :meth:`generate`; :meth:`drain` and :meth:`close` on shutdown."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.metrics = ServeMetrics(queue_depth=lambda: self.queue_depth, running=lambda: self.running,
                                    blocks_present=lambda: self.health().blocks_present,
                                    blocks_total=lambda: self.health().blocks_total)
        self.started_at = time.monotonic()
        self._load_started = self.started_at  # the model load timed by pipecast_serve_model_load_seconds
        self._stage = STAGE_STARTING
        self._model: LoadedModel | None = None
        self._codec: TextCodec | None = None
        self._codec_wanted = threading.Event()  # a request waits for the tokenizer (see _wait_codec_needed)
        self._error: str | None = None
        self._closing = False
        self._held = 0        # admitted, waiting for the model (or the full model) before the engine
        self._submitted = 0   # in the engine, not finished
        self._pipelined = 0   # through a pipeline this worker heads, not finished (not in its engine's batch)
        self._requests = 0  # requests whose handlers run, of those that came before a drain began
        self._loop: asyncio.AbstractEventLoop | None = None
        self._change: asyncio.Event | None = None
        self._released = False
        self._unloaded_why = ""  # why the package's model was unloaded (the 503 of the requests meanwhile)
        self._reloaded_at = -math.inf  # when a model the agent failed was last loaded afresh (monotonic)
        self._follower: asyncio.Task | None = None
        self._unloading: set[asyncio.Future] = set()  # unloads begun by a drop seen while loading, under way
        self._expirer: asyncio.Task | None = None
        self.stage_client = StageClient()
        self.stage_queue = StageQueue()
        self._head: PipelineHead | None = None
        # The stage runners of released models still closing: their live sessions (pipelined requests of other
        # heads, under way) are served until they end, as the model's own requests are (:meth:`_unload`).
        self._released_runners: list[EngineStageRunner] = []
        self._serving_key: bytes | None = None  # None until learned
        self._key_known: asyncio.Event | None = None
        self._key_source: Path | str | None = None  # the agent that gave it
        self._key_asked_at = -math.inf

    # --- life cycle ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Begin loading on a thread; call from the event loop that serves the requests."""
        self._loop = asyncio.get_running_loop()
        self._change = asyncio.Event()
        self._key_known = asyncio.Event()
        threading.Thread(target=self._load, name="pipecast-serve-load", daemon=True).start()
        if self.config.serving_key is not None:
            self._set_serving_key(self.config.serving_key)
        else:
            threading.Thread(target=self._learn_serving_key, name="pipecast-serve-key", daemon=True).start()
        if isinstance(self.config.agent, (str, Path)):
            self._follower = asyncio.create_task(self._follow_agent(), name="pipecast-serve-follow-agent")
        self._expirer = asyncio.create_task(self._expire_stage_sessions(), name="pipecast-serve-expire-sessions")

    def _follows_agent(self) -> bool:
        """Whether the package comes from an agent named by its socket, with no package folder to fall back to:
        the worker then waits for the agent to hold it, and follows whether it still does."""
        return isinstance(self.config.agent, (str, Path)) and not Path(self.config.package).is_dir()

    def _waits_for_package(self) -> bool:
        """Whether the first load waits for the agent to hold the package: it follows the agent, and the agent's
        disk cache holds no copy to fall back to (read once the agent does not answer)."""
        return self._follows_agent() and not self._local_copy()

    def _local_copy(self) -> bool:
        """Whether this node holds the package without its agent: its folder, or a copy in the agent's disk cache."""
        from pipecast.core.settings import load_settings

        return local_folder(self.config.package, load_settings().agent_cache_dir) is not None

    def _load(self, again: bool = False, wait: bool = True, after: threading.Event | None = None) -> None:
        """Load the model (``again``: after an unload, waiting first for the agent to hold the package, unless not
        to ``wait``: a folder beside the agent serves without it; then for ``after``, the model before closed)."""
        model = None
        try:
            if again:
                if wait:
                    self._wait_for_package_again()
                if after is not None:
                    after.wait()
                if self._closing:  # shut down while it waited: nobody asks for the model
                    return
                self._load_started = time.monotonic()
            else:
                _warm_imports()
                self._post(self._set_stage, STAGE_WAITING)
                self._wait_for_agent_socket()
                if self._waits_for_package():
                    # Started before the scale-up that brings the package here (as a sidecar is): wait for it as
                    # for a package released and back, however long, instead of failing after agent_timeout_s.
                    log.info("waiting for the agent to hold package %s (a scale-up assigns it to this node)",
                             self.config.package)
                    self._wait_for_package_again()
            c = self.config
            # The engine's own bound is above the worker's: the worker admits max_queue waiting requests
            # plus max_batch running ones, and hands them to the engine all at once when the model is in.
            model = load(c.package, agent=c.agent, device=c.device, max_batch=c.max_batch,
                         max_queue=c.max_queue + c.max_batch, stall_timeout_s=c.stall_timeout_s,
                         agent_timeout_s=c.agent_timeout_s)
            self._post(self._set_model, model)
            self._wait_codec_needed(model)
            # A failed model reports itself (_on_model_change): dropped while loading, its package may be
            # gone from the agent, and reading the tokenizer from it would wait out the agent's timeout
            # and fail the worker that now waits for the package to come back.
            if self._closing or model.engine.model.failed:
                return
            provider = model.engine.provider
            started, cpu = time.monotonic(), time.thread_time()
            codec = TextCodec.from_files(provider.small_file, [f.path for f in provider.manifest.files],
                                         f"package {provider.manifest.package_id[:12]} ({provider.origin})")
            log.info("tokenizer loaded in %.3f s (%.3f s of CPU)", time.monotonic() - started,
                     time.thread_time() - cpu)
            self._post(self._set_codec, codec, model)
        except PipecastError as exc:  # the package, the agent or the block source failed us
            log.error("cannot serve %s: %s", self.config.package, exc)
            self._post(self._set_error, f"cannot load {self.config.package}: {exc}", model)
        except Exception as exc:  # anything else (the device, a bug) must still reach the waiting requests
            log.exception("loading %s failed", self.config.package)
            self._post(self._set_error, f"cannot load {self.config.package}: {type(exc).__name__}: {exc}", model)

    def _wait_codec_needed(self, model: LoadedModel) -> None:
        """Until the tokenizer is needed: a request waits for it, the embeddings (block 0) are the first
        block this node receives (it will serve alone or head a pipeline), the model lacks at most
        :func:`codec_blocks_left` blocks (the router offers whole requests once it lacks one), or it failed,
        or the worker closes. A pipeline's other stages need none while they serve as stages, and loading
        it (0.3-1 s of CPU, partly in C calls that hold the GIL) held up the binding of the blocks they
        serve, and their stage calls, for seconds on a node short of CPU."""
        provider = model.engine.provider
        streaming = isinstance(provider, StreamingBlockProvider)
        head = True  # no block but the embeddings' here yet
        while not self._codec_wanted.wait(CODEC_POLL_S):
            if self._closing or model.engine.model.failed:
                return
            present = provider.present_blocks()
            if len(present) >= provider.num_blocks - codec_blocks_left(provider.num_blocks):
                return
            head = head and not present - {0}
            if head and (provider.verified_bytes(0) if streaming else 0 in present):
                return

    def _wait_for_agent_socket(self, agent: "Path | Any" = None) -> None:
        """An agent named by its socket (``agent``, default the configured one) may start after the worker (a
        sidecar): wait up to the agent timeout for the socket to appear; without it, loading falls back to the
        folder or fails."""
        agent = agent if agent is not None else self.config.agent
        if not isinstance(agent, (str, Path)):
            return
        deadline = time.monotonic() + self.config.agent_timeout_s
        while not Path(agent).exists() and time.monotonic() < deadline:
            time.sleep(AGENT_SOCKET_POLL_S)

    def _learn_serving_key(self) -> None:
        """Ask the agent for the cluster's serving key until it answers (module docstring); a thread."""
        from pipecast.agent.errors import LocalApiTimeoutError
        from pipecast.core.settings import load_settings

        agent = self.config.agent if self.config.agent is not None else load_settings().agent_local_socket
        if not isinstance(agent, (str, Path)):  # no agent (a connected client is a test's, and has no key)
            self._post(self._set_serving_key, b"")
            return
        self._wait_for_agent_socket(agent)
        keyless = False  # serving the package folder without a key until the agent answers
        refused = False  # said so once: a worker waiting for its agent would say it every FOLLOW_AGENT_S
        while not self._closing:
            try:
                key = _ask_serving_key(agent, REWAIT_S)
                self._key_source = agent
                if keyless:
                    log.warning("the agent at %s answers again: requests must present the cluster's serving key",
                                agent)
                self._post(self._set_serving_key, key)
                return
            except LocalApiTimeoutError as exc:
                log.warning("waiting for the cluster's serving key: %s", exc)
            except (OSError, PipecastError) as exc:
                if keyless:  # said so once; an agent that restarts may refuse for a while
                    log.debug("the agent at %s still does not answer: %s", agent, exc)
                elif self._local_copy():
                    # The unicast fallback serves without its agent (from the folder, or the disk cache's copy:
                    # that one said ready and answered 503 to every request), but only while the agent does not
                    # answer: one refused only while it restarts must not leave the worker open for its whole life.
                    log.warning("cannot ask the agent at %s for the cluster's serving key (%s): serving the "
                                "package folder without one until it answers", agent, exc)
                    keyless = True
                    self._post(self._set_serving_key, b"")
                else:
                    log.log(logging.DEBUG if refused else logging.WARNING,
                            "cannot ask the agent at %s for the cluster's serving key: %s", agent, exc)
                    refused = True
                time.sleep(KEY_RECHECK_S if keyless else FOLLOW_AGENT_S)

    def _set_serving_key(self, key: bytes) -> None:
        self._serving_key = key
        self.stage_client.headers = serving_headers(key)
        if not key:
            log.warning("serving worker: no cluster credentials: anyone who can reach this worker's port may "
                        "send it requests and pipeline stage calls")
        self._key_known.set()

    async def check_serving_key(self, presented: str | None, timeout_s: float) -> None:
        """Pass a request that ``presented`` (its serving key header, hex) the cluster's key, or any request
        where there is none; else :class:`ServingKeyError`. Waits at most ``timeout_s`` for the worker to
        learn the key (then :class:`ServingKeyUnknownError`). A key it does not hold sends the worker to
        its agent again (at most every ``KEY_RECHECK_S``): the cluster's credentials may have changed."""
        if self._serving_key is None:
            try:
                await asyncio.wait_for(self._key_known.wait(), timeout_s)
            except TimeoutError:
                raise ServingKeyUnknownError(timeout_s) from None
        if self._key_matches(presented) or (presented is not None and await self._relearn_serving_key()
                                            and self._key_matches(presented)):
            return
        raise ServingKeyError(presented is not None)

    def _key_matches(self, presented: str | None) -> bool:
        key = self._serving_key
        return not key or presents_key(presented, key)

    async def _relearn_serving_key(self) -> bool:
        """Ask the agent for the key again (rate-limited); whether it changed."""
        now = time.monotonic()
        if self._key_source is None or now - self._key_asked_at < KEY_RECHECK_S:
            return False
        self._key_asked_at = now
        try:
            key = await asyncio.to_thread(_ask_serving_key, self._key_source, KEY_RECHECK_TIMEOUT_S)
        except (OSError, PipecastError) as exc:
            log.warning("cannot ask the agent at %s for the cluster's serving key again: %s", self._key_source, exc)
            return False
        if key == self._serving_key:
            return False
        log.warning("the cluster's serving key changed (the agent holds other cluster credentials now): "
                    "requests must present the new one")
        self._set_serving_key(key)
        return True

    def _wait_for_package_again(self) -> None:
        """Before the first scale-up, and after a release: ask the agent for the package's manifest until it holds
        the package (again)."""
        from pipecast.agent.errors import LocalApiTimeoutError
        from pipecast.agent.local_client import LocalAgentClient

        refused = False  # said so once: an agent not there for hours would fill the log every FOLLOW_AGENT_S
        while not self._closing:
            try:
                with LocalAgentClient(self.config.agent) as client:
                    client.manifest(self.config.package, timeout=REWAIT_S)
                return
            except LocalApiTimeoutError:
                continue
            except (OSError, PipecastError) as exc:  # the agent restarts, or is not there yet: ask again
                log.log(logging.DEBUG if refused else logging.WARNING, "waiting for the agent to hold package %s: %s",
                        self.config.package, exc)
                refused = True
                time.sleep(FOLLOW_AGENT_S)

    async def _expire_stage_sessions(self) -> None:
        """Drop idle pipelined sessions every :data:`EXPIRE_SESSIONS_S`: those a head that died (or a close
        lost on the way) left behind would otherwise wait for the next stage call, which a dissolved pipeline
        never makes, holding their keys and values."""
        while True:
            await asyncio.sleep(EXPIRE_SESSIONS_S)
            if self._head is not None:
                dropped = self._head.runner.expire()
                if dropped:
                    log.info("dropped %d idle pipelined session(s)", dropped)

    async def _follow_agent(self) -> None:
        """Unload the model once the agent no longer holds its package (module docstring), or once the agent
        answers again after failing the model (it died or restarted under it), and wait for the package to load
        it afresh. A package folder beside the agent needs no wait: a model the agent failed is loaded afresh at
        once (from the agent if it answers, else from the folder); before, the worker stayed failed for good."""
        from pipecast.agent.local_client import LocalAgentClient

        client, refused = None, False  # said so once an outage: an agent gone for hours would fill the log
        try:
            while not self._closing:
                await asyncio.sleep(FOLLOW_AGENT_S)
                if self._model is None or self._model.origin != SOURCE_AGENT:  # the disk cache's stays
                    continue
                if not self._follows_agent():  # its folder beside the agent
                    if _failed_by_agent(self._model) and time.monotonic() - self._reloaded_at >= AGENT_RELOAD_MIN_S:
                        self._reloaded_at = time.monotonic()
                        log.warning("the agent failed the model: loading the package afresh (from the agent if it "
                                    "answers, else from its folder)")
                        await self._unload("failed with its agent: loading it afresh", wait=False)
                    continue
                try:
                    client = client or LocalAgentClient(self.config.agent)
                    status = await asyncio.to_thread(client.status)
                except (OSError, PipecastError) as exc:
                    log.log(logging.DEBUG if refused else logging.WARNING,
                            "cannot ask the agent whether it still holds the package: %s", exc)
                    client, refused = None, True
                    continue
                refused = False
                if self._model is not None and self.package_id not in status.get("packages", {}):
                    await self._unload("is no longer held by this node's agent (released, or the agent restarted)")
                elif (self._model is not None and _failed_by_agent(self._model)
                      and time.monotonic() - self._reloaded_at >= AGENT_RELOAD_MIN_S):
                    self._reloaded_at = time.monotonic()
                    log.warning("the agent answers again after failing the model (it restarted?): loading the "
                                "package afresh from it")
                    await self._unload("failed with its agent, which answers again: loading it afresh")
        finally:
            if client is not None:
                client.close()

    async def _unload(self, why: str = "was released from this node", wait: bool = True) -> None:
        """Take no more requests for the package (``why``: what the requests meanwhile are told), let those running
        finish (RELEASE_DRAIN_S at most; the agent's memory under the model stays mapped until it is closed), then
        close the model and wait for the package to load it again (unless not to ``wait``: from a folder). Running
        means the model's own requests and the live pipelined sessions it holds for other heads: cut, those fail
        mid-stream, where the router cannot retry them; their calls are still served, new sessions are refused."""
        if self._model is None:  # unloaded already: the follower and a drop seen while loading may both start one
            return
        runner = self._head.runner if self._head is not None else None
        if runner is not None:
            self._released_runners.append(runner)
        model, self._model, self._codec, self._head = self._model, None, None, None
        # The model's failure (its agent's) is not the worker's now: it waits for the package, as health says.
        self._released, self._unloaded_why, self._error, self._stage = True, why, None, STAGE_WAITING
        self.metrics.load_seconds.set(0)
        log.info("package %s %s: model unloaded once its %d running request(s) end, waiting for the package to "
                 "come back", model.engine.provider.manifest.package_id[:12], why, self._running_on_model)
        self._notify()
        # On a GPU the weights are copies: a model loaded while the one before still drains its requests (up to
        # RELEASE_DRAIN_S) would hold the memory twice, and a model over half the GPU would fail for good.
        closed = threading.Event() if self.config.device != "cpu" else None
        threading.Thread(target=self._load, args=(True, wait, closed), name="pipecast-serve-load", daemon=True).start()
        deadline = time.monotonic() + RELEASE_DRAIN_S
        sessions = runner.live_sessions if runner is not None else (lambda: 0)
        try:
            # A drain meanwhile (SIGTERM) waits for them too (drain_within); the worker's close cancels this wait.
            while (self._running_on_model or sessions()) and time.monotonic() < deadline:
                await asyncio.sleep(RELEASE_DRAIN_POLL_S)
        finally:  # also when the worker closes meanwhile (the follower is cancelled): the model must close
            if self._running_on_model or sessions():
                log.warning("closing the released model with %d request(s) and %d pipelined session(s) still "
                            "running", self._running_on_model, sessions())
            if runner is not None:
                self._released_runners.remove(runner)
            threading.Thread(target=_close, args=(model, closed), name="pipecast-serve-unload", daemon=True).start()

    def _post(self, callback, *args) -> None:
        """Run ``callback(*args)`` on the worker's event loop (from the loader threads)."""
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: the worker has stopped
            pass

    def _notify(self) -> None:
        self._change.set()
        self._change = asyncio.Event()

    def _set_stage(self, stage: str) -> None:
        self._stage = stage
        self._notify()

    def _set_model(self, model: LoadedModel) -> None:
        if self._closing:  # shut down while loading: nobody will serve this model
            threading.Thread(target=model.close, daemon=True).start()
            return
        self._model = model
        self._head = PipelineHead(EngineStageRunner(model.engine), self.stage_client, self.stage_queue,
                                  step_timeout_s=self.config.pipeline_step_timeout_s,
                                  local=model.engine.submit, dissolve=self.config.pipeline_dissolve,
                                  cpus=cpu_limit(), package_id=model.engine.provider.manifest.package_id)
        self._released, self._error = False, None  # a failure was the model's before, released since
        self._stage = STAGE_LOADING
        model.engine.model.add_listener(lambda: self._post(self._on_model_change))
        self._on_model_change()
        p = model.engine.provider
        log.info("serving %s (package %s, %d blocks) from %s; %s", self.model_name, p.manifest.package_id[:12],
                 p.num_blocks, p.origin, "waiting for the full model before each request" if
                 self.config.wait_full_load else "requests run while blocks arrive")

    def _set_codec(self, codec: TextCodec, model: LoadedModel) -> None:
        if model is not self._model:  # read for a model unloaded since (released meanwhile)
            return
        self._codec = codec
        self._notify()

    def _set_error(self, message: str, model: "LoadedModel | None" = None) -> None:
        """Fail the worker; ``model``: the loading thread's (None before it had one). A model unloaded since
        (released) is no failure of the worker's, and a model that failed reports its own error (or its
        release) in _on_model_change."""
        if model is not None and (model is not self._model or model.engine.model.failed):
            log.info("ignored, for a model failed or unloaded since: %s", message)
            return
        self._error = message
        self._stage = STAGE_FAILED
        self._notify()

    def _on_model_change(self) -> None:
        if self._model is None:  # a change of a model unloaded since
            return
        engine = self._model.engine
        if engine.model.failed and self._error is None:
            try:
                engine.model.check_failed()
            except EngineError as exc:
                if _dropped(exc):  # released while loading: as the follower unloads a released model
                    unloading = asyncio.ensure_future(self._unload())
                    self._unloading.add(unloading)  # each cancelled by close(): one may outlive the next model
                    unloading.add_done_callback(self._unloading.discard)
                    return
                self._set_error(str(exc))
        if engine.model.fully_loaded and self._stage == STAGE_LOADING:
            self._stage = STAGE_LOADED
            seconds = time.monotonic() - self._load_started
            self.metrics.load_seconds.set(seconds)
            log.info("model fully loaded %.3f s after %s", seconds,
                     "the package came back" if self._load_started > self.started_at else "the worker started")
        self._notify()

    def drain(self) -> None:
        """Stop admitting requests (503) and fail those still waiting for the model; running ones go on."""
        self._closing = True
        self._codec_wanted.set()  # a loading thread waiting for it ends
        self._stage = STAGE_DRAINING
        if self._change is not None:
            self._notify()

    async def drain_within(self, timeout: float) -> None:
        """:meth:`drain`, then wait until nothing runs here, at most ``timeout`` seconds: no request that came before
        the drain (:meth:`request`: answered to its last byte), none on the model, and no live pipelined session held
        for another head (a stage's requests are its heads' streams: cut, they fail mid-stream where the router
        cannot retry them; one whose head left without closing it is not waited for). The server keeps listening
        meanwhile (the stages' calls come as new requests); it cuts what is left after."""
        self.drain()
        deadline = time.monotonic() + timeout
        while self._requests or self._running_on_model or self._live_sessions():
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("drain: %d request(s) and %d pipelined session(s) still running after %g s; cut",
                            max(self._requests, self._running_on_model), self._live_sessions(), timeout)
                return
            await asyncio.sleep(min(DRAIN_POLL_S, left))

    async def close(self) -> None:
        """Stop the engine (requests still running fail) and release the agent's blocks."""
        self.drain()
        for task in (self._follower, self._expirer):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        while self._unloading:  # one may begin while the others are awaited (a drop seen while loading)
            tasks = list(self._unloading)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._unloading.difference_update(tasks)
        if self._model is not None:
            await asyncio.to_thread(self._model.close)
        self.stage_queue.close()
        await self.stage_client.aclose()

    # --- state ---------------------------------------------------------------------------------------

    @property
    def model_name(self) -> str | None:
        """The name requests use: the configured one, else the package's model name (None until known)."""
        if self.config.model_name:
            return self.config.model_name
        if self._model is None:
            return None
        manifest = self._model.engine.provider.manifest
        return manifest.model_name or manifest.package_id

    @property
    def package_id(self) -> str | None:
        """The package's id once its manifest is in (requests may name the model by it)."""
        return self._model.engine.provider.manifest.package_id if self._model is not None else None

    @property
    def running(self) -> int:
        """Requests in the engine's batch (not those this worker heads through a pipeline: found in review, they
        counted, so an idle engine showed a full batch and a queue, and refused requests as queue_full; those moved
        to it off a dissolving pipeline, yes)."""
        return min(self._on_engine, self.config.max_batch)

    @property
    def _on_engine(self) -> int:
        return self._submitted + (self._head.on_engine if self._head is not None else 0)

    @property
    def _running_on_model(self) -> int:
        """Requests that need the model: in its engine, or through a pipeline whose head stage it runs."""
        return self._submitted + self._pipelined

    @property
    def queue_depth(self) -> int:
        """Requests admitted and waiting: for the model, or for a batch slot."""
        return self._held + max(self._on_engine - self.config.max_batch, 0)

    def health(self) -> WorkerHealth:
        """The state now (see the module docstring for the statuses)."""
        present = total = 0
        error = self._failure()
        if self._closing:
            status = "draining"
        elif error is not None:
            status = "failed"
        elif self._model is None:
            status = "loading"
        else:
            progress = self._model.progress()
            present, total = progress.blocks_present, progress.blocks_total
            if progress.fully_loaded:
                status = "ready"
            elif self.config.wait_full_load or not self._model.engine.model.is_ready(EMBED):
                status = "loading"
            else:
                status = "partial"
        return WorkerHealth(status=status, blocks_present=present, blocks_total=total,
                            queue_depth=self.queue_depth, running=self.running, max_queue=self.config.max_queue,
                            max_batch=self.config.max_batch,
                            pipeline_sessions=sum(runner.sessions for runner in self._runners()),
                            pipeline_moved=self._head.moved if self._head is not None else 0,
                            pipeline_kept=self._head.kept if self._head is not None else 0,
                            stage=self._stage, model=self.model_name,
                            package_id=self.package_id, error=error,
                            steps=self._model.engine.steps % MAX_COUNT if self._model is not None else 0)

    def _failure(self) -> str | None:
        """Why the worker cannot serve: its model failed, or its engine stopped (its thread died, or its device
        fails every step): it would answer every request with an error, and look ready to the router."""
        if self._error is None and self._model is not None:
            return self._model.engine.failure
        return self._error

    # --- requests ------------------------------------------------------------------------------------

    def _check_open(self, admitted: bool = False) -> None:
        """Raise unless the worker takes requests: it drains (but for one ``admitted`` before the drain began), or
        its model is not in (:meth:`_check_model`)."""
        if self._closing and not admitted:
            raise WorkerClosingError()
        self._check_model()

    def _check_model(self) -> None:
        """Raise unless the model is in and can serve (released, or failed: 503)."""
        if self._released:
            raise self._unloaded_error()
        if (error := self._failure()) is not None:
            raise ModelUnavailableError(error)

    def _unloaded_error(self) -> ModelUnavailableError:
        """What a request is told while the package's model is unloaded (released), or was cut as it closed."""
        return ModelUnavailableError(f"package {self.config.package} {self._unloaded_why}; the worker waits for it to "
                                     "come back")

    def _served_error(self, exc: EngineError) -> ServeError:
        """The HTTP-level error of an engine failure: 503 when the model or the worker is gone, else 500."""
        if isinstance(exc, EngineClosedError):
            # An engine closes as the worker shuts down, or as an unload (a release) closes its model, RELEASE_DRAIN_S
            # after it at most: found in review, the requests then cut were told the worker shuts down, though it waits
            # for its package (which may be back already: a model loaded on the CPU does not wait for the one before).
            return WorkerClosingError() if self._closing else self._unloaded_error()
        if isinstance(exc, ModelLoadError | DeviceFaultError):  # the worker cannot serve: another one may
            return ModelUnavailableError(str(exc))
        return ServeError(str(exc))

    async def _wait_servable(self, whole: bool, admitted: bool = False) -> None:
        """Until the model (with ``whole`` and ``wait_full_load``, the whole model) and its tokenizer are in. A drain
        fails a request still waiting for them, even one ``admitted`` before it began."""
        while True:
            ready = self._codec is not None and (not (whole and self.config.wait_full_load)
                                                 or self._model.fully_loaded.is_set())
            self._check_open(admitted and ready)
            if ready:
                return
            if self._codec is None:
                self._codec_wanted.set()
            await self._change.wait()

    async def generate(self, request: CompletionRequest, route: "tuple[Hop, ...] | None" = None, *,
                       admitted: bool = False) -> "Generation":
        """Admit ``request``, wait for the model, and start generating: here, or as the head stage of the
        cross-node pipeline ``route`` (:mod:`pipecast.serve.pipeline`; its first token is in when this
        returns, so a failing stage fails the call, before any answer). A request ``admitted`` before a drain
        began (:meth:`request`) is served while the worker drains, if its model is in.

        Raises :class:`WorkerBusyError` (queue full), :class:`ModelNotServedError`,
        :class:`RequestFieldError` (a prompt the model cannot take, a route it cannot head),
        :class:`ModelUnavailableError`, :class:`StageFailedError`, :class:`StageBusyError` (a stage without room)
        or :class:`WorkerClosingError`. The
        returned generation must be closed (``async with``).
        """
        arrived = time.monotonic()
        self._check_open(admitted)
        if self.queue_depth >= self.config.max_queue:
            raise WorkerBusyError(self.queue_depth, self.config.retry_after_s)
        self._held += 1
        held = True
        try:
            # A request through a pipeline needs of this worker only the stage it heads, which waits for its own
            # layers: waiting for the whole model here (wait_full_load) would give the pipeline nothing to do.
            await self._wait_servable(whole=route is None, admitted=admitted)
            if request.model not in (self.model_name, self.package_id):
                raise ModelNotServedError(request.model, self.model_name)
            codec = self._codec  # kept: released and back while the prompt is tokenized, the worker has none a while
            prompt = await self._prompt_ids(request)
            # Released while the prompt was tokenized (the scaler took this replica as idle): 503, which the
            # router retries elsewhere, not an AttributeError on the model gone meanwhile.
            self._check_open(admitted)
            if request.max_tokens is None:  # a chat request without a limit: what the positions leave
                request = replace(request, max_tokens=self._room(len(prompt)))
            stop_ids = self._stop_token_ids(codec)
            if route is not None:
                # Its prompt runs through the stages now (up to their step deadline while layers arrive): no longer
                # in this worker's queue, where it refused the idle engine's requests as queue_full, but on the model
                # (a release's drain waits for it).
                self._held, held = self._held - 1, False
                self._pipelined += 1
                try:
                    stream = await self._start_pipeline(route, prompt, request, stop_ids)
                    # Released while the prompt ran through the stages: the model its stream runs on closes. Not
                    # when the worker drains: its drain waits for this request, which has its first token.
                    try:
                        self._check_model()
                    except ServeError:
                        stream.cancel()
                        raise
                except BaseException:
                    self._pipelined -= 1
                    raise
        finally:
            if held:
                self._held -= 1
        if route is None:
            stream = self._submit(prompt, request, stop_ids)
            self._submitted += 1
        self.metrics.prompt_tokens.inc(len(prompt))
        return Generation(self, stream, prompt, CompletionText(codec, prompt, request.stop, stop_ids), arrived,
                          pipelined=route is not None)

    def _stop_token_ids(self, codec: TextCodec) -> frozenset[int]:
        """The tokens that end a generation: the model's EOS ids and its tokenizer's eos_token, which a
        package may set apart from them (vLLM stops at both)."""
        eos = codec.tokenizer.eos_token_id
        return self._model.stop_token_ids | ({eos} if eos is not None else set())

    def _submit(self, prompt: list[int], request: CompletionRequest, stop_ids: frozenset[int]) -> TokenStream:
        """Hand the prompt to this worker's engine."""
        try:
            return self._model.submit(prompt, max_new_tokens=request.max_tokens, temperature=request.temperature,
                                      top_p=request.top_p, seed=request.seed, stop_token_ids=stop_ids)
        except InvalidRequestError as exc:
            raise RequestFieldError("prompt", str(exc)) from None
        except EngineOverloadedError as exc:
            raise WorkerBusyError(exc.waiting, self.config.retry_after_s) from None
        except EngineError as exc:
            raise self._served_error(exc) from None

    async def _start_pipeline(self, route: "tuple[Hop, ...]", prompt: list[int], request: CompletionRequest,
                              stop_ids: frozenset[int]) -> TokenStream:
        from pipecast.engine.sampling import SamplingParams

        layers = self._model.engine.model.num_layers
        if route[-1].layers.stop != layers:
            raise RequestFieldError(PIPELINE_HEADER, f"the route runs layers 0-{route[-1].layers.stop - 1}, the "
                                                     f"model has {layers}")
        try:
            params = SamplingParams(max_tokens=request.max_tokens, temperature=request.temperature,
                                    top_p=request.top_p, seed=request.seed,
                                    stop_token_ids=stop_ids)
        except InvalidRequestError as exc:
            raise RequestFieldError(None, str(exc)) from None
        try:  # as the engine checks a prompt it runs itself: the stages would fail on it (a 503 for the route)
            self._model.engine.check_prompt(prompt, params)
        except InvalidRequestError as exc:
            raise RequestFieldError("prompt", str(exc)) from None
        try:
            return await self._head.start(route, prompt, params)
        except EngineClosedError as exc:  # its own stage's model closed under it: no failed stage
            raise self._served_error(exc) from None

    def _runners(self) -> list[EngineStageRunner]:
        """The stage runners with sessions: the model's, then those of released models still closing."""
        return [*([self._head.runner] if self._head is not None else []), *self._released_runners]

    def _live_sessions(self) -> int:
        return sum(runner.live_sessions() for runner in self._runners())

    def _holding(self, session: str | None) -> EngineStageRunner | None:
        """The runner that holds ``session``, if one does."""
        return next((r for r in self._runners() if session is not None and r.holds(session)), None)

    def called_back(self, session: str, url: str) -> bool:
        """Whether a stage call of ``session`` came to this worker, at ``url``, from a pipelined request it heads (its
        route names this worker twice): refused, the request fails as the route's fault, not a stage's
        (:meth:`PipelineHead.called_back`)."""
        return self._head is not None and self._head.called_back(session, url)

    def stage_runner(self, session: str | None = None, admitted: bool = False) -> EngineStageRunner:
        """The runner of this worker's pipeline stages; :class:`ModelUnavailableError` while no model is in. While
        the worker drains, only for a call ``admitted`` before the drain began, or one that continues ``session``, a
        session it holds (a pipelined request under way through it: :meth:`drain_within` waits for both); a new
        one is refused as any new request is. A call continuing a session that a released model's runner holds
        gets that runner (:meth:`_unload` waits for its sessions before the model closes)."""
        holder = self._holding(session)
        if holder is not None and holder is not (self._head.runner if self._head is not None else None):
            return holder
        if not (self._closing and (admitted or holder is not None)):
            self._check_open()
        if self._head is None:
            raise ModelUnavailableError("this worker has no model yet (its package's manifest has not arrived)")
        return self._head.runner

    async def wait_stage_runner(self, timeout: float, session: str | None = None,
                                admitted: bool = False) -> EngineStageRunner:
        """:meth:`stage_runner` (for a call of ``session``, ``admitted`` or not), waiting up to ``timeout`` seconds
        for the model (a stage may be called while its worker starts); TimeoutError beyond."""
        try:
            async with asyncio.timeout(timeout):
                while self._head is None and self._holding(session) is None:
                    self._check_open()
                    await self._change.wait()
        except TimeoutError:
            raise TimeoutError(f"this worker's model did not start loading within {timeout:.3g} s") from None
        return self.stage_runner(session, admitted)

    @contextmanager
    def request(self) -> Iterator[bool]:
        """Around a request this worker serves (a completion, a stage call): whether it came before a drain began.
        Such a request is counted while its handler runs, so that the drain waits for it to end, its answer's last
        bytes written, and a stage call among them is admitted (:meth:`stage_runner`) though its session opens after
        (a prefill waiting for its layers or its turn); one that came after is neither (a stalled body would hold
        the drain)."""
        if self._closing:
            yield False
            return
        self._requests += 1
        try:
            yield True
        finally:
            self._requests -= 1

    def forget_stage_session(self, session: str | None) -> None:
        """Drop a pipelined session's state here (its request ended or failed further down)."""
        if (runner := self._holding(session)) is not None:
            runner.close(session)

    def _room(self, prompt_tokens: int) -> int:
        """Tokens a request may generate after ``prompt_tokens``: what the model's positions leave, at most
        :data:`UNBOUNDED_MAX_TOKENS`."""
        positions = getattr(self._model.engine.model.config, "max_position_embeddings", None)
        return min(positions - prompt_tokens, UNBOUNDED_MAX_TOKENS) if positions else UNBOUNDED_MAX_TOKENS

    async def _prompt_ids(self, request: CompletionRequest) -> list[int]:
        """The prompt's token ids (a chat's messages through the model's chat template), refused with
        :class:`RequestFieldError` as soon as it cannot fit."""
        positions = getattr(self._model.engine.model.config, "max_position_embeddings", None)
        field = "messages" if request.chat else "prompt"
        wanted = request.max_tokens or 1

        def check(tokens: int, size: str) -> None:
            if positions and tokens + wanted > positions:
                # The engine's own words for the same refusal (it checks again, in time linear in the prompt); the
                # field to change is the prompt only where it leaves no room for one token.
                blamed = field if tokens >= positions else request.max_tokens_field
                raise RequestFieldError(blamed, f"prompt of {size} plus max_tokens {wanted} "
                                                f"exceeds the model's {positions} positions")

        prompt = request.prompt
        if request.chat:
            least = sum(self._codec.min_tokens(m.content) for m in prompt)
            check(least, f"{sum(len(m.content) for m in prompt)} characters of messages (at least {least} tokens)")
            ids = await asyncio.to_thread(self._codec.chat_ids, prompt)
            check(len(ids), f"{len(ids)} tokens")
            return ids
        if isinstance(prompt, tuple):
            check(len(prompt), f"{len(prompt)} tokens")
            return list(prompt)
        least = self._codec.min_tokens(prompt)
        check(least, f"{len(prompt)} characters (at least {least} tokens)")
        if len(prompt) <= INLINE_TOKENIZE_CHARS:
            ids = self._codec.encode(prompt)
        else:
            ids = await asyncio.to_thread(self._codec.encode, prompt)
        check(len(ids), f"{len(ids)} tokens")
        return ids

    def _finished(self, pipelined: bool) -> None:
        if pipelined:
            self._pipelined -= 1
        else:
            self._submitted -= 1


def _ask_serving_key(agent: Path | str, timeout_s: float) -> bytes:
    """The serving key the agent at socket ``agent`` gives (blocking)."""
    from pipecast.agent.local_client import LocalAgentClient

    with LocalAgentClient(agent) as client:
        return client.serving_key(timeout=timeout_s)


def _dropped(exc: BaseException) -> bool:
    """Whether ``exc`` comes of the agent dropping the package (the loader's wait ended so), along its causes."""
    return _caused_by(exc, PackageDroppedError)


def _close(model: LoadedModel, closed: threading.Event | None) -> None:
    """Close ``model``, then set ``closed`` (a load waiting for its memory), whatever the close raised."""
    try:
        model.close()
    finally:
        if closed is not None:
            closed.set()


def _failed_by_agent(model: LoadedModel) -> bool:
    """Whether ``model`` failed through its agent's local API (its connection or its answers), not by itself."""
    try:
        model.engine.model.check_failed()
    except EngineError as exc:
        return _caused_by(exc, LocalApiError)
    return False


def _caused_by(exc: BaseException | None, kind: type[BaseException]) -> bool:
    """Whether ``exc`` or one of its causes is a ``kind``."""
    while exc is not None:
        if isinstance(exc, kind):
            return True
        exc = exc.__cause__
    return False


class Generation:
    """One running completion: iterate for its :class:`Piece` s; closing it cancels what is left."""

    def __init__(self, worker: ServingWorker, stream: TokenStream, prompt: list[int], text: CompletionText,
                 arrived: float, *, pipelined: bool = False) -> None:
        self.request_id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = worker.model_name
        self.prompt_tokens = len(prompt)
        self.completion_tokens = 0
        self._worker = worker
        self._stream = stream
        self._text = text
        self._arrived = arrived
        self._pipelined = pipelined
        self._open = True
        self._counted = True  # by the worker, as running or queued (see _release)
        # Its tokens all made, the request holds no slot of the engine's: the stream buffers them, however slowly the
        # client reads them. Counted until its answer was written, an idle worker refused requests as queue_full.
        stream.add_done_callback(lambda: worker._post(self._release))

    async def __aenter__(self) -> "Generation":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Cancel the request in the engine if it is still generating (e.g. the client went away)."""
        if self._open:
            self._open = False
            if not self._stream.done:
                self._stream.cancel()
            self._release()

    def _release(self) -> None:
        """Give the request's place back to the worker, once: as its stream ends, or as it is closed before."""
        if self._counted:
            self._counted = False
            self._worker._finished(self._pipelined)

    async def __aiter__(self) -> AsyncIterator[Piece]:
        metrics = self._worker.metrics
        try:
            async for token in self._stream:
                if self.completion_tokens == 0:
                    metrics.ttft.observe(time.monotonic() - self._arrived)
                self.completion_tokens += 1
                metrics.token()
                text = self._text.add(token)
                if self._text.stopped:
                    self.close()
                    yield Piece(text, (token,), FINISH_STOP)
                    return
                yield Piece(text, (token,))
        except EngineError as exc:
            raise self._worker._served_error(exc) from None
        rest = self._text.finish()  # first: its last characters may hold a stop string
        reason = FINISH_STOP if self._stream.finish_reason == FINISH_STOP or self._text.stopped else FINISH_LENGTH
        yield Piece(rest, (), reason)

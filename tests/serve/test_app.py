"""The serving worker: OpenAI completions over the execute-while-load engine, health while blocks arrive,
admission control, cancellation, graceful shutdown, and the real ``openai`` client against a worker process.

Servers run in-process on loopback (one torch import for the module) except the one test of the
``pipecast serve`` process itself.
"""

import asyncio
import http.client
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp import web

from packager.pack import pack
import pipecast
from pipecast.agent.errors import LocalApiError, LocalApiTimeoutError, PackageDroppedError
from pipecast.engine.errors import BlockBindError, EngineClosedError, ModelLoadError
from pipecast.serve import app as app_module
from pipecast.serve.app import build_app
from pipecast.serve.errors import ModelUnavailableError, RequestFieldError
from pipecast.serve.metrics import RateMeter
from pipecast.serve.openai_api import ChatMessage, CompletionRequest, parse_chat_request, parse_completion_request
from pipecast.serve.pipeline import PIPELINE_HEADER, Hop, route_header
from pipecast.serve.text import MAX_HELD_TOKENS, CompletionText, IncrementalDetokenizer, StopMatcher, TextCodec
from pipecast.serve import worker as worker_module
from pipecast.serve.worker import CODEC_BLOCKS_LEFT, CODEC_POLL_S, ServingWorker, WorkerConfig, codec_blocks_left
from tests.router.test_app import eventually
from tests.support import packages
from tests.core.test_httpserve import stalled_body_answer
from tests.support.engine_fixtures import GatedAgent, random_prompt

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_configured_agent")]

MODEL = "tiny-llama"
PROMPT = random_prompt(10, 3)
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=30)


@pytest.fixture(scope="module")
def pkg(tmp_path_factory) -> Path:
    """A tiny llama package (4 blocks of one layer each) with a byte-level tokenizer."""
    return packages.tiny_package(tmp_path_factory.mktemp("serve") / "pkg", seed=4, tokenizer=True).path


@pytest.fixture(scope="module")
def reference(pkg):
    """The engine's own greedy tokens: ``reference(prompt, max_tokens)``."""
    with pipecast.load(pkg) as model:
        yield lambda prompt, n: model.generate(prompt, max_new_tokens=n, timeout=30)


@pytest.fixture(scope="module")
def codec(pkg) -> TextCodec:
    return TextCodec.from_files(lambda name: (pkg / name).read_bytes(), ["tokenizer.json", "tokenizer_config.json"],
                                "test package")


@asynccontextmanager
async def serving(config: WorkerConfig, **app_options):
    """A worker served on loopback as `pipecast serve` serves it (``app_options``: build_app's): (base URL, worker,
    runner, a client session)."""
    worker = ServingWorker(config)
    runner = web.AppRunner(build_app(worker, **app_options), handler_cancellation=True, shutdown_timeout=10)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
            yield f"http://{host}:{port}", worker, runner, http
    finally:
        if runner.server is not None:  # a test may have shut it down itself
            await runner.cleanup()


async def health(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(f"{url}/health") as response:
        return await response.json()


async def wait_health(http: aiohttp.ClientSession, url: str, predicate, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while not predicate(state := await health(http, url)):
        assert time.monotonic() < deadline, f"health never matched; last: {state}"
        await asyncio.sleep(0.01)
    return state


async def wait_until_async(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.01)


async def post(http: aiohttp.ClientSession, url: str, body, path: str = "/v1/completions",
               headers: dict | None = None) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(f"{url}{path}", data=data, headers=headers) as response:
        return response.status, dict(response.headers), await response.json()


async def sse_events(http: aiohttp.ClientSession, url: str, body: dict, path: str = "/v1/completions",
                     headers: dict | None = None) -> list[str]:
    """The ``data:`` payloads of a streamed completion, in order."""
    async with http.post(f"{url}{path}", json=body, headers=headers) as response:
        assert response.status == 200 and response.headers["Content-Type"] == "text/event-stream"
        text = (await response.read()).decode()
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events), text
    return [e[len("data: "):] for e in events]


def body(**fields) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "return_token_ids": True,
            **fields}


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


# --- over HTTP, in-process ---------------------------------------------------------------------------


async def test_json_and_streamed_completions_give_the_engines_greedy_tokens(pkg, reference, codec):
    expected = reference(PROMPT, 12)
    async with serving(WorkerConfig(str(pkg))) as (url, worker, _, http):
        status, _, whole = await post(http, url, body())
        assert status == 200
        choice = whole["choices"][0]
        assert choice["token_ids"] == expected
        assert choice["finish_reason"] == ("length" if len(expected) == 12 else "stop")
        assert whole["usage"] == {"prompt_tokens": 10, "completion_tokens": len(expected),
                                  "total_tokens": 10 + len(expected)}
        assert whole["object"] == "text_completion" and whole["model"] == MODEL

        events = await sse_events(http, url, body(stream=True, stream_options={"include_usage": True}))
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        *pieces, usage = chunks
        assert [t for c in pieces for t in c["choices"][0]["token_ids"]] == expected
        assert "".join(c["choices"][0]["text"] for c in pieces) == choice["text"]
        assert [c["choices"][0]["finish_reason"] for c in pieces] == [None] * (len(pieces) - 1) + [
            choice["finish_reason"]]
        assert usage["choices"] == [] and usage["usage"] == whole["usage"]

        # A text prompt goes through the package's tokenizer (bytes here), the token ids stay out by default.
        status, _, answer = await post(http, url, body(prompt="Hello", return_token_ids=False))
        assert status == 200 and "token_ids" not in answer["choices"][0]
        assert answer["choices"][0]["text"] == codec.decode(reference(list(b"Hello"), 12))

        async with http.get(f"{url}/v1/models") as response:
            assert [m["id"] for m in (await response.json())["data"]] == [MODEL]
        async with http.get(f"{url}/metrics") as response:
            page = await response.text()
        assert metric(page, "pipecast_serve_ttft_seconds_count") == 3
        assert metric(page, 'pipecast_serve_requests_total{outcome="ok"}') == 3
        assert metric(page, "pipecast_serve_generated_tokens_total") == 2 * len(expected) + answer["usage"][
            "completion_tokens"]


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]


async def test_chat_completions_render_the_packages_template_and_give_the_engines_greedy_tokens(pkg, reference):
    # The tiny package's template (benchmarks/tiny_checkpoints.py): <|role|>content per message, then the
    # assistant's turn; its byte-level tokenizer makes each byte a token.
    rendered = list(b"<|system|>Be brief.\n<|user|>Hi\n<|assistant|>")
    expected = reference(rendered, 12)
    chat = {"model": MODEL, "messages": CHAT, "max_completion_tokens": 12, "temperature": 0, "return_token_ids": True}
    async with serving(WorkerConfig(str(pkg))) as (url, _, _, http):
        status, _, whole = await post(http, url, chat, "/v1/chat/completions")
        assert status == 200, whole
        choice = whole["choices"][0]
        assert whole["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
        assert choice["token_ids"] == expected and whole["usage"]["prompt_tokens"] == len(rendered)

        events = await sse_events(http, url, {**chat, "stream": True, "stream_options": {"include_usage": True}},
                                  "/v1/chat/completions")
        *pieces, usage = [json.loads(e) for e in events[:-1]]
        assert {c["object"] for c in pieces} == {"chat.completion.chunk"}
        assert pieces[0]["choices"][0]["delta"]["role"] == "assistant"
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in pieces) == choice["message"]["content"]
        assert [t for c in pieces for t in c["choices"][0]["token_ids"]] == expected
        assert usage["choices"] == [] and usage["usage"] == whole["usage"]

        # No limit given: as many tokens as the model's positions leave (the engine stops at EOS or there).
        status, _, unbounded = await post(http, url, {**chat, "max_completion_tokens": None}, "/v1/chat/completions")
        assert status == 200 and unbounded["usage"]["completion_tokens"] >= len(expected)
        for bad, field in (({"messages": [{"role": "tool", "content": "x"}]}, "messages"),  # the template refuses
                           ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0]"),
                           ({"tools": [{"type": "function"}]}, "tools")):
            status, _, error = await post(http, url, {**chat, **bad}, "/v1/chat/completions")
            assert status == 400 and error["error"]["param"] == field, error


def here_and_heading_a_pipeline(url: str) -> tuple[dict, dict]:
    """Request headers for a worker's own engine, and for a pipeline of one stage it heads (the tiny 4 layers)."""
    return {}, {PIPELINE_HEADER: route_header([Hop(url, range(4))])}


async def test_the_stop_token_ending_a_generation_is_counted_but_its_text_left_out(pkg, codec):
    """The tiny package's EOS (generation_config.json's 2) is no special token of its byte-level tokenizer: its
    text, "\\x02", ended the answer, whole and streamed. vLLM leaves it out, its id kept in token_ids and usage."""
    eos = json.loads((pkg / "generation_config.json").read_text())["eos_token_id"]
    sampled = body(prompt="Hello world", max_tokens=100, temperature=1.0, seed=8)  # this seed's tokens end at EOS
    async with serving(WorkerConfig(str(pkg))) as (url, _, _, http):
        for headers in here_and_heading_a_pipeline(url):
            status, _, whole = await post(http, url, sampled, headers=headers)
            choice = whole["choices"][0]
            assert status == 200 and choice["finish_reason"] == "stop" and choice["token_ids"][-1] == eos, whole
            assert whole["usage"]["completion_tokens"] == len(choice["token_ids"])
            assert choice["text"] == codec.decode(choice["token_ids"][:-1]) and chr(eos) not in choice["text"]
            events = await sse_events(http, url, {**sampled, "stream": True}, headers=headers)
            pieces = [json.loads(e)["choices"][0] for e in events[:-1]]
            assert [t for p in pieces for t in p["token_ids"]] == choice["token_ids"]
            assert "".join(p["text"] for p in pieces) == choice["text"]


async def test_the_tokenizers_eos_token_ends_a_generation_too(pkg, reference, codec, tmp_path):
    """A package whose tokenizer_config.json names an eos_token apart from generation_config.json's
    eos_token_id: generation went on past it. vLLM stops at both."""
    first = reference(list(b"Hello"), 1)[0]  # made the tokenizer's EOS: greedy decoding stops at once
    assert first != json.loads((pkg / "generation_config.json").read_text())["eos_token_id"]
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(pkg.parent / f"{pkg.name}-checkpoint", checkpoint)
    config = checkpoint / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()),
                                  "eos_token": codec.tokenizer.convert_ids_to_tokens(first)}))
    pack(checkpoint, tmp_path / "pkg", model_name=MODEL)
    async with serving(WorkerConfig(str(tmp_path / "pkg"))) as (url, _, _, http):
        for headers in here_and_heading_a_pipeline(url):
            status, _, whole = await post(http, url, body(prompt="Hello", max_tokens=8), headers=headers)
            choice = whole["choices"][0]
            assert status == 200 and choice["token_ids"] == [first] and choice["finish_reason"] == "stop", whole
            assert choice["text"] == "" and whole["usage"]["completion_tokens"] == 1


async def test_health_goes_loading_partial_ready_as_blocks_arrive_and_the_prompt_runs_meanwhile(pkg, reference):
    agent = GatedAgent(pkg)
    async with serving(WorkerConfig(str(pkg), agent=agent)) as (url, worker, _, http):
        state = await wait_health(http, url, lambda h: h["blocks_total"] == 4)
        assert state["status"] == "loading" and state["blocks_present"] == 0
        request = asyncio.create_task(sse_events(http, url, body(stream=True)))
        await wait_health(http, url, lambda h: h["running"] == 1)
        agent.release(0)
        # Partial as soon as the embeddings are bound, which can be before the rest of block 0 is.
        await wait_health(http, url, lambda h: h["status"] == "partial")
        await wait_health(http, url, lambda h: h["blocks_present"] == 1)
        agent.release(1, 2)
        state = await wait_health(http, url, lambda h: h["blocks_present"] == 3)
        assert state["status"] == "partial" and state["running"] == 1 and not request.done()
        agent.release(3)
        events = await request
        assert [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]] == reference(PROMPT, 12)
        assert await health(http, url) == {"status": "ready", "blocks_present": 4, "blocks_total": 4,
                                           "queue_depth": 0, "running": 0, "max_queue": 64, "max_batch": 16,
                                           "pipeline_sessions": 0, "pipeline_moved": 0, "pipeline_kept": 0,
                                           "steps": worker._model.engine.steps,
                                           "stage": "loaded", "model": MODEL, "package_id": worker.package_id}


async def test_a_released_package_finishes_the_requests_running_on_it_before_the_model_closes(pkg, reference):
    """The agent dropped the package (the daemon released this replica) while a request runs: new requests
    get 503 at once (the router sends them elsewhere), the running one ends with every token, then the model
    closes. Before, the model closed at once and the request failed ("the worker is shutting down")."""
    agent = GatedAgent(pkg)
    async with serving(WorkerConfig(str(pkg), agent=agent)) as (url, worker, _, http):
        worker._wait_for_package_again = threading.Event().wait  # the package does not come back here
        agent.release(0, 1, 2)
        request = asyncio.create_task(sse_events(http, url, body(stream=True)))
        await wait_health(http, url, lambda h: h["running"] == 1)  # held at the last block's layers
        model = worker._model
        unloading = asyncio.create_task(worker._unload())  # what the agent dropping the package starts
        state = await wait_health(http, url, lambda h: h["stage"] == "waiting_for_package")
        assert state["status"] == "loading"
        status, _, error = await post(http, url, body())
        assert status == 503 and "was released from this node" in error["error"]["message"]
        await asyncio.sleep(0.2)
        assert not request.done() and not unloading.done() and not model.engine._closed
        agent.release(3)
        events = await request
        assert [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]] == reference(PROMPT, 12)
        await asyncio.wait_for(unloading, 10)
        await wait_until_async(lambda: model.engine._closed)


@pytest.mark.parametrize("back", [False, True])
async def test_requests_cut_as_a_released_model_closes_are_told_the_worker_waits_for_its_package(pkg, monkeypatch,
                                                                                                 back):
    """Found in review: requests still running when a released model closed (RELEASE_DRAIN_S after the release)
    were told "the worker is shutting down" (shutting_down), though it waits for its package to come back; so too
    where it came back meanwhile (on the CPU a model loads again before the one released closes)."""
    monkeypatch.setattr(worker_module, "RELEASE_DRAIN_S", 2.0)
    agent = GatedAgent(pkg)
    async with serving(WorkerConfig(str(pkg), agent=agent)) as (url, worker, _, http):
        # The package comes back at once, or not here.
        worker._wait_for_package_again = (lambda: None) if back else threading.Event().wait
        agent.release(0, 1, 2)
        requests = [asyncio.create_task(post(http, url, body(stream=stream))) for stream in (False, True)]
        await wait_health(http, url, lambda h: h["running"] == 2)  # held at the last block's layers
        unloading = asyncio.create_task(worker._unload())
        if back:
            await wait_until_async(lambda: worker._model is not None)
            assert not unloading.done()  # the model released still drains its requests
        await unloading
        for status, _, answer in await asyncio.gather(*requests):
            assert status == 503 and answer["error"]["code"] == "model_unavailable", answer
            assert answer["error"]["message"] == (f"package {pkg} was released from this node; the worker waits for "
                                                  "it to come back")


class DroppingAgent(GatedAgent):
    """Waits end with PackageDroppedError while the package is dropped, as the agent's local client's do."""

    dropped = False

    def wait_prefix(self, index, nbytes, timeout, package_id=None):
        with self._cond:
            self._cond.wait_for(lambda: self.dropped or self._verified[index] >= nbytes, timeout)
            if self.dropped:
                raise PackageDroppedError(f"agent: package {package_id} was dropped there")
        return super().wait_prefix(index, nbytes, timeout, package_id)

    def drop(self, dropped: bool = True) -> None:
        with self._cond:
            self.dropped = dropped
            self._cond.notify_all()


async def test_a_package_dropped_while_its_model_loads_is_a_release_and_the_model_loads_again(pkg, reference):
    """The loader's wait ends at once with the agent's drop (not at its deadline): the worker waits for the package,
    as for any release, instead of failing for good; back, the model loads again and serves."""
    agent, back = DroppingAgent(pkg), threading.Event()
    async with serving(WorkerConfig(str(pkg), agent=agent)) as (url, worker, _, http):
        worker._wait_for_package_again = lambda: back.wait(30)
        agent.release(0, 1)
        await wait_until_async(lambda: worker._model is not None)
        agent.drop()
        state = await wait_health(http, url, lambda h: h["stage"] == "waiting_for_package")
        assert state["status"] == "loading"
        await worker._unload()  # the follower seeing the drop too: nothing more to unload
        await _comes_back(agent, back, http, url, reference)


async def test_a_worker_started_before_its_scale_up_waits_for_the_package_beyond_the_agent_timeout(
        pkg, reference, tmp_path):
    """Found in review: a worker started (as the README's recipe starts it) more than --agent-timeout before the
    scale-up failed for good (503 "failed") though the package came. It waits, as for a package released and back."""
    from pipecast.agent.local_api import LocalApiServer
    from pipecast.agent.peer_server import PeerServer
    from pipecast.agent.transport.base import PeerAuth
    from tests.support.agent_fixtures import seed_store

    peers, socket_path = PeerServer(), tmp_path / "agent.sock"
    api = LocalApiServer(peers, status=lambda: {"packages": {}}, auth=PeerAuth("test"))
    await api.start(socket_path)
    store = seed_store(pkg)
    package_id = store.package_id
    try:
        config = WorkerConfig(package_id, agent=str(socket_path), agent_timeout_s=0.3)
        async with serving(config) as (url, worker, _, http):
            await wait_health(http, url, lambda h: h["stage"] == "waiting_for_package")
            await asyncio.sleep(1.0)  # over three agent timeouts
            state = await health(http, url)
            assert (state["status"], state["stage"], state.get("error")) == ("loading", "waiting_for_package", None)
            peers.add(store)  # the scale-up: the agent holds the package
            await wait_health(http, url, lambda h: h["status"] == "ready")  # the agent's answer, not REWAIT_S
            status, _, whole = await post(http, url, body())
            assert status == 200 and whole["choices"][0]["token_ids"] == reference(PROMPT, 12)
    finally:
        await api.close()
        store.close()


async def test_a_worker_waiting_for_an_agent_that_is_not_there_says_so_once_not_every_second(tmp_path, monkeypatch,
                                                                                              caplog):
    """Found in review: a worker waiting (as designed, however long) for an agent whose socket does not exist logged
    two warnings every FOLLOW_AGENT_S (33 in 20 s): the package's wait and the serving key's. Each warns once now,
    then says it at debug level."""
    monkeypatch.setattr(worker_module, "FOLLOW_AGENT_S", 0.02)  # many seconds' worth of asking in a moment
    socket_path = tmp_path / "none.sock"
    said = ("waiting for the agent to hold package deadbeefdeadbeef",
            f"cannot ask the agent at {socket_path} for the cluster's serving key")

    def records(message: str, level: int = logging.DEBUG) -> int:
        return sum(r.getMessage().startswith(f"{message}: ") and r.levelno >= level for r in caplog.records)

    worker = ServingWorker(WorkerConfig("deadbeefdeadbeef", agent=socket_path, agent_timeout_s=0.05))
    with caplog.at_level(logging.DEBUG, logger=worker_module.__name__):
        worker.start()
        try:
            await eventually(lambda: all(records(message) >= 10 for message in said), timeout_s=30)
            assert worker.health().stage == "waiting_for_package"
        finally:
            await worker.close()
    assert [records(message, logging.WARNING) for message in said] == [1, 1]


async def test_the_load_seconds_are_those_of_the_last_load_and_0_while_released(pkg, reference):
    """Found in review: a load after a release was timed from the worker's start (a reload of 0.02 s read 5.4 s
    after 5 s at zero replicas), and the gauge kept the last load's figure while no model was loaded."""
    agent, back = DroppingAgent(pkg), threading.Event()
    async with serving(WorkerConfig(str(pkg), agent=agent)) as (url, worker, _, http):

        def load_seconds() -> float:
            return worker.metrics.registry.get_sample_value("pipecast_serve_model_load_seconds")

        worker._wait_for_package_again = lambda: back.wait(30)
        agent.release()
        await wait_health(http, url, lambda h: h["status"] == "ready")
        assert load_seconds() > 0
        agent.drop()
        await worker._unload()
        assert load_seconds() == 0
        await asyncio.sleep(1.0)  # at zero replicas a while
        started = time.monotonic()
        await _comes_back(agent, back, http, url, reference)
        assert 0 < load_seconds() < time.monotonic() - started


async def _comes_back(agent: DroppingAgent, back: threading.Event, http, url: str, reference) -> None:
    """The dropped package held again and every block there: the worker loads it again and serves."""
    agent.drop(False)
    agent.release()
    back.set()
    await wait_health(http, url, lambda h: h["status"] == "ready")
    status, _, answer = await post(http, url, body())
    assert status == 200 and answer["choices"][0]["token_ids"] == reference(PROMPT, 12)


class UnreadableWhenDroppedAgent(DroppingAgent):
    """As the agent: a dropped package's files cannot be read (the real one waits out its timeout for the
    package, then fails). ``gate``, while clear, holds reads begun (``reading`` set) until the test opens it."""

    def __init__(self, pkg: Path) -> None:
        super().__init__(pkg)
        self.gate, self.reading = threading.Event(), threading.Event()
        self.gate.set()
        self.read_dropped = 0

    def package_file(self, path, package_id=None, timeout=30.0):
        self.reading.set()
        self.gate.wait(30)
        if self.dropped:
            self.read_dropped += 1
            raise LocalApiTimeoutError(f"no package {package_id} here within {timeout:g} s")
        return super().package_file(path, package_id, timeout)


async def _dropped_before_its_tokenizer(pkg, reference, reading: bool) -> None:
    """The package is dropped while the worker's model loads, before its tokenizer is read (``reading``: while
    it is read): the worker waits for the package, never fails, and serves once it is back."""
    agent, back = UnreadableWhenDroppedAgent(pkg), threading.Event()
    earlier = set(threading.enumerate())
    async with serving(WorkerConfig(str(pkg), agent=agent)) as (url, worker, _, http):
        worker._wait_for_package_again = lambda: back.wait(30)
        await wait_until_async(lambda: worker._model is not None)  # no block, no request: no tokenizer read yet
        loader, = [t for t in threading.enumerate() if t.name == "pipecast-serve-load" and t not in earlier]
        if reading:
            agent.gate.clear()
            agent.reading.clear()  # load() read config.json from it
            agent.release_prefix(0, 1 << 10)  # the embeddings arriving first: the tokenizer is read now
            assert await asyncio.to_thread(agent.reading.wait, 10)
        agent.drop()
        await wait_health(http, url, lambda h: h["stage"] == "waiting_for_package")
        agent.gate.set()
        await asyncio.to_thread(loader.join, 10)
        assert not loader.is_alive() and agent.read_dropped == (1 if reading else 0)
        state = await health(http, url)  # after what the loader posted on its way out
        assert (state["status"], state["stage"], state.get("error")) == ("loading", "waiting_for_package", None)
        await _comes_back(agent, back, http, url, reference)


async def test_a_package_dropped_before_its_tokenizer_is_read_is_not_read_and_the_worker_waits_not_fails(
        pkg, reference):
    """Before, the loader read the tokenizer from the dropped package anyway; its failure (after the agent's
    timeout) failed the worker, released and waiting for the package: /health 503 "failed" until it came back."""
    await _dropped_before_its_tokenizer(pkg, reference, reading=False)


async def test_a_tokenizer_read_failing_as_its_package_is_dropped_does_not_fail_the_waiting_worker(pkg, reference):
    await _dropped_before_its_tokenizer(pkg, reference, reading=True)


async def test_only_a_model_the_agent_feeds_is_unloaded_when_the_agent_holds_no_package(monkeypatch):
    """A model loaded from the agent's disk cache (the unicast fallback, as the agent did not hold the package)
    stays: the agent holding none is no release of it."""
    from pipecast.agent import local_client

    class Agent:  # holds no package
        def __init__(self, path):
            pass

        def status(self):
            return {"packages": {}}

        def close(self):
            pass

    monkeypatch.setattr(local_client, "LocalAgentClient", Agent)
    monkeypatch.setattr(worker_module, "FOLLOW_AGENT_S", 0.01)
    for origin, unloaded in (("local", False), ("agent", True)):
        worker = ServingWorker(WorkerConfig("pkg", agent="/no/agent.sock"))
        manifest = type("Manifest", (), {"package_id": "p" * 64})
        engine = type("Engine", (), {"provider": type("Provider", (), {"manifest": manifest})})
        worker._model = type("Model", (), {"origin": origin, "engine": engine})()
        released = asyncio.Event()

        async def unload(why="", worker=worker, released=released):
            worker._model = None
            released.set()

        worker._unload = unload
        follower = asyncio.create_task(worker._follow_agent())
        try:
            await asyncio.wait_for(released.wait(), 0.3)
        except TimeoutError:
            pass
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        assert released.is_set() is unloaded, origin


async def test_a_model_its_agent_failed_loads_afresh_once_the_agent_answers_again(monkeypatch):
    """Found in review: the agent killed and restarted while the worker loaded left the worker failed for good (its
    client cannot follow a new agent's events), while the new agent held the package and the control plane counted
    the node as a replica. A model failed by its agent now loads afresh once the agent answers, at most every
    AGENT_RELOAD_MIN_S; one failed by itself (a corrupt block) stays failed; health says what the worker waits for."""
    from pipecast.agent import local_client

    class Agent:  # restarted: answers, holding the package again
        def __init__(self, path):
            pass

        def status(self):
            return {"packages": {"p" * 64: {}}}

        def close(self):
            pass

    class FailedModel:
        origin = "agent"

        def __init__(self, cause: Exception):
            def check_failed():
                raise ModelLoadError("loading the model failed") from cause
            self.engine = SimpleNamespace(provider=SimpleNamespace(manifest=SimpleNamespace(package_id="p" * 64)),
                                          model=SimpleNamespace(check_failed=check_failed))

        def close(self):
            pass

    monkeypatch.setattr(local_client, "LocalAgentClient", Agent)
    monkeypatch.setattr(worker_module, "FOLLOW_AGENT_S", 0.01)
    for cause, reloads in ((LocalApiError("agent at w1.sock: closed its event stream"), 1),
                           (BlockBindError(2, "agent", "a tensor of the wrong shape"), 0)):
        worker = ServingWorker(WorkerConfig("pkg", agent="/no/agent.sock"))
        worker._loop, worker._change = asyncio.get_running_loop(), asyncio.Event()
        loads = []
        worker._load = lambda again=False, wait=True, after=None: loads.append(again)
        worker._model, worker._error = FailedModel(cause), "loading the model failed"
        follower = asyncio.create_task(worker._follow_agent())
        await asyncio.sleep(0.3)
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        assert loads == [True] * reloads, cause  # once: the next waits AGENT_RELOAD_MIN_S
        if reloads:
            assert worker.health().status == "loading" and worker.health().stage == "waiting_for_package"
            with pytest.raises(ModelUnavailableError, match="failed with its agent, which answers again"):
                worker._check_open()


async def test_a_model_its_agent_failed_beside_a_package_folder_loads_afresh_at_once(tmp_path, monkeypatch):
    """Found in review: with the package given as a folder and an agent socket set, no follower ran: an agent dead
    mid-load left the worker failed for good, where the folder could serve (unicast fallback)."""
    from pipecast.agent import local_client

    class Down:
        def __init__(self, path):
            raise ConnectionRefusedError(111, "Connection refused")

    def check_failed():
        raise ModelLoadError("loading the model failed") from LocalApiError("agent: connection lost")

    monkeypatch.setattr(local_client, "LocalAgentClient", Down)
    monkeypatch.setattr(worker_module, "FOLLOW_AGENT_S", 0.01)
    worker = ServingWorker(WorkerConfig(str(tmp_path), agent="/no/agent.sock"))
    loads = []
    worker._load = lambda again=False, wait=True, after=None: loads.append((again, wait))
    failed = SimpleNamespace(origin="agent", close=lambda: None, engine=SimpleNamespace(
        model=SimpleNamespace(check_failed=check_failed),
        provider=SimpleNamespace(manifest=SimpleNamespace(package_id="p" * 64))))
    worker.start()  # its first load (patched) does nothing: the failed model stands in for it
    worker._model, worker._error = failed, "loading the model failed"
    try:
        await wait_until_async(lambda: loads == [(False, True), (True, False)], timeout=5)  # no wait for the agent
    finally:
        await worker.close()


async def test_a_served_models_agent_that_stops_answering_is_warned_of_once_an_outage(monkeypatch, caplog):
    """Found in review: a worker serving from its agent warned every FOLLOW_AGENT_S while the agent did not answer
    (a flood over an outage of hours): once an outage now, then at debug level."""
    from pipecast.agent import local_client

    answers = iter([False] * 20 + [True] * 5 + [False] * 20)

    class Agent:  # down, up a moment, down again
        def __init__(self, path):
            pass

        def status(self):
            if not next(answers, False):
                raise ConnectionRefusedError(111, "Connection refused")
            return {"packages": {"p" * 64: {}}}

        def close(self):
            pass

    monkeypatch.setattr(local_client, "LocalAgentClient", Agent)
    monkeypatch.setattr(worker_module, "FOLLOW_AGENT_S", 0.005)
    worker = ServingWorker(WorkerConfig("pkg", agent="/no/agent.sock"))
    worker._model = SimpleNamespace(origin="agent", engine=SimpleNamespace(
        model=SimpleNamespace(check_failed=lambda: None),
        provider=SimpleNamespace(manifest=SimpleNamespace(package_id="p" * 64))))
    with caplog.at_level(logging.DEBUG, logger=worker_module.__name__):
        follower = asyncio.create_task(worker._follow_agent())
        await wait_until_async(lambda: sum("still holds the package" in r.getMessage() for r in caplog.records) >= 40,
                               timeout=10)
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
    warned = [r for r in caplog.records if "still holds the package" in r.getMessage() and r.levelno >= logging.WARNING]
    assert len(warned) == 2


async def test_idle_pipelined_sessions_are_dropped_with_no_stage_call_to_notice_them(pkg, monkeypatch):
    """A head that died leaves its sessions on the stages after it: they go after their idle time, not only when
    another stage call comes (a dissolved pipeline makes none), with their keys and values."""
    monkeypatch.setattr(worker_module, "EXPIRE_SESSIONS_S", 0.02)
    async with serving(WorkerConfig(str(pkg))) as (url, worker, _, http):
        await wait_health(http, url, lambda h: h["status"] == "ready")
        runner = worker._head.runner
        runner._session("left-behind", range(2, 4), 0, None)  # as a stage call from a head opens it
        assert runner.sessions == 1
        runner.idle_s = 0.0
        await wait_until_async(lambda: runner.sessions == 0, timeout=5)


async def test_a_model_released_while_a_prompt_is_tokenized_answers_503_not_500():
    """The scaler's release races a request: the model goes while the request's prompt is tokenized on a
    thread. It gets the 503 the router retries elsewhere, not an AttributeError (500) on the model gone."""
    tokenizing, tokenized = threading.Event(), threading.Event()

    class Codec:
        def min_tokens(self, text):
            return 1

        def chat_ids(self, messages):
            tokenizing.set()
            assert tokenized.wait(5)
            return [1, 2, 3]

    class Model:  # what generate and _unload read of a LoadedModel
        class engine:
            failure = None

            class provider:
                class manifest:
                    package_id, model_name = "p" * 64, MODEL

            class model:
                config = None  # no max_position_embeddings: any prompt fits

        def close(self):
            pass

    worker = ServingWorker(WorkerConfig("pkg"))
    worker._load = lambda again=False, wait=True, after=None: None  # the package does not come back here
    worker._change = asyncio.Event()
    worker._model, worker._codec = Model(), Codec()
    request = asyncio.create_task(worker.generate(parse_chat_request({"model": MODEL, "messages": [
        {"role": "user", "content": "hi"}]})))
    assert await asyncio.to_thread(tokenizing.wait, 5)
    await worker._unload()  # the agent dropped the package; nothing runs on the model, so it closes at once
    tokenized.set()
    with pytest.raises(ModelUnavailableError, match="^package pkg was released from this node; the worker waits "
                                                    "for it to come back$"):
        await request
    assert worker.queue_depth == 0


async def test_a_released_model_still_draining_closes_when_the_worker_stops_waiting_for_it(pkg):
    agent = GatedAgent(pkg)
    async with serving(WorkerConfig(str(pkg), agent=agent)) as (url, worker, _, http):
        worker._wait_for_package_again = threading.Event().wait
        agent.release(0, 1, 2)
        request = asyncio.create_task(sse_events(http, url, body(stream=True)))
        await wait_health(http, url, lambda h: h["running"] == 1)
        model = worker._model
        unloading = asyncio.create_task(worker._unload())
        await asyncio.sleep(0.2)
        assert not model.engine._closed  # draining
        unloading.cancel()  # as the worker's close cancels its follower
        await asyncio.gather(unloading, return_exceptions=True)
        await wait_until_async(lambda: model.engine._closed)
        await asyncio.gather(request, return_exceptions=True)


async def test_the_openai_client_streams_a_chat_through_the_router_from_a_cold_worker_as_its_blocks_arrive(
        pkg, reference):
    import openai

    from pipecast.router.app import Router, RouterConfig
    from pipecast.core.httpserve import RUNNER_OPTIONS
    from pipecast.router.app import build_app as build_router
    from pipecast.router.discovery import StaticDiscovery

    rendered = list(b"<|system|>Be brief.\n<|user|>Hi\n<|assistant|>")
    expected = reference(rendered, 8)
    agent = GatedAgent(pkg)
    async with serving(WorkerConfig(str(pkg), agent=agent)) as (url, _, _, http):
        router = Router(RouterConfig(health_interval_s=0.05), [StaticDiscovery([url])])
        runner = web.AppRunner(build_router(router), **RUNNER_OPTIONS)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            front = "http://127.0.0.1:%d" % runner.addresses[0][1]
            client = openai.OpenAI(base_url=f"{front}/v1", api_key="dummy", max_retries=0, timeout=30)

            def chat() -> list:
                return list(client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=8,
                                                           temperature=0, stream=True,
                                                           extra_body={"return_token_ids": True}))

            streaming = asyncio.create_task(asyncio.to_thread(chat))
            for block in range(4):  # the worker is cold when the chat arrives; its blocks come one by one
                await asyncio.sleep(0.3)
                assert not streaming.done()
                agent.release(block)
            deltas = await streaming
        finally:
            await runner.cleanup()
    assert deltas[0].choices[0].delta.role == "assistant"
    assert [t for d in deltas for t in d.choices[0].token_ids] == expected


class ReadingAgent(GatedAgent):
    """A gated agent that records the small files read from it."""

    def __init__(self, pkg: Path) -> None:
        super().__init__(pkg)
        self.read: list[str] = []

    def package_file(self, path, package_id=None, timeout=30.0):
        self.read.append(path)
        return super().package_file(path, package_id, timeout)


async def test_the_tokenizer_is_read_when_needed_not_while_a_stage_binds_its_blocks(pkg, reference):
    """Issue #14: every worker read its tokenizer (0.3-1 s of CPU) at once, and on a node short of CPU the
    binding of the blocks a pipeline waited for, and its stage calls, stalled for seconds. A worker whose
    first block is not the embeddings (a pipeline's later stage) reads it only once a request needs it or
    it lacks at most codec_blocks_left(4) = 1 block; one whose first block is the embeddings (it will serve alone
    or head a pipeline) reads it while that block arrives."""
    stage = ReadingAgent(pkg)
    async with serving(WorkerConfig(str(pkg), agent=stage)) as (url, _, _, http):
        await wait_health(http, url, lambda h: h["blocks_total"] == 4)
        stage.release(1)
        await wait_health(http, url, lambda h: h["blocks_present"] == 1)
        stage.release_prefix(0, 1 << 10)  # the embeddings after another block: this node is no head
        await asyncio.sleep(5 * CODEC_POLL_S)
        assert "tokenizer.json" not in stage.read
        request = asyncio.create_task(post(http, url, body()))
        await wait_until_async(lambda: "tokenizer.json" in stage.read)
        stage.release()
        status, _, answer = await request
        assert status == 200 and answer["choices"][0]["token_ids"] == reference(PROMPT, 12)

    head = ReadingAgent(pkg)
    async with serving(WorkerConfig(str(pkg), agent=head)) as (url, _, _, http):
        await wait_health(http, url, lambda h: h["blocks_total"] == 4)
        head.release_prefix(0, 1 << 10)  # the embeddings' block arriving first: read it, no request yet
        await wait_until_async(lambda: "tokenizer.json" in head.read)

    tail = ReadingAgent(pkg)
    async with serving(WorkerConfig(str(pkg), agent=tail)) as (url, _, _, http):
        await wait_health(http, url, lambda h: h["blocks_total"] == 4)
        tail.release(3, 2)  # half the blocks: what a pipeline's tail stage holds here
        await wait_health(http, url, lambda h: h["blocks_present"] == 2)
        await asyncio.sleep(5 * CODEC_POLL_S)
        assert "tokenizer.json" not in tail.read
        tail.release(1)  # one block left: it will serve whole requests soon
        await wait_until_async(lambda: "tokenizer.json" in tail.read)


def test_a_worker_reads_its_tokenizer_unasked_a_few_blocks_before_the_end_never_at_half():
    assert [codec_blocks_left(n) for n in (1, 2, 4, 7, 8, 9, 16, 1000)] == [1, 1, 1, 1, 2, 2, 2, 2]
    assert CODEC_BLOCKS_LEFT == 2


async def test_load_then_serve_holds_requests_until_the_whole_model_is_in(pkg, reference):
    agent = GatedAgent(pkg)
    async with serving(WorkerConfig(str(pkg), agent=agent, wait_full_load=True)) as (url, worker, _, http):
        await wait_health(http, url, lambda h: h["blocks_total"] == 4)
        request = asyncio.create_task(post(http, url, body()))
        agent.release(0, 1, 2)
        state = await wait_health(http, url, lambda h: h["blocks_present"] == 3 and h["queue_depth"] == 1)
        assert state["status"] == "loading" and state["running"] == 0  # held back, not prefilling
        agent.release(3)
        status, _, whole = await request
        assert status == 200 and whole["choices"][0]["token_ids"] == reference(PROMPT, 12)
        assert (await health(http, url))["status"] == "ready"


async def test_a_full_queue_answers_429_with_retry_after(pkg, reference):
    agent = GatedAgent(pkg)  # no block yet: admitted requests stay in the worker
    async with serving(WorkerConfig(str(pkg), agent=agent, max_queue=1, max_batch=1)) as (url, _, _, http):
        await wait_health(http, url, lambda h: h["blocks_total"] == 4)
        first = asyncio.create_task(post(http, url, body()))
        await wait_health(http, url, lambda h: h["running"] == 1)
        second = asyncio.create_task(post(http, url, body()))
        state = await wait_health(http, url, lambda h: h["queue_depth"] == 1)
        assert state["max_queue"] == 1
        status, headers, answer = await post(http, url, body())
        assert status == 429 and headers["Retry-After"] == "1"
        assert answer["error"] == {"message": "the worker is full: 1 requests are already waiting; retry in 1 s",
                                   "type": "rate_limit_error", "param": None, "code": "queue_full"}
        agent.release()
        expected = reference(PROMPT, 12)
        for task in (first, second):
            status, _, whole = await task
            assert status == 200 and whole["choices"][0]["token_ids"] == expected


BAD_REQUESTS = [
    (b"{not json", None, "the request body is not valid JSON"),
    ({"prompt": [1]}, "model", "model: required"),
    ({"model": MODEL, "prompt": []}, "prompt", "prompt: required: a non-empty string or a non-empty list of token"),
    ({"model": MODEL, "prompt": ["a", "b"]}, "prompt", "prompt: one prompt per request, got a batch of 2"),
    ({"model": MODEL, "prompt": [1], "max_tokens": 0}, "max_tokens", "max_tokens: must be at least 1, got 0"),
    ({"model": MODEL, "prompt": [1], "max_tokens": "8"}, "max_tokens", "max_tokens: must be an integer, got '8'"),
    ({"model": MODEL, "prompt": [1], "temperature": -1}, "temperature",
     "temperature: must be between 0 and 2, got -1"),
    ({"model": MODEL, "prompt": [1], "top_p": 0}, "top_p", "top_p: must be in (0, 1], got 0"),
    ({"model": MODEL, "prompt": [1], "stop": [""]}, "stop", "stop: must be a non-empty string or a list of"),
    ({"model": MODEL, "prompt": [1], "n": 2}, "n", "n: 2 is not supported (accepted: null or 1)"),
    ({"model": MODEL, "prompt": [1], "frobnicate": 1}, "frobnicate", "frobnicate: unknown field"),
    ({"model": MODEL, "prompt": [1, 999]}, "prompt", "prompt: prompt token ids [999] are outside the vocabulary"),
    # the field to change is max_tokens where the prompt leaves room (a review: it was always the prompt)
    ({"model": MODEL, "prompt": [1], "max_tokens": 500}, "max_tokens",
     "max_tokens: prompt of 1 tokens plus max_tokens 500 exceeds the model's 128 positions"),
    ({"model": MODEL, "prompt": [1] * 128, "max_tokens": 1}, "prompt",
     "prompt: prompt of 128 tokens plus max_tokens 1 exceeds the model's 128 positions"),
]


async def test_bad_requests_get_400_naming_the_field_and_unknown_models_404(pkg):
    async with serving(WorkerConfig(str(pkg))) as (url, _, _, http):
        for request, param, message in BAD_REQUESTS:
            status, _, answer = await post(http, url, request)
            assert status == 400, (request, answer)
            assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error"
            assert answer["error"]["message"].startswith(message), answer
        status, _, answer = await post(http, url, {**body(), "model": "gpt-4"})
        assert status == 404 and answer["error"] == {
            "message": f"model 'gpt-4' is not served here: this worker serves '{MODEL}'",
            "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
        async with http.get(f"{url}/metrics") as response:
            assert metric(await response.text(), 'pipecast_serve_requests_total{outcome="invalid"}') == len(
                BAD_REQUESTS) + 1


HOSTILE_REQUESTS = [
    (b"[" * 100_000, None, "the request body is not valid JSON (nested too deeply)"),
    (b'{"model": "m", "model": "m", "prompt": [1]}', None, "the request body is not valid JSON (duplicate key"),
    (b'{"model": "tiny-llama", "prompt": [1], "temperature": 1e400}', None,
     "the request body is not valid JSON (number 1e400 is out of range)"),
    (b'{"model": "tiny-llama", "prompt": [1], "top_p": NaN}', None, "the request body is not valid JSON (NaN"),
    (b"[1, 2]", None, "the request body must be a JSON object, got list"),
    (b'"prompt"', None, "the request body must be a JSON object, got str"),
    (b"\xff\xfe", None, "the request body is not valid JSON (not UTF-8"),
    ({"model": MODEL, "prompt": [1], "seed": 1 << 64}, "seed", "seed: must be an integer from -2^63 to 2^64-1"),
    ({"model": MODEL, "prompt": [1], "seed": -(1 << 63) - 1}, "seed", "seed: must be an integer from -2^63"),
    ({"model": MODEL, "prompt": [1], "seed": 1.5}, "seed", "seed: must be an integer, got 1.5"),
    ({"model": MODEL, "prompt": [1], "max_tokens": -5}, "max_tokens", "max_tokens: must be at least 1, got -5"),
    ({"model": MODEL, "prompt": [1], "max_tokens": [[[[[[1]]]]]]}, "max_tokens", "max_tokens: must be an integer"),
    ({"model": MODEL, "prompt": [1], "temperature": 10 ** 400}, "temperature", "temperature: must be a finite"),
    ({"model": MODEL, "prompt": [1], "top_p": "0.5"}, "top_p", "top_p: must be a number, got '0.5'"),
    ({"model": MODEL, "prompt": [1], "stream": "yes"}, "stream", "stream: must be true or false"),
    ({"model": MODEL, "prompt": [1], "stop": ["x"] * 17}, "stop", "stop: at most 16 stop strings, got 17"),
    ({"model": MODEL, "prompt": [1], "stop": ["x" * 257]}, "stop", "stop: a stop string has at most 256 characters"),
    ({"model": MODEL, "prompt": [1], "n": [[[[[[[[2]]]]]]]]}, "n", "n: [[[[...]]]] is not supported"),
    ({"model": MODEL, "prompt": [1], "user": 7}, "user", "user: must be a string"),
    ({"model": MODEL, "prompt": "x" * 2000}, "prompt",
     "prompt: prompt of 2000 characters (at least 500 tokens) plus max_tokens 16 exceeds the model's 128"),
]


async def test_a_worker_whose_engine_thread_died_says_failed_and_refuses_with_503(pkg):
    """Found in review: the engine thread dead (a bug outside a step's guards), the worker failed every request
    with 500 while its /health said ready, so the router kept sending it requests. Its health also reports the
    engine's steps, by which the router tells a busy worker from a hung one."""
    async with serving(WorkerConfig(str(pkg))) as (url, worker, _, http):
        await wait_health(http, url, lambda h: h["status"] == "ready")
        assert (await health(http, url))["steps"] == 0
        status, _, _ = await post(http, url, body(max_tokens=3))
        assert status == 200 and (await health(http, url))["steps"] > 0

        def lost(*args):
            raise RuntimeError("device lost")

        worker._model.engine.scheduler.step = lost
        status, _, answer = await post(http, url, body(max_tokens=3))
        assert status == 500, answer
        why = "the engine stopped on an unexpected error: RuntimeError: device lost"
        async with http.get(f"{url}/health") as response:
            assert response.status == 503
            state = await response.json()
        assert (state["status"], state["error"]) == ("failed", why)
        status, _, answer = await post(http, url, body(max_tokens=3))
        assert status == 503 and answer["error"]["message"].endswith(why), answer


async def test_a_chats_token_limit_past_the_positions_names_the_field_it_came_in(pkg):
    async with serving(WorkerConfig(str(pkg))) as (url, _, _, http):
        for field in ("max_tokens", "max_completion_tokens"):
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], field: 10 ** 8}
            status, _, answer = await post(http, url, chat, "/v1/chat/completions")
            assert status == 400 and answer["error"]["param"] == field, answer
            assert answer["error"]["message"].startswith(f"{field}: prompt of "), answer


async def test_hostile_requests_get_400_never_500(pkg):
    """Finding 3 and 8: RecursionError, an out-of-range number or a seed past 64 bits were a 500 (or an
    engine failure); every malformed field or body is now a 400 with a JSON error naming it."""
    async with serving(WorkerConfig(str(pkg))) as (url, _, _, http):
        for request, param, message in HOSTILE_REQUESTS:
            status, _, answer = await post(http, url, request)
            assert status == 400, (str(request)[:80], answer)
            assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error"
            assert answer["error"]["message"].startswith(message), answer
        status, _, answer = await post(http, url, body(seed=(1 << 64) - 1, temperature=1.0, max_tokens=2))
        assert status == 200, answer  # the largest seed still runs


async def test_a_stage_close_over_the_body_limit_is_a_413_not_a_500(pkg):
    worker = ServingWorker(WorkerConfig(str(pkg)))
    runner = web.AppRunner(build_app(worker, max_body_bytes=100))
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
            data = json.dumps({"session": "s" * 200}).encode()
            async with http.post(f"http://{host}:{port}/v1/stage/close", data=data) as response:
                assert response.status == 413
                assert "over this server's limit of 100 bytes" in (await response.json())["error"]["message"]
    finally:
        await runner.cleanup()


async def test_a_client_that_stalls_mid_body_is_answered_408_at_the_body_deadline(pkg):
    """Review E, finding 3: a completion's (or a stage call's, or a session close's) body was read with no
    deadline, so a client that stalled mid-body held its handler and the bytes so far for good."""
    async with serving(WorkerConfig(str(pkg)), body_timeout_s=0.3) as (url, _, _, _):
        answers = []
        # A stage call's body too, within the body limit and (a large frame: its header read first) beyond it.
        for path, declared, sent in (("/v1/completions", 1000, 500), ("/v1/stage/close", 1000, 500),
                                     ("/v1/stage", 1000, 500), ("/v1/stage", (16 << 20) + 1000, 2)):
            status, answer = await stalled_body_answer(url, path, declared, sent)
            assert status == 408, answer
            assert answer["error"]["message"] == ("the request body did not arrive within this server's deadline "
                                                  f"of 0.3 s ({sent} of {declared} bytes received)"), answer
            answers.append(answer["error"])
        assert answers[0]["code"] == "request_timeout" and answers[0]["type"] == "invalid_request_error"
        assert all(answer["node"] is None for answer in answers[1:])  # a stage's error names the stage that failed


def unread_stream(url: str, request: dict) -> socket.socket:
    """A client that sends ``request`` (streamed) and reads nothing of its answer, through a small receive buffer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((urlsplit(url).hostname, urlsplit(url).port))
    data = json.dumps(request).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


async def test_a_streaming_client_that_stops_reading_is_cancelled_at_the_deadline(pkg, monkeypatch):
    """Found in review: a stream's writes had no deadline, so a client that stayed connected but read nothing held
    its request's handler and the answer's bytes so far (and a drain waited for it) for good once the socket's
    buffers filled."""
    monkeypatch.setattr(app_module, "sse", lambda chunk: b"data: " + b"x" * (256 << 10) + b"\n\n")  # fills fast
    async with serving(WorkerConfig(str(pkg)), body_timeout_s=0.3) as (url, worker, _, http):
        await wait_health(http, url, lambda h: h["status"] == "ready")
        sock = unread_stream(url, body(stream=True, max_tokens=40))
        try:
            await wait_until_async(lambda: worker._requests == 1)
            await wait_until_async(lambda: worker._requests == 0, timeout=10)
            async with http.get(f"{url}/metrics") as response:
                page = await response.text()
            assert metric(page, 'pipecast_serve_requests_total{outcome="cancelled"}') == 1
        finally:
            sock.close()


async def test_a_stream_whose_tokens_are_all_made_holds_no_place_while_its_client_reads_it(pkg, monkeypatch):
    """Found in review: a stream counted running (or queued) until its answer's last byte was written, though its
    tokens were all made and the engine had freed their row: two clients slow to read their streams made an idle
    worker (max_batch 1, max_queue 1) report a full batch and a queue, and refuse a request as queue_full. Its place
    goes back as its stream ends; its handler still counts, so a drain waits for its answer."""
    monkeypatch.setattr(app_module, "sse", lambda chunk: b"data: " + b"x" * (256 << 10) + b"\n\n")  # fills fast
    async with serving(WorkerConfig(str(pkg), max_batch=1, max_queue=1)) as (url, worker, _, http):
        await wait_health(http, url, lambda h: h["status"] == "ready")
        generations = []
        generate = worker.generate

        async def recorded(*args, **kwargs):
            generations.append(await generate(*args, **kwargs))
            return generations[-1]

        monkeypatch.setattr(worker, "generate", recorded)
        socks = []
        try:
            for count in (1, 2):  # one after the other: the first, still queued, would take the queue's one place
                socks.append(unread_stream(url, body(stream=True, max_tokens=40)))
                await wait_until_async(lambda: len(generations) == count)
            await wait_until_async(lambda: all(g._stream.done for g in generations))
            state = await wait_health(http, url, lambda h: h["running"] == 0, timeout=5)
            assert state["queue_depth"] == 0 and not worker._model.engine.scheduler.active
            assert worker._requests == 2  # their answers are still being written: a drain waits for them
            status, _, answer = await post(http, url, body(max_tokens=4))
            assert status == 200 and len(answer["choices"][0]["token_ids"]) == 4, answer
        finally:
            for sock in socks:
                sock.close()


async def test_health_answers_within_a_second_while_huge_prompts_are_refused_or_tokenized(pkg, monkeypatch):
    """Finding 8: the body was read whole before any limit and the prompt tokenized on the event loop, so
    one 16-64 MiB prompt stalled /health (and every other request) for as long as the tokenizer ran (a
    second per MiB with a byte-level tokenizer). Now: over the limit, 413 from the Content-Length (or as a
    chunked body passes it); under it, a prompt that cannot fit is refused before tokenizing; one that may
    fit is tokenized on a thread."""
    big = b'{"model": "tiny-llama", "prompt": "' + b"a" * (64 << 20) + b'"}'

    async def chunked():
        for start in range(0, len(big), 1 << 20):
            yield big[start:start + (1 << 20)]

    async with serving(WorkerConfig(str(pkg))) as (url, worker, _, http):
        await wait_health(http, url, lambda h: h["status"] == "ready")
        latencies: list[float] = []
        done = asyncio.Event()

        async def watch():
            while not done.is_set():
                start = time.monotonic()
                async with http.get(f"{url}/health") as response:
                    assert response.status == 200
                latencies.append(time.monotonic() - start)
                await asyncio.sleep(0.02)

        async def send(data) -> tuple[int, dict]:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as own:
                async with own.post(f"{url}/v1/completions", data=data) as response:
                    return response.status, await response.json()

        watcher = asyncio.create_task(watch())
        try:
            status, answer = await send(big)
            assert (status, answer["error"]["code"]) == (413, "request_too_large"), answer
            assert f"of {len(big)} bytes is over this server's limit of {16 << 20} bytes" in answer["error"]["message"]
            status, answer = await send(chunked())
            assert (status, answer["error"]["code"]) == (413, "request_too_large"), answer
            under = json.dumps({"model": MODEL, "prompt": "b" * (15 << 20)}).encode()
            status, answer = await send(under)
            assert status == 400 and "exceeds the model's 128 positions" in answer["error"]["message"]
            # Without the bound on characters, a 2 MiB prompt is tokenized (~2 s here) on a thread; its
            # 2 million tokens are then refused.
            monkeypatch.setattr(worker._codec, "max_token_chars", 1 << 40)
            tokenized = json.dumps({"model": MODEL, "prompt": "c" * (2 << 20)}).encode()
            status, answer = await send(tokenized)
            assert status == 400 and f"prompt of {2 << 20} tokens" in answer["error"]["message"], answer
        finally:
            done.set()
            await watcher
        assert len(latencies) > 10 and max(latencies) < 1.0, sorted(latencies)[-5:]


async def test_a_client_that_goes_away_cancels_its_request_in_the_engine(pkg, reference):
    agent = GatedAgent(pkg)
    async with serving(WorkerConfig(str(pkg), agent=agent)) as (url, worker, _, http):
        await wait_health(http, url, lambda h: h["blocks_total"] == 4)
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as leaving:
            request = asyncio.create_task(post(leaving, url, body(max_tokens=50)))
            await wait_health(http, url, lambda h: h["running"] == 1)
            request.cancel()
        await wait_health(http, url, lambda h: h["running"] == 0)
        engine = worker._model.engine
        deadline = time.monotonic() + 10
        while engine.scheduler.active:  # the engine dropped the sequence, not just the worker's count
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        agent.release()
        status, _, whole = await post(http, url, body())
        assert status == 200 and whole["choices"][0]["token_ids"] == reference(PROMPT, 12)
        async with http.get(f"{url}/metrics") as response:
            page = await response.text()
        assert metric(page, 'pipecast_serve_requests_total{outcome="cancelled"}') == 1
        assert metric(page, "pipecast_serve_generated_tokens_total") == len(whole["choices"][0]["token_ids"])


async def test_shutdown_refuses_new_requests_and_lets_running_ones_finish(pkg, reference):
    agent = GatedAgent(pkg)
    async with serving(WorkerConfig(str(pkg), agent=agent)) as (url, worker, runner, http):
        await wait_health(http, url, lambda h: h["blocks_total"] == 4)
        running = asyncio.create_task(sse_events(http, url, body(stream=True)))
        await wait_health(http, url, lambda h: h["running"] == 1)
        shutdown = asyncio.create_task(runner.cleanup())
        while worker.health().status != "draining":
            await asyncio.sleep(0.01)
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as late:
            with pytest.raises(aiohttp.ClientConnectionError):
                await post(late, url, body())
        agent.release()
        events = await running
        assert events[-1] == "[DONE]"
        assert [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]] == reference(PROMPT, 12)
        await asyncio.wait_for(shutdown, 10)
        with pytest.raises(EngineClosedError):
            worker._model.engine.submit(PROMPT)


async def test_a_package_without_tokenizer_fails_the_worker_with_503(tiny_package):
    bare = tiny_package(seed=1).path
    async with serving(WorkerConfig(str(bare))) as (url, _, _, http):
        deadline = time.monotonic() + 30
        while (response := await http.get(f"{url}/health")).status != 503:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        state = await response.json()
        assert state["status"] == "failed"
        assert "has no tokenizer (tokenizer.json or tokenizer.model or vocab.json)" in state["error"]
        status, _, answer = await post(http, url, body())
        assert status == 503 and answer["error"]["code"] == "model_unavailable"
        assert answer["error"]["message"] == state["error"]


# --- the pieces, without HTTP ------------------------------------------------------------------------


def test_chat_requests_are_checked_field_by_field():
    request = parse_chat_request({"model": "m", "messages": CHAT, "max_tokens": 5, "stream": True, "n": 1})
    assert request.chat and request.max_tokens == 5 and request.stream
    assert request.prompt == (ChatMessage("system", "Be brief."), ChatMessage("user", "Hi"))
    assert parse_chat_request({"model": "m", "messages": CHAT, "max_tokens": 5,
                               "max_completion_tokens": 7}).max_tokens == 7  # the newer name wins
    assert parse_chat_request({"model": "m", "messages": CHAT}).max_tokens is None
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert parse_chat_request({"model": "m", "messages": parts}).prompt == (ChatMessage("user", "a\nb"),)  # as vLLM
    # "off" as clients typed with floats send it
    assert parse_chat_request({"model": "m", "messages": CHAT, "presence_penalty": 0.0, "frequency_penalty": 0.0})
    for fields, message in (
            ({"messages": []}, "messages: required: a non-empty list of {role, content} objects"),
            ({"messages": [{"role": "user"}]}, "messages[0].content: must be a string or a list of"),
            ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
             "messages[0].content: must be a string or a list of"),
            ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
             "messages[0].tool_call_id: is not supported (a message has role, content, name)"),
            ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name: must be a string, got 5"),
            ({"messages": [{"role": "user", "content": "x", "name": False}]},
             "messages[0].name: must be a string, got False"),
            ({"n": 2}, "n: 2 is not supported"), ({"prompt": "x"}, "prompt: unknown field"),
            ({"presence_penalty": 0.5}, "presence_penalty: 0.5 is not supported (accepted: null or 0 or 0.0)"),
            ({"max_completion_tokens": 0}, "max_completion_tokens: must be at least 1, got 0")):
        with pytest.raises(RequestFieldError, match=re.escape(message)):
            parse_chat_request({"model": "m", "messages": CHAT, **fields})


def test_a_message_as_the_openai_client_dumps_an_answer_is_accepted_with_its_empty_fields():
    """Found in review: the fields an answer's ``message.model_dump()`` holds, all null, were refused ("messages[1].
    annotations: is not supported"), so a conversation could not be sent back as the client gives it (vLLM takes
    it); a value in them is still refused, naming the field."""
    user = {"role": "user", "content": "hi"}
    dumped = {"role": "assistant", "content": "hello", "annotations": None, "audio": None, "function_call": None,
              "refusal": None, "tool_calls": None}
    plain = parse_chat_request({"model": "m", "messages": [user, {"role": "assistant", "content": "hello"}]})
    for fields in ({}, {"tool_calls": []}, {"annotations": []}):
        assert parse_chat_request({"model": "m", "messages": [user, dumped | fields]}) == plain
    for name, value, message in (
            ("tool_calls", [{"id": "c"}],
             "messages[1].tool_calls: [{'id': 'c'}] is not supported (accepted: null or [])"),
            ("refusal", "no", 'messages[1].refusal: "no" is not supported (accepted: null)'),
            ("function_call", [], "messages[1].function_call: [] is not supported (accepted: null)")):
        with pytest.raises(RequestFieldError, match=f"^{re.escape(message)}$"):
            parse_chat_request({"model": "m", "messages": [user, dumped | {name: value}]})


def test_a_null_message_name_is_none_as_other_optional_fields():
    """Found in review: `"name": null` was refused (every other optional field takes null for absent)."""
    named = {"role": "user", "content": "hi", "name": None}
    assert parse_chat_request({"model": "m", "messages": [named]}) == \
        parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


def test_requests_are_checked_field_by_field():
    assert parse_completion_request({"model": "m", "prompt": ["hi"], "stop": "\n", "seed": 3, "stream": True,
                                     "stream_options": {"include_usage": True}, "n": 1, "user": "u"}) == \
        CompletionRequest(model="m", prompt="hi", stop=("\n",), seed=3, stream=True, include_usage=True)
    assert parse_completion_request({"model": "m", "prompt": [[5, 6]], "max_tokens": None}).prompt == (5, 6)
    for fields, param in [({"n": True}, "n"), ({"stream": 1}, "stream"), ({"echo": True}, "echo"),
                          ({"prompt": [1, True]}, "prompt"), ({"temperature": True}, "temperature"),
                          ({"stream_options": {"include_usage": True}}, "stream_options"),
                          # Found in review: named "include_usage", a top-level field there is not.
                          ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
                          ({"seed": 1.5}, "seed"), ({"temperature": float("nan")}, "temperature")]:
        with pytest.raises(RequestFieldError) as caught:
            parse_completion_request({"model": "m", "prompt": [1], **fields})
        assert caught.value.param == param, fields


def test_text_comes_out_whole_characters_and_stops_before_a_stop_string(codec):
    text = "héllo wörld"
    detokenizer = IncrementalDetokenizer(codec, list(b"say: "))
    deltas = [detokenizer.add(t) for t in text.encode()]
    assert deltas[1:3] == ["", "é"] and "".join(deltas) + detokenizer.flush() == text
    cut = CompletionText(codec, [], ["wö"])
    assert "".join(cut.add(t) for t in text.encode()) + cut.finish() == "héllo " and cut.stopped

    stops = StopMatcher(["STOP", "END"])
    assert [stops.feed("abcS"), stops.feed("T"), stops.feed("x")] == ["abc", "", "STx"]
    assert stops.flush() == "" and not stops.stopped
    assert stops.feed("yEN") == "y" and stops.feed("D!") == "" and stops.stopped and stops.flush() == ""
    overlapping = StopMatcher(["abcab!", "cabx"])  # the longest end that begins a stop is held back
    assert overlapping.feed("zzabcab") == "zz" and overlapping.feed("c") == "abc" and overlapping.flush() == "abc"


class SplitCharacterCodec:
    """Byte tokens, and token 256: "x" with the first byte of "中" (e4 b8 ad), as a byte-level BPE may merge a
    letter with the lead byte of the character after it."""

    def decode(self, ids) -> str:
        return b"".join(b"x\xe4" if t == 256 else bytes([t]) for t in ids).decode("utf-8", errors="replace")


SPLIT_X = [ord("a"), 256, 0xB8, 0xAD, ord("b")]  # "ax中b", "x" in the token that begins "中"


def test_tokens_that_never_settle_into_text_are_held_back_only_a_few_at_a_time():
    """Bytes that are no UTF-8 (or special tokens, decoded to nothing) were held, and the whole run decoded again
    with every token after it: quadratic in a degenerate generation's length, on the event loop."""
    decoded = []

    class Counting(SplitCharacterCodec):
        def decode(self, ids) -> str:
            decoded.append(len(ids))
            return super().decode(ids)

    detokenizer = IncrementalDetokenizer(Counting(), [])
    deltas = [detokenizer.add(0x80) for _ in range(1000)]  # a continuation byte, again and again
    assert max(decoded) <= 2 * (MAX_HELD_TOKENS + 1)
    assert "".join(deltas) + detokenizer.flush() == "\ufffd" * 1000


class ByteFallbackCodec:
    """A SentencePiece-style tokenizer as Llama-2, Mistral and Gemma have: a few words, and byte tokens <0xNN> for
    the rest, decoded by a ByteFallback decoder (one U+FFFD per byte of a run that is not whole UTF-8)."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
        vocab |= {word: len(vocab) + i for i, word in enumerate(["▁", "▁Hello", "▁world", "Hello"])}
        self.tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
        self.tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        self.tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])

    def ids(self, *pieces: str | bytes) -> list[int]:
        """Token ids: a string is one token of the vocabulary, bytes one byte token a byte."""
        names = [name for piece in pieces
                 for name in ([f"<0x{b:02X}>" for b in piece] if isinstance(piece, bytes) else [piece])]
        return [self.tokenizer.token_to_id(name) for name in names]

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def test_text_after_incomplete_bytes_is_not_lost_with_a_byte_fallback_decoder():
    """Found in review: after more than MAX_HELD_TOKENS held tokens the detokenizer let them out mid-character
    (or the prompt's last tokens ended mid-character); the emitted window then decoded to one U+FFFD per byte,
    longer than the text it became once the character completed, and the text after it was sliced away."""
    codec = ByteFallbackCodec()

    def streamed(prompt: list[int], generated: list[int]) -> str:
        completion = CompletionText(codec, prompt, ())
        return "".join([completion.add(t) for t in generated] + [completion.finish()])

    clean = codec.ids("<s>", "▁Hello", "▁world")
    cjk = "中文字".encode() * 6
    stray = codec.ids(b"\x80" + cjk, "▁Hello", "▁world")  # a stray byte: all held, let out at 17 tokens
    assert len(stray) > MAX_HELD_TOKENS + 2 and streamed(clean, stray).endswith(" Hello world")
    # The prompt ends in an invalid run of bytes the generation's bytes join: the generation's own text is its own.
    invalid_tail = codec.ids("<s>", b"\x94*\x08\x9d\xd8\xc2\xb7")
    generated = codec.ids("中😀é中😀é".encode(), "Hello", "▁world")
    assert streamed(invalid_tail, generated) == codec.decode(generated) == "中😀é中😀éHello world"
    # The prompt ends in the first bytes of a character: the generation's byte that completes it is its own.
    split_tail = codec.ids("<s>", "▁Hello", "中".encode()[:2])
    assert streamed(split_tail, codec.ids("中".encode()[2:], "▁world")) == "\ufffd world"
    # A character begun by the token that lets the held ones out is not let out with them, incomplete.
    lossy, garbled = SplitCharacterCodec(), [0x80] * MAX_HELD_TOKENS + list("中b".encode())
    detokenizer = IncrementalDetokenizer(lossy, [])
    assert "".join([detokenizer.add(t) for t in garbled] + [detokenizer.flush()]) == lossy.decode(garbled)
    # Valid text spelled in byte tokens still streams as it decodes.
    assert streamed(clean, codec.ids(cjk, "▁world")) == codec.decode(codec.ids(cjk, "▁world"))


def test_a_stop_string_ends_the_text_at_the_token_completing_it_though_that_token_splits_a_character():
    """Before, the stop was seen only once the character was whole, tokens later: generation went on."""
    codec = SplitCharacterCodec()
    for stop in ("x", "ax"):
        text = CompletionText(codec, [], [stop])
        assert [text.add(SPLIT_X[0]), text.stopped] == ["a" if stop == "x" else "", False]
        assert [text.add(SPLIT_X[1]), text.stopped, text.finish()] == ["", True, ""], stop
    text = CompletionText(codec, [], ["y"])  # no stop: the settled "x" held with the split character, once
    assert "".join(text.add(t) for t in SPLIT_X) + text.finish() == "ax中b" and not text.stopped


async def test_a_generation_stops_at_the_token_completing_a_stop_string_and_says_stop():
    """Before, the generation below went on to its fourth token (usage counted them) and a stop found in the
    text's last characters, as the generation ended at max_tokens, said "length"."""
    from pipecast.engine.streams import TokenStream
    from pipecast.serve.worker import Generation

    async def run(tokens: list[int], stop: str) -> tuple[str, str, int]:
        worker = ServingWorker(WorkerConfig("pkg"))
        worker._submitted = 1
        worker._loop = asyncio.get_running_loop()  # the stream's end gives its place back there
        stream = TokenStream(0, lambda _: None)
        for token in tokens:
            stream.push(token)
        stream.finish("length")
        generation = Generation(worker, stream, [], CompletionText(SplitCharacterCodec(), [], [stop]), 0.0)
        pieces = [piece async for piece in generation]
        return "".join(p.text for p in pieces), pieces[-1].finish_reason, generation.completion_tokens

    assert await run(SPLIT_X, "x") == ("a", "stop", 2)
    assert await run([ord("a"), 0xE4], "\ufffd") == ("a", "stop", 2)  # the last character left incomplete


def test_a_null_user_is_accepted_as_any_other_optional_field():
    for parse, fields in ((parse_completion_request, {"prompt": "hi"}), (parse_chat_request, {"messages": CHAT})):
        assert parse({"model": "m", "user": None, **fields}) == parse({"model": "m", **fields})
        with pytest.raises(RequestFieldError, match="^user: must be a string$"):
            parse({"model": "m", "user": 5, **fields})


def test_a_package_without_tokenizer_files_is_refused(codec):
    with pytest.raises(ModelUnavailableError, match=r"^pkg has no tokenizer \(tokenizer.json or tokenizer.model or "
                                                    r"vocab.json\): the serving worker needs one"):
        TextCodec.from_files(lambda name: b"{}", ["config.json"], "pkg")


@pytest.mark.parametrize("files", [{"tokenizer.json": b"{}"}, {"tokenizer.json": b"[]"},
                                   {"tokenizer.json": b"{}", "tokenizer_config.json": b"[]"}])
def test_tokenizer_files_of_the_wrong_shape_are_the_packages_fault(files):
    """Found in review: JSON of the wrong shape raised KeyError, TypeError or AttributeError out of the load (logged
    with a traceback as if pipecast had a bug), where files that cannot be loaded are ModelUnavailableError."""
    with pytest.raises(ModelUnavailableError, match=r"^pkg: its tokenizer files cannot be loaded \(\w+: "):
        TextCodec.from_files(files.get, list(files), "pkg")


def test_the_token_rate_counts_the_last_window_only():
    now = [100.0]
    meter = RateMeter(window_s=10, clock=lambda: now[0])
    meter.add(30)
    now[0] += 5
    meter.add(20)
    assert meter.rate() == 5.0
    now[0] += 6  # the first 30 are out of the window
    assert meter.rate() == 2.0


def test_the_token_rate_keeps_only_its_window_even_when_never_read():
    """Found in review: events were trimmed only when the rate was read (a scrape), so a worker nobody
    scraped kept one entry per token it ever generated."""
    now = [0.0]
    meter = RateMeter(window_s=10.0, clock=lambda: now[0])
    for _ in range(1000):
        meter.add()
        now[0] += 0.125
    assert len(meter._events) == 80  # ten seconds of them, at eight a second
    assert meter.rate() == 7.9  # 0.125 s later


# --- a worker process, with the openai client and raw HTTP -------------------------------------------


def test_the_openai_client_and_raw_http_against_a_worker_process(pkg, reference, tmp_path):
    import openai

    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPECAST_")}
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "pipecast.cli", "serve", str(pkg), "--host", "127.0.0.1",
                             "--port", "0"], stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        line = proc.stdout.readline()
        match = re.fullmatch(r"pipecast serve: listening on (http://\S+)\n", line)
        assert match, (line, (tmp_path / "serve.log").read_text())
        url = match.group(1)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="dummy", max_retries=0, timeout=30)
        deadline = time.monotonic() + 40
        while not client.models.list().data:  # the model's name is known once its manifest is read
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        assert [m.id for m in client.models.list().data] == [MODEL]

        expected = reference(PROMPT, 12)
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                                stream=True, extra_body={"return_token_ids": True}))
        assert [t for c in chunks for t in c.choices[0].token_ids] == expected
        whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
        assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
        assert whole.usage.completion_tokens == len(expected) and whole.usage.prompt_tokens == len(PROMPT)
        with pytest.raises(openai.BadRequestError, match="max_tokens: must be at least 1"):
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)

        # Chat, as chat clients call it: the package's template, streamed deltas, the same text whole.
        rendered = list(b"<|system|>Be brief.\n<|user|>Hi\n<|assistant|>")
        deltas = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=12,
                                                     temperature=0, stream=True))
        answer = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
        assert answer.choices[0].message.role == "assistant" and deltas[0].choices[0].delta.role == "assistant"
        assert "".join(d.choices[0].delta.content or "" for d in deltas) == answer.choices[0].message.content
        assert answer.usage.prompt_tokens == len(rendered)
        assert answer.usage.completion_tokens == len(reference(rendered, 12))

        # Raw HTTP, as curl sends it: the bytes of a Server-Sent Events answer.
        address = urlsplit(url)
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
        connection.request("POST", "/v1/completions", body=json.dumps(body(stream=True)),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        raw = response.read()
        connection.close()
        assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
        assert raw.startswith(b'data: {"id": "cmpl-') and raw.endswith(b"\n\ndata: [DONE]\n\n")
        assert len(raw.split(b"\n\n")) == len(chunks) + 2  # every chunk, [DONE], and the empty tail

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, (tmp_path / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        log.close()


async def test_a_stream_that_fails_before_its_first_token_answers_the_errors_status(pkg, monkeypatch):
    """Found in review: a stream's headers went out before its first token, so a failure before it (the agent
    dead mid-load, the package released) was a 200 whose one event was the error, which the router relayed;
    the same request unstreamed was a 503, which the router retries on another worker."""
    from pipecast.serve.worker import Generation

    async def failing(self):
        raise ModelUnavailableError("loading the model failed: agent: connection lost (the agent died)")
        yield  # an async generator, as the real one

    async with serving(WorkerConfig(str(pkg))) as (url, _, _, http):
        await wait_health(http, url, lambda h: h["status"] == "ready")
        monkeypatch.setattr(Generation, "__aiter__", failing)
        async with http.post(f"{url}/v1/completions", json=body(stream=True, max_tokens=4)) as response:
            answer = await response.json()
        assert response.status == 503 and answer["error"]["code"] == "model_unavailable", answer
        monkeypatch.undo()
        async with http.post(f"{url}/v1/completions", json=body(stream=True, max_tokens=4)) as response:
            events = (await response.read()).split(b"\n\n")
        assert response.status == 200 and events[-2] == b"data: [DONE]"


async def test_on_a_gpu_a_released_models_return_loads_once_the_model_before_is_closed(monkeypatch):
    """Found in review: after a release with requests running, the package's return loaded a second model while
    the first still drained (up to 30 s): on a GPU the weights twice, and a model over half of it failed for good."""
    worker = ServingWorker(WorkerConfig("p" * 64, agent="/no/agent.sock", device="cuda"))
    worker._loop, worker._change = asyncio.get_running_loop(), asyncio.Event()
    handed: list = []
    worker._load = lambda again=False, wait=True, after=None: handed.append(after)
    closing = threading.Event()
    worker._model = SimpleNamespace(close=closing.wait, engine=SimpleNamespace(
        provider=SimpleNamespace(manifest=SimpleNamespace(package_id="p" * 64))))
    await worker._unload("released")
    [after] = handed
    assert after is not None and not after.is_set()  # the old model's close waits (here: for the test)
    closing.set()
    assert await asyncio.to_thread(after.wait, 5)
    loaded: list[bool] = []
    monkeypatch.setattr(worker_module, "load", lambda *args, **kwargs: loaded.append(gate.is_set()) or 1 / 0)
    gate = threading.Event()
    worker._post = lambda *args: None
    loader = threading.Thread(target=ServingWorker._load, args=(worker, True, False, gate))
    loader.start()
    await asyncio.sleep(0.2)
    assert loaded == []  # waits for the model before
    gate.set()
    await asyncio.to_thread(loader.join, 5)
    assert loaded == [True]

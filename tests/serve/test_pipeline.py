"""Cross-node pipelines between serving workers: routes and frames, requests through stages over real
HTTP, and stages that fail or die mid-request.

Workers run in-process on loopback (one torch import), except the stage killed mid-request, which is a
``pipecast serve`` process.
"""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import asynccontextmanager
from types import SimpleNamespace

import aiohttp
import pytest
import torch
from aiohttp import web

import pipecast
from pipecast.serve.pipeline import (
    PIPELINE_HEADER,
    STAGE_CLOSE_PATH,
    STAGE_HEADER_BYTES,
    STAGE_PATH,
    STAGE_POSITIONS_UNKNOWN,
    DissolveEstimate,
    Hop,
    PipelineHead,
    PipelineProtocolError,
    RequestTiming,
    StageCall,
    StageClient,
    StageQueue,
    decode_frame,
    dissolve_estimate,
    encode_frame,
    move_pays,
    params_from_json,
    parse_route,
    route_header,
    stage_body_limit,
)
from pipecast.agent.local_api import LocalApiServer
from pipecast.agent.peer_server import PeerServer
from pipecast.agent.transport.base import PeerAuth
from pipecast.core.credentials import data_plane_key, serving_headers, serving_key
from pipecast.engine.sampling import SamplingParams
from pipecast.engine.stage import StageOutput
from pipecast.serve.errors import (
    ServingKeyError,
    ServingKeyUnknownError,
    StageBusyError,
    StageFailedError,
    StageQueueFullError,
    WorkerClosingError,
)
from pipecast.serve import worker as worker_module
from pipecast.serve.app import build_app, run_worker
from pipecast.serve.worker import ServingWorker, WorkerConfig
from tests.router.test_app import eventually
from tests.serve.test_app import CLIENT_TIMEOUT, health, serving, wait_health
from tests.support import packages
from tests.support.engine_fixtures import GatedAgent, random_prompt
from tests.support.agent_processes import free_ports

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("no_configured_agent")]

MODEL = "tiny-llama"
PROMPT = random_prompt(10, 8)


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    """A tiny llama of 6 layers (one a block) with a byte-level tokenizer."""
    return packages.tiny_package(tmp_path_factory.mktemp("pipe") / "pkg", seed=6, layers=6, tokenizer=True).path


@pytest.fixture(scope="module")
def reference(pkg):
    with pipecast.load(pkg) as model:
        yield lambda prompt, n: model.generate(prompt, max_new_tokens=n, timeout=30)


def route(urls_and_cuts) -> str:
    return route_header([Hop(url, range(a, b)) for url, a, b in urls_and_cuts])


def completion(n: int, stream: bool = False) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": n, "temperature": 0, "return_token_ids": True,
            "stream": stream}


async def post(http, url, body, headers=None):
    async with http.post(f"{url}/v1/completions", json=body, headers=headers or {}) as response:
        return response.status, await response.json()


# --- routes and frames -------------------------------------------------------------------------------


def raw_frame(header: dict, data: bytes) -> bytes:
    head = json.dumps(header).encode()
    return len(head).to_bytes(4, "big") + head + data


def test_frames_carry_tensors_exactly():
    for dtype in (torch.float32, torch.bfloat16):
        tensor = torch.randn(1, 5, 8).to(dtype)
        header, back = decode_frame(encode_frame({"session": "s"}, tensor))
        assert header == {"session": "s"} and back.dtype == dtype and torch.equal(back, tensor)
    assert decode_frame(encode_frame({"token": 7})) == ({"token": 7}, None)


@pytest.mark.parametrize("frame, message", [
    (b"\x00\x00", "a frame of 2 bytes is shorter than its header says"),
    (b"\x00\x00\x00\x02[]", "the frame's header is not a JSON object"),
    (encode_frame({"token": 1}) + b"x", "1 bytes follow a header that names no tensor"),
    (encode_frame({}, torch.zeros(2))[:-1], r"the frame's tensor float32\[2\] needs 8 bytes, 7 follow the header"),
    (raw_frame({"tensor": {"dtype": "int64", "shape": [1]}}, b"\0" * 8),
     "must name a dtype of float32, bfloat16, float16"),
    # empty tensors whose sizes torch cannot allocate (found by fuzzing: a TypeError and a RuntimeError before)
    (raw_frame({"tensor": {"dtype": "float32", "shape": [0, 1 << 63]}}, b""),
     "and a shape of at most 4 sizes from 0 to 2147483647, got"),
    (raw_frame({"tensor": {"dtype": "float32", "shape": [1 << 62, 1 << 62, 0]}}, b""),
     "and a shape of at most 4 sizes from 0 to 2147483647, got"),
    (raw_frame({"tensor": {"dtype": "float32", "shape": [1, 1, 1, 1, 0]}}, b""), "at most 4 sizes"),
])
def test_malformed_frames_are_refused_naming_what(frame, message):
    with pytest.raises(PipelineProtocolError, match=message):
        decode_frame(frame)


@pytest.mark.parametrize("value, message", [
    ({"temperature": 1, "top_p": 1, "seed": 1e300}, "seed an integer or null"),
    ({"temperature": 1, "top_p": 1, "seed": True}, "seed an integer or null"),
    ({"temperature": "nan", "top_p": 1, "seed": 1}, "temperature and top_p must be numbers"),
    ({"temperature": 1, "top_p": 1, "seed": 1 << 64}, "seed must be an integer from -2\\^63 to 2\\^64-1"),
    ({"temperature": float("inf"), "top_p": 1, "seed": 1}, "temperature must be a number >= 0, got inf"),
    ({"temperature": 1, "top_p": 1}, "'params' must be an object with temperature, top_p and seed"),
])
def test_bad_sampling_params_of_a_stage_call_are_refused_by_name(value, message):
    with pytest.raises(PipelineProtocolError, match=message):
        params_from_json(value)
    assert params_from_json({"temperature": 0.7, "top_p": 0.9, "seed": -(1 << 63)}).seed == -(1 << 63)


@pytest.mark.parametrize("value, message", [
    ([], "a route is a list of 1 to 64 stages"),
    ([{"url": "http://a:1", "layers": [1, 2]}], r"stage 0 of the route must run layers \[0, stop\)"),
    ([{"url": "http://a:1", "layers": [0, 2]}, {"url": "http://b:1", "layers": [3, 4]}],
     r"stage 1 of the route must run layers \[2, stop\)"),
    ([{"url": "ftp://a", "layers": [0, 2]}], "stage 0 of the route has no http\\(s\\) URL"),
    ([{"url": "http://a:1"}], "stage 0 of the route must be an object with 'url' and 'layers'"),
    # found in review: a 503 blaming a stage ("session ... is open already"), not a 400 for the route
    ([{"url": "http://a:1", "layers": [0, 2]}, {"url": "http://b:1", "layers": [2, 3]},
      {"url": "http://a:1/", "layers": [3, 4]}], "stage 2 of the route names http://a:1 again"),
])
def test_bad_routes_are_refused_naming_the_stage(value, message):
    with pytest.raises(PipelineProtocolError, match=message):
        parse_route(value)


CALL = {"session": "s", "layers": [0, 3], "position": 0, "deadline_s": 5, "params": None}


@pytest.mark.parametrize("fields, message", [
    # a stage call's stages after it: a list (none: absent, null or []), never what reads as false
    ({"next": {}}, "'next' must be a list of the stages after this one, got {}"),
    ({"next": 0}, "'next' must be a list of the stages after this one, got 0"),
    ({"next": ""}, "'next' must be a list of the stages after this one, got $"),
    ({"next": [{"url": "http://a:1", "layers": [4, 6]}]}, r"stage 0 of the route must run layers \[3, stop\)"),
    ({"deadline_s": True}, r"'deadline_s' must be a number of seconds in \(0, 3600\], got True"),
    ({"session": "s" * 65}, "'session' must be a string of 1 to 64 characters"),
])
def test_bad_fields_of_a_stage_call_are_refused_naming_them(fields, message):
    with pytest.raises(PipelineProtocolError, match=message):
        StageCall.from_header(CALL | fields)
    assert [StageCall.from_header(CALL | {"next": none}).following for none in (None, [])] == [(), ()]
    assert StageCall.from_header(CALL | {"session": "s" * 64}).session == "s" * 64


# --- requests through stages -------------------------------------------------------------------------


async def test_a_request_through_three_stages_answers_the_single_node_tokens(pkg, reference):
    expected = reference(PROMPT, 12)
    async with serving(WorkerConfig(str(pkg))) as (a, wa, _, http), \
            serving(WorkerConfig(str(pkg))) as (b, wb, _, _), serving(WorkerConfig(str(pkg))) as (c, wc, _, _):
        header = {PIPELINE_HEADER: route([(a, 0, 2), (b, 2, 5), (c, 5, 6)])}
        status, answer = await post(http, a, completion(12), header)
        assert status == 200, answer
        assert answer["choices"][0]["token_ids"] == expected
        # streamed, token by token, through the same stages
        async with http.post(f"{a}/v1/completions", json=completion(12, stream=True), headers=header) as response:
            events = [json.loads(line[6:]) for line in (await response.text()).split("\n\n")
                      if line.startswith("data: {")]
        assert [t for e in events for t in e["choices"][0]["token_ids"]] == expected
        # two stages, and a route headed by the only stage (a worker alone)
        status, answer = await post(http, a, completion(12), {PIPELINE_HEADER: route([(a, 0, 3), (c, 3, 6)])})
        assert answer["choices"][0]["token_ids"] == expected
        # closing the sessions along the route is asynchronous
        await eventually(lambda: [w.stage_runner().sessions for w in (wa, wb, wc)] == [0, 0, 0])


async def test_a_dead_stage_fails_the_request_with_503_naming_it_and_a_bad_route_is_a_400(pkg):
    dead = f"http://127.0.0.1:{free_ports(1)[0]}"
    async with serving(WorkerConfig(str(pkg))) as (a, worker, _, http):
        status, answer = await post(http, a, completion(4), {PIPELINE_HEADER: route([(a, 0, 3), (dead, 3, 6)])})
        assert status == 503 and answer["error"]["code"] == "pipeline_stage_failed"
        assert answer["error"]["message"].startswith(f"pipeline stage {dead} failed: ")
        status, answer = await post(http, a, completion(4), {PIPELINE_HEADER: route([(a, 0, 3), (dead, 3, 5)])})
        assert status == 400 and answer["error"]["param"] == PIPELINE_HEADER
        assert "the route runs layers 0-4, the model has 6" in answer["error"]["message"]
        status, answer = await post(http, a, completion(4), {PIPELINE_HEADER: "[1"})
        assert status == 400 and answer["error"]["param"] == PIPELINE_HEADER
        # a prompt the model cannot take is the client's 400, as without a route, not the route's 503 (fuzzed)
        for prompt in ([-1], [1 << 63]):
            status, answer = await post(http, a, completion(4) | {"prompt": prompt},
                                        {PIPELINE_HEADER: route([(a, 0, 3), (dead, 3, 6)])})
            assert status == 400 and answer["error"]["param"] == "prompt", answer
            assert "are outside the vocabulary" in answer["error"]["message"]
        assert worker.stage_runner().sessions == 0


async def test_a_route_naming_its_head_again_under_any_name_is_a_400_for_the_route_not_a_failed_stage(pkg):
    """Found in review: the head (first stage here, or not named first) called itself on, and its runner, which held
    the session, answered "open already": a 503 pipeline_stage_failed blaming this worker, which the router retried
    and held against it. Named again under another host name, parse_route's check of URLs does not see it."""
    async with serving(WorkerConfig(str(pkg))) as (a, wa, _, http), serving(WorkerConfig(str(pkg))) as (b, wb, _, _):
        alias = a.replace("127.0.0.1", "localhost")
        for stages, named in (([(b, 0, 3), (a, 3, 6)], a), ([(a, 0, 3), (alias, 3, 6)], alias),
                              ([(a, 0, 2), (b, 2, 4), (alias, 4, 6)], alias)):
            status, answer = await post(http, a, completion(4), {PIPELINE_HEADER: route(stages)})
            assert (status, answer["error"]["param"]) == (400, PIPELINE_HEADER), answer
            assert answer["error"]["message"] == f"{PIPELINE_HEADER}: the route names this worker twice (as {named})"
        await eventually(lambda: [w.stage_runner().sessions for w in (wa, wb)] == [0, 0])
        assert not wa._head._headed


async def test_a_stage_process_killed_mid_request_fails_it_naming_the_stage(pkg, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPECAST_")}
    with (tmp_path / "tail.log").open("w") as log:
        tail = subprocess.Popen([sys.executable, "-m", "pipecast.cli", "serve", str(pkg), "--host", "127.0.0.1",
                                 "--port", "0"], stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        match = re.fullmatch(r"pipecast serve: listening on (http://\S+)\n", tail.stdout.readline())
        assert match, (tmp_path / "tail.log").read_text()
        c = match.group(1)
        async with serving(WorkerConfig(str(pkg))) as (a, _, _, http), serving(WorkerConfig(str(pkg))) as (b, _, _, _):
            header = {PIPELINE_HEADER: route([(a, 0, 2), (b, 2, 4), (c, 4, 6)])}
            status, answer = await post(http, a, completion(3), header)  # the tail loads, then answers
            assert status == 200, answer
            async with http.post(f"{a}/v1/completions", json=completion(100, stream=True),
                                 headers=header) as response:
                first = await response.content.readline()
                assert first.startswith(b"data: {")
                tail.send_signal(signal.SIGKILL)
                rest = (await response.content.read()).decode()
            events = [json.loads(e.strip()[6:]) for e in rest.split("\n\n") if e.strip().startswith("data: {")]
            assert "error" in events[-1] and events[-1]["error"]["code"] == "pipeline_stage_failed"
            assert f"pipeline stage {c} failed" in events[-1]["error"]["message"]
            assert len(events) < 99  # it failed, it did not finish
            # a new request fails before any answer: the router retries it on another worker
            status, answer = await post(http, a, completion(3), header)
            assert status == 503 and f"pipeline stage {c} failed" in answer["error"]["message"]
    finally:
        if tail.poll() is None:
            tail.kill()
        tail.wait()
        tail.stdout.close()


async def test_with_the_clusters_serving_key_only_its_holders_reach_completions_and_stages(pkg, reference):
    """Workers that hold the cluster's serving key take completions and stage calls only with it (401 before
    the body is read otherwise; /health and /metrics stay open), present it to the stages they call, and a
    stage of another cluster refuses the head's call: the request fails naming that stage."""
    key, other = serving_key(data_plane_key("master")), serving_key(data_plane_key("another"))
    mine = serving_headers(key)
    async with serving(WorkerConfig(str(pkg), serving_key=key)) as (a, _, _, http), \
            serving(WorkerConfig(str(pkg), serving_key=key)) as (b, _, _, _), \
            serving(WorkerConfig(str(pkg), serving_key=other)) as (c, _, _, _):
        header = {PIPELINE_HEADER: route([(a, 0, 3), (b, 3, 6)])}
        status, answer = await post(http, a, completion(6), {**header, **mine})
        assert status == 200 and answer["choices"][0]["token_ids"] == reference(PROMPT, 6)
        for presented, words in (({}, "is missing"), (serving_headers(other), "holds another key")):
            status, answer = await post(http, a, completion(6), {**header, **presented})
            assert status == 401 and answer["error"]["code"] == "invalid_serving_key", answer
            assert answer["error"]["message"] == (
                "this worker takes requests only from its cluster's router and serving workers: the "
                f"X-Pipecast-Serving-Key header {words}")
            frame = encode_frame({"session": "s", "layers": [3, 6], "position": 0, "params": None, "next": [],
                                  "deadline_s": 5}, torch.zeros(1, 3, 64))
            for path, data in (("/v1/stage", frame), ("/v1/stage/close", b'{"session": "s"}')):
                async with http.post(f"{b}{path}", data=data, headers=presented) as response:
                    assert response.status == 401, path
                    assert words in (await response.json())["error"]["message"]
        async with http.get(f"{a}/health") as response:
            assert response.status == 200
        async with http.get(f"{a}/metrics") as response:
            assert 'pipecast_serve_requests_total{outcome="invalid"} 2.0' in await response.text()
        status, answer = await post(http, a, completion(6), {PIPELINE_HEADER: route([(a, 0, 3), (c, 3, 6)]), **mine})
        assert status == 503 and answer["error"]["code"] == "pipeline_stage_failed"
        assert answer["error"]["message"].startswith(f"pipeline stage {c} failed: ")
        assert "X-Pipecast-Serving-Key header holds another key" in answer["error"]["message"]


async def test_a_worker_learns_the_serving_key_from_its_agent_waits_for_it_and_follows_a_change(pkg, tmp_path,
                                                                                                  monkeypatch):
    """Fed by its node agent, a worker asks it for the key: while the agent has not registered, requests
    wait for it; once it is known they must present it; when the cluster's credentials change, a request
    presenting a key the worker does not hold sends it to its agent again (at most every KEY_RECHECK_S)."""
    monkeypatch.setattr(worker_module, "KEY_RECHECK_S", 0.5)
    auth = PeerAuth("n1", None)
    server = LocalApiServer(PeerServer(), status=dict, auth=auth)
    await server.start(tmp_path / "agent.sock")
    try:
        # The agent holds no package: the worker loads its folder after a second (the unicast fallback).
        config = WorkerConfig(str(pkg), agent=tmp_path / "agent.sock", agent_timeout_s=1.0)
        async with serving(config) as (a, worker, _, http):
            with pytest.raises(ServingKeyUnknownError, match="the worker has not learned its cluster's serving "
                                                             "key from its node agent within 0.1 s"):
                await worker.check_serving_key(None, 0.1)
            waiting = asyncio.ensure_future(post(http, a, completion(3)))
            await asyncio.sleep(0.2)
            assert not waiting.done()
            auth.set_key(data_plane_key("master"))
            status, answer = await waiting
            assert status == 401 and "header is missing" in answer["error"]["message"]
            old, new = (serving_headers(serving_key(data_plane_key(m))) for m in ("master", "rotated"))
            assert (await post(http, a, completion(3), old))[0] == 200
            assert (await post(http, a, completion(3), new))[0] == 401  # asks the agent: no change
            auth.set_key(data_plane_key("rotated"))  # e.g. the agent restarted with new cluster credentials
            assert (await post(http, a, completion(3), new))[0] == 401  # not asked again within 0.5 s
            await asyncio.sleep(0.5)
            status, answer = await post(http, a, completion(3), new)
            assert status == 200, answer
            status, answer = await post(http, a, completion(3), old)
            assert status == 401 and "header holds another key" in answer["error"]["message"]
            assert worker.stage_client.headers == new  # the stages it calls present the new one too
    finally:
        await server.close()


@pytest.mark.parametrize("copy", ["folder", "disk cache"])
async def test_a_worker_serving_its_folder_while_the_agent_refuses_asks_again_until_it_answers(tmp_path,
                                                                                                monkeypatch, copy):
    """An agent that refuses (it restarts) when a worker with a package folder asks for the key leaves the worker
    keyless only until it answers: the worker took every request for its whole life and never asked again.
    Found in review: a package id whose copy is in the agent's disk cache loaded and said ready, but never went
    keyless: every request waited 30 s for the key, then 503."""
    import socket

    monkeypatch.setattr(worker_module, "KEY_RECHECK_S", 0.05)
    path = tmp_path / "agent.sock"
    with socket.socket(socket.AF_UNIX) as stale:  # a restarting agent's socket: connection refused
        stale.bind(str(path))
    package = str(tmp_path)
    if copy == "disk cache":
        package = "ab" * 32
        (tmp_path / package).mkdir()
        monkeypatch.setenv("PIPECAST_AGENT_CACHE_DIR", str(tmp_path))
    worker = ServingWorker(WorkerConfig(package, agent=path, agent_timeout_s=0.5))
    worker._loop, worker._key_known = asyncio.get_running_loop(), asyncio.Event()
    learner = threading.Thread(target=worker._learn_serving_key, daemon=True)
    learner.start()
    try:
        await eventually(lambda: worker._serving_key == b"")
        await worker.check_serving_key(None, 0.1)  # served keyless while the agent does not answer
        path.unlink()
        server = LocalApiServer(PeerServer(), status=dict, auth=PeerAuth("n1", data_plane_key("master")))
        await server.start(path)
        try:
            await eventually(lambda: bool(worker._serving_key))
        finally:
            await server.close()
        key = serving_key(data_plane_key("master"))
        assert worker._serving_key == key and worker.stage_client.headers == serving_headers(key)
        with pytest.raises(ServingKeyError, match="header is missing"):
            await worker.check_serving_key(None, 0.1)
    finally:
        worker._closing = True
        await asyncio.to_thread(learner.join, 5)
    assert not learner.is_alive()


async def test_a_stage_that_never_answers_is_named_by_the_stage_before_it(pkg):
    """Each stage passes the next a little less time than it has: the stage before a hung one times it out
    first and names it, before its own caller gives up on it."""
    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # accepts, reads, never answers
        writer.close()

    hung_server = await asyncio.start_server(hold, "127.0.0.1", 0)
    hung = f"http://127.0.0.1:{hung_server.sockets[0].getsockname()[1]}"
    config = WorkerConfig(str(pkg), pipeline_step_timeout_s=2.0)
    try:
        async with serving(config) as (a, _, _, http), serving(config) as (b, _, _, _):
            status, answer = await post(http, a, completion(4),
                                        {PIPELINE_HEADER: route([(a, 0, 2), (b, 2, 4), (hung, 4, 6)])})
    finally:
        hung_server.close()
    assert status == 503 and answer["error"]["message"].startswith(f"pipeline stage {hung} failed: "), answer


async def test_a_stage_without_room_answers_busy_and_the_head_429_naming_it(pkg):
    """A stage at its bound of stage calls (or sessions) is load, not a failure: the head answered 503
    pipeline_stage_failed, and the router took the pipeline out as failed for 30 s. Now 429 with Retry-After, which
    the router takes as busy."""
    async with serving(WorkerConfig(str(pkg))) as (a, _, _, http), serving(WorkerConfig(str(pkg))) as (b, wb, _, _):
        async def full(*args, **kwargs):
            raise StageQueueFullError(3)

        wb.stage_queue.call = full
        async with http.post(f"{a}/v1/completions", json=completion(4),
                             headers={PIPELINE_HEADER: route([(a, 0, 3), (b, 3, 6)])}) as response:
            answer = await response.json()
        assert (response.status, response.headers.get("Retry-After")) == (429, "1"), answer
        assert answer["error"]["code"] == "pipeline_busy"
        assert answer["error"]["message"] == (f"pipeline stage {b} is busy: this worker already holds 3 stage calls; "
                                              "retry elsewhere or later")


@pytest.mark.parametrize("where", ["head", "stage"])
async def test_torchs_own_error_in_a_stage_is_a_stage_failure_the_router_retries(pkg, where):
    """Found in review: an error of torch's own (out of memory) in the head's prefill answered a plain-text 500, which
    the router neither retried nor held against the pipeline; in a later stage, a 500 quoted twice ("answered 500:
    answered 500: b'500 Internal Server Error...'"). Now 503 pipeline_stage_failed naming the stage, in JSON."""
    async with serving(WorkerConfig(str(pkg))) as (a, wa, _, http), serving(WorkerConfig(str(pkg))) as (b, wb, _, _):
        runner = await (wa if where == "head" else wb).wait_stage_runner(30)
        await (wb if where == "head" else wa).wait_stage_runner(30)  # both loading: the sessions are looked at below

        def out_of_memory(*args, **kwargs):
            raise RuntimeError("simulated out of memory")

        runner.run = out_of_memory
        status, answer = await post(http, a, completion(4), {PIPELINE_HEADER: route([(a, 0, 3), (b, 3, 6)])})
        failed = a if where == "head" else b
        assert status == 503 and answer["error"]["code"] == "pipeline_stage_failed", answer
        assert answer["error"]["message"] == f"pipeline stage {failed} failed: " + (
            "the engine failed: simulated out of memory" if where == "head" else
            "answered 500: the engine failed: simulated out of memory")
        await eventually(lambda: not wa.stage_runner().sessions and not wb.stage_runner().sessions)


async def test_requests_a_worker_heads_through_a_pipeline_are_not_its_engines_batch_nor_queue(pkg):
    """Found in review: a head counted its pipelined requests as its engine's: with 4 in flight (batch 2, queue 2) its
    /health showed a full batch and a queue while its engine was idle, and it refused a request of its own as
    queue_full (the router then took it for full, and the scaling daemon saw a queue)."""
    # Finished through the stages: the head loads the whole model too, and once it holds it a request moved to its
    # engine is rightly its engine's (a race with the load on a busy machine: failed once in a full run).
    async with serving(WorkerConfig(str(pkg), max_batch=2, max_queue=2, pipeline_dissolve="finish")) as \
            (a, wa, _, http), \
            serving(WorkerConfig(str(pkg))) as (b, wb, _, _):
        tail = await wb.wait_stage_runner(30)
        run = tail.run

        def slow(*args, **kwargs):  # the pipelined requests stay in flight
            time.sleep(0.05)
            return run(*args, **kwargs)

        tail.run = slow
        streams = [await http.post(f"{a}/v1/completions", json=completion(100, stream=True),
                                   headers={PIPELINE_HEADER: route([(a, 0, 3), (b, 3, 6)])}) for _ in range(4)]
        try:
            assert [r.status for r in streams] == [200] * 4
            state = await health(http, a)
            assert (state["running"], state["queue_depth"]) == (0, 0), state
            assert (await post(http, a, completion(2)))[0] == 200
        finally:
            for response in streams:
                response.close()


async def test_a_pipelined_prompt_running_through_the_stages_is_not_in_the_heads_queue(pkg):
    """Found in review: a head kept a pipelined request in its queue while its prompt ran through the stages (up to
    the step deadline while their layers arrive), so two of them refused a request of its idle engine as
    queue_full (max_queue 2)."""
    async with serving(WorkerConfig(str(pkg), max_batch=2, max_queue=2)) as (a, wa, _, http), \
            serving(WorkerConfig(str(pkg))) as (b, wb, _, _):
        tail = await wb.wait_stage_runner(30)
        run, gate, calls = tail.run, threading.Event(), []

        def held(*args, **kwargs):  # the tail's prefill waits (its layers still arriving)
            calls.append(args)
            gate.wait(20)
            return run(*args, **kwargs)

        tail.run = held
        header = {PIPELINE_HEADER: route([(a, 0, 3), (b, 3, 6)])}
        pipelined = [asyncio.create_task(post(http, a, completion(4), header)) for _ in range(2)]
        try:
            await eventually(lambda: calls and wa.stage_runner().sessions == 2, 10)  # both past the head's layers
            state = await health(http, a)
            assert (state["queue_depth"], state["pipeline_sessions"]) == (0, 2), state
            assert (await post(http, a, completion(2)))[0] == 200
        finally:
            gate.set()
        assert [status for status, _ in await asyncio.gather(*pipelined)] == [200, 200]


@asynccontextmanager
async def signalled_worker(pkg):
    """A worker served as `pipecast serve` serves it (:func:`run_worker`: drained on SIGTERM, for 30 s at most): its
    URL, the worker, and the task that ends once it stopped."""
    urls: list[str] = []
    worker = ServingWorker(WorkerConfig(str(pkg)))
    stopped = asyncio.create_task(run_worker(worker, "127.0.0.1", 0, 30.0, urls.append))
    try:
        await eventually(lambda: urls, 30)
        await worker.wait_stage_runner(30)
        yield urls[0], worker, stopped
    finally:
        stopped.cancel()
        await asyncio.gather(stopped, return_exceptions=True)


async def test_a_stage_told_to_stop_serves_the_requests_under_way_through_it_then_stops(pkg):
    """Found in review: a stage told to stop (SIGTERM: a rollout, a scale-down) stopped listening and refused every
    call at once, --drain-timeout or not, so each pipelined request through it failed mid-stream, where the router
    cannot retry it. It drains as it does its own requests: still listening, it serves the sessions it holds (and
    refuses new ones) until they end."""
    async with signalled_worker(pkg) as (b, middle, stopped), serving(WorkerConfig(str(pkg))) as (a, _, _, http), \
            serving(WorkerConfig(str(pkg))) as (c, wc, _, _):
        tail = await wc.wait_stage_runner(30)
        run = tail.run

        def slow(*args, **kwargs):  # the request is still under way when the middle stage is told to stop
            time.sleep(0.02)
            return run(*args, **kwargs)

        tail.run = slow
        header = {PIPELINE_HEADER: route([(a, 0, 2), (b, 2, 4), (c, 4, 6)])}
        async with http.post(f"{a}/v1/completions", json=completion(40, stream=True), headers=header) as response:
            await response.content.readline()
            os.kill(os.getpid(), signal.SIGTERM)
            await eventually(lambda: middle.health().status == "draining")
            status, answer = await post(http, a, completion(4), header)  # a new one: before any answer left
            assert (status, answer["error"]["code"]) == (503, "pipeline_stage_failed"), answer
            assert answer["error"]["message"].endswith("answered 503: the worker is shutting down")
            text = (await response.read()).decode()
        assert '"error"' not in text and text.rstrip().endswith("data: [DONE]"), text[-300:]
        await asyncio.wait_for(stopped, 10)  # once the session ended, not after the drain's 30 s


@pytest.mark.parametrize("stopping", ["head", "middle"])
async def test_a_prefill_under_way_when_its_stage_is_told_to_stop_is_answered(pkg, stopping):
    """Found in review of the stage's drain: a head told to stop waited for its pipelined prefill, then failed it
    (503) for the drain; a middle stage whose call had not opened its session yet (its layers arriving) was not
    waited for, and the call was cut."""
    async with signalled_worker(pkg) as (b, stopped_worker, stopped), \
            serving(WorkerConfig(str(pkg))) as (a, _, _, http), serving(WorkerConfig(str(pkg))) as (c, wc, _, _):
        slowed = await (stopped_worker if stopping == "middle" else wc).wait_stage_runner(30)
        run, calls = slowed.run, []

        def slow(*args, **kwargs):  # a prefill waiting for its layers, before its session opens
            calls.append(args)
            time.sleep(1.0)
            return run(*args, **kwargs)

        slowed.run = slow
        head, cuts = (a, [(a, 0, 2), (b, 2, 4), (c, 4, 6)]) if stopping == "middle" else (b, [(b, 0, 3), (c, 3, 6)])
        request = asyncio.create_task(post(http, head, completion(4), {PIPELINE_HEADER: route(cuts)}))
        await eventually(lambda: calls, 10)
        os.kill(os.getpid(), signal.SIGTERM)
        status, answer = await request
        assert status == 200 and len(answer["choices"][0]["token_ids"]) == 4, answer
        await asyncio.wait_for(stopped, 10)


@pytest.mark.parametrize("framing", ["length", "chunked"])
async def test_a_stage_draining_serves_a_call_that_came_before_and_waits_for_no_session_its_head_left(pkg, framing):
    """Found in review of the stage's drain: a prefill call whose body was still arriving when the drain began was
    waited for, then refused (503), whether its frame came with a length or chunked (a large frame's path); and a
    session whose head went away without closing it held the drain for its whole --drain-timeout (sessions expire
    after minutes)."""
    async with signalled_worker(pkg) as (url, worker, stopped), aiohttp.ClientSession() as http:
        runner = worker.stage_runner()
        width, layers = runner.model.config.hidden_size, runner.model.num_layers
        # A head's prefill, answered; then the head is gone.
        left = StageCall("left", range(3, layers), 0, 0.5, (), SamplingParams(max_tokens=4, temperature=0))
        async with http.post(url + STAGE_PATH, data=encode_frame(left.header(), torch.zeros(1, 3, width))) as response:
            assert response.status == 200
        await asyncio.sleep(0.6)  # past its step's deadline: no call of it is under way anywhere
        call = StageCall("new", range(3, layers), 0, 20.0, (), SamplingParams(max_tokens=4, temperature=0))
        frame = encode_frame(call.header(), torch.zeros(1, 3, width))
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        if framing == "length":
            head, rest = f"Content-Length: {len(frame)}", (frame[:len(frame) // 2], frame[len(frame) // 2:])
        else:
            head, rest = "Transfer-Encoding: chunked", (b"", f"{len(frame):x}\r\n".encode() + frame + b"\r\n0\r\n\r\n")
        writer.write(f"POST {STAGE_PATH} HTTP/1.1\r\nHost: x\r\n{head}\r\n\r\n".encode() + rest[0])
        await writer.drain()
        await eventually(lambda: worker._requests == 1)
        os.kill(os.getpid(), signal.SIGTERM)
        await eventually(lambda: worker.health().status == "draining")
        writer.write(rest[1])
        await writer.drain()
        assert (await asyncio.wait_for(reader.readline(), 10)).startswith(b"HTTP/1.1 200"), "refused"
        writer.close()
        # Its request ends: its head closes it.
        async with http.post(url + STAGE_CLOSE_PATH, json={"session": "new", "next": []}) as response:
            assert response.status == 200
        await asyncio.wait_for(stopped, 5)  # the session its head left held it back for the drain's 30 s


async def test_a_completion_that_came_before_the_drain_is_answered_though_its_body_comes_after(pkg):
    """Found in review of the drain: a completion whose body was still arriving when it began was waited for, then
    refused 503 (a stalled one held the stop for the whole --drain-timeout for nothing)."""
    async with signalled_worker(pkg) as (url, worker, stopped), aiohttp.ClientSession() as http:
        assert (await post(http, url, completion(2)))[0] == 200  # its tokenizer is in
        body = json.dumps(completion(4)).encode()
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:5])
        await writer.drain()
        await eventually(lambda: worker._requests == 1)
        os.kill(os.getpid(), signal.SIGTERM)
        await eventually(lambda: worker.health().status == "draining")
        assert (await post(http, url, completion(2)))[0] == 503  # one that comes now is refused
        writer.write(body[5:])
        await writer.drain()
        assert (await asyncio.wait_for(reader.readline(), 10)).startswith(b"HTTP/1.1 200"), "refused"
        writer.close()
        await asyncio.wait_for(stopped, 5)


async def test_a_full_queue_at_the_heads_own_sampling_step_is_load_not_a_failure():
    """Found in review: with tied embeddings the head samples the token itself; its stage queue full at that step
    failed the request (503, the router took the pipeline out for 30 s) where the same at its layers is busy (429)."""
    class TiedHead:
        model = SimpleNamespace(vocab_size=256, skeleton=SimpleNamespace(tied_embeddings=True),
                                config=SimpleNamespace(hidden_size=8), fully_loaded=True)

        def run(self, session, layers, position, *, tokens, params, timeout):
            return StageOutput(hidden=torch.zeros(1, len(tokens), 8))

        def sample(self, session, normed, *, timeout):
            return StageOutput(token=3)

        def parts(self, layers):
            return []

        def waiter(self, parts):
            return None

        def close(self, session):
            pass

    queue, release, other = StageQueue(max_calls=1), threading.Event(), []

    class Client:
        async def forward(self, hops, session, position, hidden, **kwargs):
            # another stage call comes meanwhile and takes this worker's one slot
            other.append(asyncio.ensure_future(queue.call(lambda timeout: release.wait(5) and StageOutput(),
                                                          deadline=time.monotonic() + 60)))
            await asyncio.sleep(0.05)
            return torch.zeros(1, 1, 8)

        def pass_close_on(self, hops, session):
            pass

    head = PipelineHead(TiedHead(), Client(), queue, local=None)
    try:
        with pytest.raises(StageBusyError, match="^pipeline stage http://head:1 is busy: this worker already holds 1 "
                                                 "stage calls"):
            await head.start((Hop("http://head:1", range(0, 3)), Hop("http://tail:1", range(3, 6))), [1, 2],
                             SamplingParams(max_tokens=4))
    finally:
        release.set()
        await asyncio.gather(*other, return_exceptions=True)
        queue.close()


async def test_a_head_that_waits_for_the_whole_model_serves_its_pipelines_at_once(pkg, reference):
    """``wait_full_load`` holds the worker's own requests until it holds the whole model; a request through a
    pipeline it heads needs only its stage's layers."""
    agent = GatedAgent(pkg)
    agent.release(*range(len(agent.buffers) - 1))  # all but the last layer's block
    async with serving(WorkerConfig(str(pkg), agent=agent, wait_full_load=True)) as (a, _, _, http), \
            serving(WorkerConfig(str(pkg))) as (b, _, _, _):
        async with asyncio.timeout(20):
            status, answer = await post(http, a, completion(6), {PIPELINE_HEADER: route([(a, 0, 3), (b, 3, 6)])})
        assert status == 200 and answer["choices"][0]["token_ids"] == reference(PROMPT, 6), answer
        assert (await health(http, a))["status"] == "loading"  # served through the pipeline, loading its own copy
        agent.release()


async def test_stage_calls_with_bad_frames_are_answered_400(pkg):
    async with serving(WorkerConfig(str(pkg))) as (a, _, _, http):
        async with http.post(f"{a}/v1/stage", data=raw_frame({"a": 1}, b"")) as response:
            answer = await response.json()
        assert response.status == 400 and "'session' must be a string" in answer["error"]["message"]
        frame = encode_frame({"session": "s", "layers": [2, 6], "position": 0, "params": None, "next": [],
                              "deadline_s": 5}, torch.zeros(1, 3, 7))
        async with http.post(f"{a}/v1/stage", data=frame) as response:
            answer = await response.json()
        assert response.status == 400 and "hidden states must be [1, positions, 64], got [1, 3, 7]" in \
            answer["error"]["message"]
        # only the stage whose layers end the model's is the last: the others name a stage after them
        for layers, following in (([2, 4], []), ([2, 6], [{"url": a, "layers": [6, 7]}])):
            frame = encode_frame({"session": "s", "layers": layers, "position": 0, "params": None,
                                  "next": following, "deadline_s": 5}, torch.zeros(1, 3, 64))
            async with http.post(f"{a}/v1/stage", data=frame) as response:
                answer = await response.json()
            assert response.status == 400 and answer["error"]["message"] == (
                f"layers {layers[0]}-{layers[1] - 1} of the model's 6 with {len(following)} stage(s) after them: only "
                "the stage whose layers end the model's is the last"), answer
        # "next" that reads as false is no last stage; a bool is no deadline
        for fields, message in (({"layers": [2, 6], "next": {}}, "'next' must be a list"),
                                ({"deadline_s": True}, "'deadline_s' must be a number of seconds")):
            frame = encode_frame({"session": "s", "layers": [3, 6], "position": 0, "params": None, "next": [],
                                  "deadline_s": 5} | fields, torch.zeros(1, 3, 64))
            async with http.post(f"{a}/v1/stage", data=frame) as response:
                answer = await response.json()
            assert response.status == 400 and answer["error"]["message"].startswith(message), answer
        async with aiohttp.ClientSession() as other:
            async with other.post(f"{a}/v1/stage/close", json={"session": "nope"}) as response:
                assert response.status == 200
            # a close names a session as a call does (it is echoed back)
            async with other.post(f"{a}/v1/stage/close", json={"session": "x" * 100_000}) as response:
                assert response.status == 400
                assert (await response.json())["error"]["message"] == "'session' must be a string of 1 to 64 characters"
            # and its next stages as a call does ({} is not "none after me")
            async with other.post(f"{a}/v1/stage/close", json={"session": "s", "next": {}}) as response:
                assert response.status == 400
                assert (await response.json())["error"]["message"].startswith("'next' must be a list of the stages")


def test_a_stage_call_may_carry_the_hidden_states_of_the_models_longest_prompt():
    """Llama-3-8B's float32 hidden states of 2,048 positions are 32 MiB: a stage took 16 MiB at most."""
    llama3 = SimpleNamespace(max_position_embeddings=8192, hidden_size=4096)
    assert stage_body_limit(llama3, 16 << 20) == 8192 * 4096 * 4 + STAGE_HEADER_BYTES
    assert len(encode_frame({"session": "s" * 64}, torch.zeros(1, 2048, 4096))) < stage_body_limit(llama3, 16 << 20)
    # bounded all the same where the config names no positions; no width (not a decoder): the floor
    assert stage_body_limit(SimpleNamespace(hidden_size=4096), 1) == \
        STAGE_POSITIONS_UNKNOWN * 4096 * 4 + STAGE_HEADER_BYTES
    assert stage_body_limit(SimpleNamespace(max_position_embeddings=None, hidden_size=8), 1) == \
        STAGE_POSITIONS_UNKNOWN * 8 * 4 + STAGE_HEADER_BYTES
    assert stage_body_limit(SimpleNamespace(max_position_embeddings=8192), 100) == 100
    assert stage_body_limit(SimpleNamespace(max_position_embeddings=128, hidden_size=64), 16 << 20) == 16 << 20


@asynccontextmanager
async def serving_within(config: WorkerConfig, max_body_bytes: int):
    """A worker served as :func:`serving` serves it, with a lower limit on bodies: (base URL, worker, client)."""
    worker = ServingWorker(config)
    runner = web.AppRunner(build_app(worker, max_body_bytes=max_body_bytes), handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
            yield f"http://{host}:{port}", worker, http
    finally:
        await runner.cleanup()


async def test_a_prompt_whose_hidden_states_pass_the_body_limit_runs_through_the_stages(pkg, reference):
    """A prompt's hidden states travel in one frame, and a stage took no more than a completion body (16
    MiB: Llama-3-8B's float32 prompts of 2,048 tokens failed through every pipeline, the stage a 413, the
    head a 503). Here the limit is lowered under a tiny model's prompt: the stage takes what the model's
    positions need (with a body of any length or none), and refuses more naming that limit."""
    prompt = random_prompt(40, 9)  # 40 x 64 x 4 = 10 KiB of float32 hidden states, over the 4 KiB limit
    expected = reference(prompt, 4)

    async def chunks(data: bytes):
        for start in range(0, len(data), 3000):
            yield data[start:start + 3000]

    async def stage_call(url, data) -> tuple[int, bytes]:
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as own:  # a refused body closes the connection
            async with own.post(f"{url}{STAGE_PATH}", data=data) as response:
                return response.status, await response.read()

    async with serving_within(WorkerConfig(str(pkg)), 4096) as (a, _, http), \
            serving_within(WorkerConfig(str(pkg)), 4096) as (b, wb, _):
        status, answer = await post(http, a, {**completion(4), "prompt": prompt},
                                    {PIPELINE_HEADER: route([(a, 0, 3), (b, 3, 6)])})
        assert status == 200, answer
        assert answer["choices"][0]["token_ids"] == expected
        limit = 128 * 64 * 4 + STAGE_HEADER_BYTES
        assert stage_body_limit(wb.stage_runner().model.config, 4096) == limit
        header = {"session": "chunked", "layers": [3, 6], "position": 0, "params": None, "next": [], "deadline_s": 5}
        status, _ = await stage_call(b, chunks(encode_frame(header, torch.zeros(1, 40, 64))))
        assert status == 200
        over = encode_frame({**header, "session": "over"}, torch.zeros(1, 400, 64))
        for data in (over, chunks(over)):  # its size from its header, with or without a Content-Length
            status, answer = await stage_call(b, data)
            assert (status, json.loads(answer)["error"]["message"]) == \
                (413, f"the request body of {len(over)} bytes is over this server's limit of {limit} bytes")
        # A header naming a small tensor bounds what is read: a longer body is refused, however large the limit.
        padded = encode_frame({**header, "session": "padded"}, torch.zeros(1, 4, 64)) + b"\0" * 4096
        for data, message in ((padded, f"a frame of {len(padded) - 4096} bytes by its header came in a body of "
                                       f"{len(padded)}"),
                              (chunks(padded), f"more than the {len(padded) - 4096} bytes its header says follow a "
                                               "frame's header")):
            status, answer = await stage_call(b, data)
            assert (status, json.loads(answer)["error"]["message"]) == (400, message)
        for data, message in ((b"\x00\x10\x00\x00" + b"{" * 5000, "a frame's header of 1048576 bytes is over a "
                                                                  f"stage call's {STAGE_HEADER_BYTES}"),
                              (b"\x00\x00\x10\x00{", "a frame of 5 bytes is shorter than its header says")):
            status, answer = await stage_call(b, chunks(data))
            assert (status, json.loads(answer)["error"]["message"]) == (400, message)


class LateManifest(GatedAgent):
    """Every block verified, the manifest only once ``arrived`` is set: the worker has no model until then."""

    def __init__(self, pkg) -> None:
        super().__init__(pkg)
        self.arrived = threading.Event()
        self.release()

    def manifest(self, package_id=None, timeout=30.0):
        self.arrived.wait(timeout)
        return super().manifest(package_id, timeout)


async def test_a_large_stage_call_arriving_before_the_model_waits_for_it_within_its_deadline(pkg):
    """The limit on a large frame is the model's: its header is read first, and its deadline bounds the wait."""
    agent = LateManifest(pkg)
    async with serving_within(WorkerConfig(str(pkg), agent=agent), 4096) as (a, _, http):
        header = {"session": "early", "layers": [3, 6], "position": 0, "params": None, "next": [], "deadline_s": 0.3}
        frame = encode_frame(header, torch.zeros(1, 40, 64))
        async with http.post(f"{a}{STAGE_PATH}", data=frame) as response:
            answer = await response.json()
        assert response.status == 504 and re.fullmatch(r"this worker's model did not start loading within 0\.\d+ s",
                                                        answer["error"]["message"]), answer
        agent.arrived.set()
        frame = encode_frame({**header, "deadline_s": 20}, torch.zeros(1, 40, 64))
        async with http.post(f"{a}{STAGE_PATH}", data=frame) as response:
            assert response.status == 200, await response.text()


async def test_a_stage_serving_another_package_refuses_the_call_and_a_bad_package_id_is_a_400(pkg):
    """A route listed before a rollout names a worker that now serves other weights: its layers must not run."""
    async with serving(WorkerConfig(str(pkg))) as (a, worker, _, http):
        await worker.wait_stage_runner(10)
        header = {"session": "s", "layers": [2, 6], "position": 0, "params": None, "next": [], "deadline_s": 5}
        for package, status, message in [
                ("ab" * 32, 409, f"this worker serves package {worker.package_id[:12]}, the call is for abababababab "
                                 f"(a route listed before a rollout)"),
                ("AB" * 32, 400, "'package' must be a package id (64 lower-case hex digits), got " + "AB" * 32)]:
            frame = encode_frame({**header, "package": package}, torch.zeros(1, 3, 64))
            async with http.post(f"{a}/v1/stage", data=frame) as response:
                assert (response.status, (await response.json())["error"]["message"]) == (status, message)
        frame = encode_frame({**header, "package": worker.package_id}, torch.zeros(1, 3, 64))
        async with http.post(f"{a}/v1/stage", data=frame) as response:
            assert response.status == 200
        assert worker.stage_runner().sessions == 1


async def test_a_stage_call_whose_model_fails_to_load_under_it_is_answered_503_naming_why(pkg):
    agent = GatedAgent(pkg)
    agent.release(0, 1)  # the other blocks never come: loading stalls and fails under the waiting call
    async with serving(WorkerConfig(str(pkg), agent=agent, stall_timeout_s=1.0)) as (a, _, _, http):
        frame = encode_frame({"session": "s", "layers": [2, 6], "position": 0, "params": None, "next": [],
                              "deadline_s": 20}, torch.zeros(1, 3, 64))
        async with http.post(f"{a}/v1/stage", data=frame) as response:
            answer = await response.json()  # before: aiohttp's text/plain 500, the cause lost
        assert response.status == 503
        assert answer["error"]["message"].startswith("loading the model failed: ") and answer["error"]["node"] is None


async def test_a_stage_call_running_when_its_model_closes_is_answered_503_the_engine_is_closed(pkg, monkeypatch):
    """A stage call running when the released model closed (its session outlived the release's wait) ran on the meta
    tensors Engine.close leaves, and was answered aiohttp's text/plain 500 with torch's error."""
    monkeypatch.setattr(worker_module, "RELEASE_DRAIN_S", 0.0)  # the release waits for nothing
    agent = GatedAgent(pkg)
    agent.release()
    async with serving(WorkerConfig(str(pkg), agent=agent)) as (a, worker, _, http):
        worker._wait_for_package_again = threading.Event().wait  # the package does not come back here
        await wait_health(http, a, lambda h: h["status"] == "ready")
        model = worker._model
        opened, made = gate_after(worker.stage_runner(), 0)
        frame = encode_frame({"session": "s", "layers": [3, 6], "position": 0, "params": None, "next": [],
                              "deadline_s": 20}, torch.zeros(1, 3, 64))
        call = asyncio.ensure_future(http.post(f"{a}/v1/stage", data=frame))
        await eventually(lambda: made)
        await worker._unload()  # what the agent dropping the package starts: no completion runs, it closes at once
        await eventually(lambda: model.engine.closed)
        opened.set()
        async with await call as response:
            answer = await response.json()
        assert response.status == 503
        assert answer["error"] == {"message": "the engine is closed", "node": None}


# Cut at its prompt (before any token: the head's start fails) or at its second decode step (its stream fails).
@pytest.mark.parametrize("steps", [0, 2])
@pytest.mark.parametrize("closing", [False, True])
async def test_a_pipelined_request_cut_as_its_released_model_closes_is_told_what_the_worker_does(pkg, monkeypatch,
                                                                                                 steps, closing):
    """Found in review: a pipelined request cut as its released model closed (RELEASE_DRAIN_S after the release) was
    told this worker's own stage failed (pipeline_stage_failed, naming it), which the router holds against the worker;
    a request on the engine was told the worker waits for its package. Both are now, or that it shuts down."""
    monkeypatch.setattr(worker_module, "RELEASE_DRAIN_S", 0.2)  # the release waits that long for the request
    async with serving(WorkerConfig(str(pkg))) as (a, worker, _, http):
        worker._wait_for_package_again = threading.Event().wait  # the package does not come back here
        await wait_health(http, a, lambda h: h["status"] == "ready")
        model = worker._model
        opened, made = gate_after(worker._head.runner, steps)
        request = asyncio.create_task(post(http, a, completion(6), {PIPELINE_HEADER: route([(a, 0, 6)])}))
        await eventually(lambda: len(made) > steps)
        unloading = asyncio.create_task(worker._unload())  # what the agent dropping the package starts
        if closing:
            worker.drain()  # told to stop meanwhile
        await unloading
        await eventually(lambda: model.engine.closed)
        opened.set()
        status, answer = await request
    waits = f"package {pkg} was released from this node; the worker waits for it to come back"
    assert status == 503 and answer["error"]["code"] == ("shutting_down" if closing else "model_unavailable"), answer
    assert answer["error"]["message"] == ("the worker is shutting down" if closing else waits)


async def test_a_stage_released_mid_request_serves_its_pipelined_sessions_to_their_end_and_no_new_one(pkg):
    """Found in review: a worker released by its agent (a scale-down) dropped its stage runner at once, so every
    pipelined request of another head through it failed mid-stream, where the router cannot retry. The released
    model now stays open for its live sessions (as for its own requests), a drain meanwhile too, and refuses new
    ones."""
    agent = GatedAgent(pkg)
    agent.release()
    async with serving(WorkerConfig(str(pkg))) as (a, _, _, http), \
            serving(WorkerConfig(str(pkg), agent=agent)) as (b, stage, _, _):
        stage._wait_for_package_again = threading.Event().wait  # the package does not come back here
        await wait_health(http, b, lambda h: h["status"] == "ready")
        status, answer = await post(http, a, completion(6))
        assert status == 200
        expected = answer["choices"][0]["token_ids"]
        model = stage._model
        opened, made = gate_after(stage.stage_runner(), 2)  # the prefill and one decode step run, the next waits
        request = asyncio.create_task(post(http, a, completion(6), {PIPELINE_HEADER: route([(a, 0, 3), (b, 3, 6)])}))
        await eventually(lambda: len(made) == 3)
        unloading = asyncio.create_task(stage._unload())  # what the agent dropping the package starts
        await eventually(lambda: stage._model is None)
        assert stage.health().pipeline_sessions == 1  # its health still counts the session it serves
        new = StageCall("new", range(3, 6), 0, 20.0, (), SamplingParams(max_tokens=4, temperature=0))
        async with http.post(b + STAGE_PATH, data=encode_frame(new.header(), torch.zeros(1, 3, 64))) as response:
            assert response.status == 503 and "was released" in (await response.json())["error"]["message"]
        stage.drain()  # told to stop meanwhile: it waits for them too (the release's wait gave up on a drain)
        await asyncio.sleep(0.3)
        assert not model.engine.closed
        opened.set()
        status, answer = await request
        assert status == 200 and answer["choices"][0]["token_ids"] == expected, answer
        await asyncio.wait_for(unloading, 10)  # its head closed the session: the model closes, not after 30 s
        assert model.engine.closed and not stage._released_runners


async def test_a_tied_model_samples_at_the_head_stage_and_answers_the_single_node_tokens(tmp_path):
    qwen = packages.tiny_package(tmp_path / "qwen", "qwen2", seed=2, layers=4, tokenizer=True).path
    with pipecast.load(qwen) as model:
        expected = model.generate(PROMPT, max_new_tokens=10, timeout=30)
        sampled = model.generate(PROMPT, max_new_tokens=10, temperature=0.9, seed=3, timeout=30)
    async with serving(WorkerConfig(str(qwen))) as (a, _, _, http), serving(WorkerConfig(str(qwen))) as (b, _, _, _):
        body = {**completion(10), "model": "tiny-qwen2"}
        status, answer = await post(http, a, body, {PIPELINE_HEADER: route([(a, 0, 1), (b, 1, 4)])})
        assert status == 200 and answer["choices"][0]["token_ids"] == expected
        body = {**body, "temperature": 0.9, "seed": 3}  # sampled at the head, with the request's seed
        assert (await post(http, a, body, {PIPELINE_HEADER: route([(a, 0, 2), (b, 2, 4)])}))[1]["choices"][0][
            "token_ids"] == sampled


# --- dissolution: the head comes to hold the whole model mid-request ----------------------------------


def gate_after(runner, calls: int) -> tuple[threading.Event, list]:
    """Hold ``runner``'s stage calls after the first ``calls`` until the returned event is set; the list
    gets one entry per call."""
    opened, run, made = threading.Event(), runner.run, []

    def gated(*args, **kwargs):
        made.append(None)
        if len(made) > calls:
            assert opened.wait(30)
        return run(*args, **kwargs)

    runner.run = gated
    return opened, made


def timing(prefill, decode, sample, route_s, own_layers=10, prompt=16) -> RequestTiming:
    """A head's measurements, each step as (seconds, CPU seconds) or as seconds with as much CPU."""
    pair = lambda step: step if isinstance(step, tuple) else (step, step)  # noqa: E731
    t = RequestTiming(own_layers, prompt, own_prefill=pair(prefill))
    t.own_decode.extend(map(pair, decode))
    t.sample.extend(map(pair, sample))
    t.route_s.extend(route_s)
    return t


def test_the_dissolve_estimate_scales_the_heads_own_times_to_the_whole_model():
    # the head ran 10 of 30 layers: 20 ms a token (+5 ms sampling) -> 65 ms locally; the prefill of 16
    # tokens took 100 ms there -> 300 ms for every layer (+5 ms sampling), and the 16 tokens so far a step each
    e = dissolve_estimate(timing(0.1, [0.02, 0.02], [0.005], [0.09, 0.11]), 30, history=32, remaining=100)
    assert e == DissolveEstimate(100, pytest.approx(0.1), pytest.approx(0.065), pytest.approx(0.305 + 16 * 0.065))
    assert move_pays(e)  # 1.345 + 6.5 s here against 10 s through the route
    assert not move_pays(DissolveEstimate(5, 0.1, 0.065, 0.605))  # 5 tokens left: the re-prefill does not pay
    assert not move_pays(DissolveEstimate(100, 0.06, 0.065, 0.0))  # the route is faster a token
    # nothing decoded through the route yet: no estimate (the head takes one more step first)
    assert dissolve_estimate(timing(0.1, [], [], []), 30, 17, 50) is None


def test_under_a_cpu_quota_the_local_engine_is_estimated_at_the_quota_not_at_a_bursts_speed():
    # Each stage's step was a short burst at full speed (20 ms, all of it CPU); the whole model's steps,
    # sustained, get a quarter of a CPU: 65 ms of CPU a token take 260 ms (measured here: a worker alone
    # 393 ms/token, two stages 236 ms/token, so finishing on the route wins).
    measured = timing((0.1, 0.1), [(0.02, 0.02)], [(0.005, 0.005)], [0.236])
    free = dissolve_estimate(measured, 30, history=32, remaining=100)
    quota = dissolve_estimate(measured, 30, history=32, remaining=100, cpus=0.25)
    assert free.local_s == pytest.approx(0.065) and move_pays(free)
    assert quota.local_s == pytest.approx(0.26) and quota.reprefill_s == pytest.approx(1.22 + 16 * 0.26)
    assert not move_pays(quota)
    # a step that waited on a device (wall time, little CPU) is not scaled by the quota
    device = timing((0.1, 0.001), [(0.02, 0.001)], [(0.005, 0.0005)], [0.236])
    assert dissolve_estimate(device, 30, 32, 100, cpus=0.25).local_s == pytest.approx(0.065)


def test_an_auto_head_moves_or_keeps_a_request_as_its_estimate_says_and_counts_what_it_kept():
    class Runner:
        class model:
            num_layers = 30

    head = PipelineHead(Runner(), None, None, local=lambda *_: None)
    assert head.dissolve == "auto" and head.cpus is None
    assert head._should_move(timing(0.1, [0.02], [0.005], []), 17, 50) is None
    assert head._should_move(timing(0.1, [0.02], [0.005], [0.2]), 32, 100) is True
    assert head._should_move(timing(0.1, [0.02], [0.005], [0.05]), 32, 100) is False
    assert (head.moved, head.kept) == (0, 1)  # moving is counted when the local engine takes the request
    quota = PipelineHead(Runner(), None, None, local=lambda *_: None, cpus=0.25)
    assert quota._should_move(timing(0.1, [0.02], [0.005], [0.2]), 32, 100) is False  # 260 ms here
    assert PipelineHead(Runner(), None, None, local=lambda *_: None, dissolve="move")._should_move(
        timing(0.1, [], [], []), 17, 50) is True
    assert PipelineHead(Runner(), None, None, local=lambda *_: None, dissolve="finish").local is None
    with pytest.raises(ValueError, match="dissolve must be one of auto, move, finish, got 'stay'"):
        PipelineHead(Runner(), None, None, dissolve="stay")


async def test_the_stage_queue_computes_one_call_at_a_time_earliest_deadline_first_within_each_deadline():
    queue = StageQueue()
    ran, running, overlap = [], [0], []
    release = threading.Event()

    def compute(name, *, timeout, hold=None):
        running[0] += 1
        overlap.append(running[0])
        if hold is not None:
            hold.wait(5)
        ran.append((name, round(timeout)))
        running[0] -= 1
        return name

    try:
        now = time.monotonic()
        first = asyncio.create_task(queue.call(compute, "a", hold=release, deadline=now + 60))
        await eventually(lambda: ran == [] and overlap == [1])
        late = asyncio.create_task(queue.call(compute, "late", deadline=now + 0.05))
        later = [asyncio.create_task(queue.call(compute, name, deadline=now + 60)) for name in "bcd"]
        # a step that started earlier (the head's sample of an older request's token) goes before them
        urgent = asyncio.create_task(queue.call(compute, "u", deadline=now + 30))
        cancelled = asyncio.create_task(queue.call(compute, "never", deadline=now + 20))
        # a call whose layers are still arriving waits for them before its turn, holding up no other call
        arrived = threading.Event()
        arriving = asyncio.create_task(queue.call(compute, "e", deadline=now + 60,
                                                  wait=lambda timeout: arrived.wait(timeout)))
        after = asyncio.create_task(queue.call(compute, "f", deadline=now + 60))
        await asyncio.sleep(0.1)
        cancelled.cancel()
        release.set()
        assert await first == "a" and [await t for t in later] == list("bcd") and await after == "f"
        assert await urgent == "u"
        arrived.set()
        assert await arriving == "e"
        with pytest.raises(TimeoutError, match="the step's deadline passed while the call waited for this "
                                               "worker's stage"):
            await late
        # one at a time, the earliest deadline first and equal ones in arrival order, each given what is
        # left of its deadline; the late and the cancelled call never computed
        assert [name for name, _ in ran] == list("aubcdfe") and max(overlap) == 1
        assert all(0 < left <= 60 for _, left in ran)
    finally:
        queue.close()
    with pytest.raises(WorkerClosingError, match="the worker is shutting down"):
        await queue.call(compute, "closed", deadline=time.monotonic() + 60)


def calls_waiting_for_layers(queue: StageQueue, count: int, arrived: threading.Event,
                             deadline: float) -> list[asyncio.Task]:
    """``count`` calls of ``queue`` that wait for their layers until ``arrived``, then answer "done"."""
    return [asyncio.create_task(queue.call(lambda *, timeout: "done", deadline=deadline,
                                           wait=lambda timeout: arrived.wait(timeout))) for _ in range(count)]


async def test_calls_waiting_for_their_layers_leave_the_event_loops_own_threads_free():
    """Before, each wait held a thread of the loop's default pool (min(32, CPUs + 4)) until its deadline: a burst
    of them stalled tokenizing, the agent's status and every other to_thread of the worker."""
    queue = StageQueue()
    arrived = threading.Event()
    try:
        deadline = time.monotonic() + 60
        waiting = calls_waiting_for_layers(queue, 40, arrived, deadline)
        await asyncio.sleep(0.1)
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), 2) == "free"
        arrived.set()
        assert await asyncio.gather(*waiting) == ["done"] * 40
    finally:
        arrived.set()
        queue.close()


async def test_stage_calls_beyond_the_queues_bound_are_refused_at_once_and_the_bound_frees_as_calls_end():
    """Found in review: calls waiting for their layers queued without bound, each holding its hidden states (up to
    16 MiB and more) until its deadline."""
    queue = StageQueue(max_calls=3)
    arrived = threading.Event()
    try:
        deadline = time.monotonic() + 60
        waiting = calls_waiting_for_layers(queue, 3, arrived, deadline)
        await asyncio.sleep(0.05)
        with pytest.raises(StageQueueFullError, match="^this worker already holds 3 stage calls; retry elsewhere or "
                                                      "later$") as caught:
            await queue.call(lambda *, timeout: "refused", deadline=deadline)
        assert caught.value.status == 429  # load, not a failure
        arrived.set()
        assert await asyncio.gather(*waiting) == ["done"] * 3
        assert await queue.call(lambda *, timeout: "next", deadline=deadline) == "next"
    finally:
        arrived.set()
        queue.close()


async def test_a_stage_calls_own_error_reaches_its_caller_and_the_next_call_runs():
    queue = StageQueue()

    def fails(*, timeout):
        raise RuntimeError("shape mismatch")  # what torch raises: the call's fault, not a closing worker

    try:
        with pytest.raises(RuntimeError, match="^shape mismatch$"):
            await queue.call(fails, deadline=time.monotonic() + 60)
        assert await queue.call(lambda *, timeout: "next", deadline=time.monotonic() + 60) == "next"
    finally:
        queue.close()


async def test_a_call_waiting_for_its_turn_when_the_stage_queue_closes_is_dropped():
    queue = StageQueue()
    release = threading.Event()
    ran = []

    def compute(name, *, timeout, hold=None):
        if hold is not None:
            hold.wait(5)
        ran.append(name)
        return name

    running = asyncio.create_task(queue.call(compute, "a", hold=release, deadline=time.monotonic() + 60))
    await asyncio.sleep(0.05)
    waiting = asyncio.create_task(queue.call(compute, "b", deadline=time.monotonic() + 60))
    await asyncio.sleep(0.05)
    queue.close()
    release.set()
    assert await running == "a"  # the running one ends
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert ran == ["a"]


class HeadRunner:
    """The head's own layers: each step answers token 7 (with ``hidden``, those hidden states for the next stage);
    with ``decode_error``, a decode step (past the prompt) raises it. Records the sessions closed. Its model has 256
    tokens and no tied embeddings."""

    def __init__(self, decode_error: Exception | None = None, hidden: "torch.Tensor | None" = None):
        self.decode_error = decode_error
        self.hidden = hidden
        self.closed = []
        self.model = SimpleNamespace(vocab_size=256, skeleton=SimpleNamespace(tied_embeddings=False))

    def run(self, session, layers, position, *, tokens, params, timeout):
        if position and self.decode_error is not None:
            raise self.decode_error
        return StageOutput(token=None if self.hidden is not None else 7, hidden=self.hidden)

    def parts(self, layers):
        return []

    def waiter(self, parts):
        return None

    def close(self, session):
        self.closed.append(session)


async def test_a_pipelined_decode_failing_outside_the_engine_fails_the_stream_instead_of_leaving_it_open(caplog):
    # the prompt runs, the first decode step hits a torch error
    runner = HeadRunner(RuntimeError("CUDA error: an illegal memory access was encountered"))
    queue = StageQueue()
    head = PipelineHead(runner, None, queue)
    got = []
    try:
        stream = await head.start((Hop("http://head:1", range(0, 6)),), [1, 2, 3], SamplingParams(max_tokens=8))
        with pytest.raises(StageFailedError, match=r"^pipeline stage http://head:1 failed: the engine failed: CUDA "
                                                   r"error: an illegal memory access was encountered$"):
            async with asyncio.timeout(5):  # before, it stayed open and silent for good
                async for token in stream:
                    got.append(token)
    finally:
        queue.close()
    assert got == [7] and len(runner.closed) == 1
    [failure] = [r for r in caplog.records if r.getMessage() == "pipeline stage http://head:1 failed"]
    assert failure.exc_info[0] is RuntimeError  # logged with its traceback: not an error of the engine's own


async def test_a_request_cancelled_before_its_decode_starts_closes_its_sessions():
    """Found in review: cancelled in the loop turn its first token came (the token completed a stop string, the
    worker was released), the decode task never ran, nor its cleanup: the stages' sessions stayed open until they
    expired, and counted against the stages' bound."""
    runner, queue = HeadRunner(), StageQueue()
    head = PipelineHead(runner, None, queue)
    try:
        stream = await head.start((Hop("http://head:1", range(0, 6)),), [1, 2, 3], SamplingParams(max_tokens=8))
        stream.cancel()  # before the decode task's first step
        async with asyncio.timeout(5):
            while not runner.closed:
                await asyncio.sleep(0.01)
    finally:
        queue.close()
    assert len(runner.closed) == 1


# "auto": the tail's held call makes the route slow against the head's own estimate, so it moves
@pytest.mark.parametrize("mode", ["move", "finish", "auto"])
async def test_a_request_whose_pipeline_dissolves_moves_to_the_head_or_finishes_there_with_the_same_tokens(
        pkg, reference, mode):
    expected = reference(PROMPT, 24)
    with pipecast.load(pkg) as model:
        sampled = model.generate(PROMPT, max_new_tokens=24, temperature=0.9, seed=5, timeout=30)
    agent = GatedAgent(pkg)
    agent.release(0, 1)  # the head holds layers 0-1 when the request starts
    async with serving(WorkerConfig(str(pkg), agent=agent, pipeline_dissolve=mode)) as (a, head, _, http), \
            serving(WorkerConfig(str(pkg))) as (b, tail, _, _):
        await wait_health(http, a, lambda h: h["blocks_present"] == 2)
        # the tail runs the prefill and 3 decode steps, then holds the 5th call
        opened, calls = gate_after(await tail.wait_stage_runner(10), 4)
        relay, on_engine = head._head._relay, []

        async def counted(*args):  # found in review: a moved request counted neither in running nor in the queue
            on_engine.append((head.running, head._pipelined))
            await relay(*args)

        head._head._relay = counted
        header = {PIPELINE_HEADER: route([(a, 0, 2), (b, 2, 6)])}
        request = asyncio.create_task(post(http, a, completion(24), header))
        await eventually(lambda: len(calls) == 5, 30)
        agent.release()  # every block: the pipeline dissolves under the request
        state = await wait_health(http, a, lambda h: h["status"] == "ready")
        assert state["pipeline_sessions"] == 1
        opened.set()
        status, answer = await request
        assert status == 200 and answer["choices"][0]["token_ids"] == expected
        assert on_engine == ([] if mode == "finish" else [(1, 1)]) and head.running == 0
        moved = (await wait_health(http, a, lambda h: h["pipeline_sessions"] == 0))["pipeline_moved"]
        assert moved == (0 if mode == "finish" else 1)
        # moved after the 5th token (the call held when the head became whole), or every token there
        assert len(calls) == (24 if mode == "finish" else 5)
        assert tail.stage_runner().sessions == 0
    # A seeded sampled request finishes through its route (its generator lives in the sampling stage).
    agent = GatedAgent(pkg)
    agent.release(0, 1)
    async with serving(WorkerConfig(str(pkg), agent=agent)) as (a, head, _, http), \
            serving(WorkerConfig(str(pkg))) as (b, tail, _, _):
        await wait_health(http, a, lambda h: h["blocks_present"] == 2)
        opened, calls = gate_after(await tail.wait_stage_runner(10), 4)
        body = {**completion(24), "temperature": 0.9, "seed": 5}
        request = asyncio.create_task(post(http, a, body, {PIPELINE_HEADER: route([(a, 0, 2), (b, 2, 6)])}))
        await eventually(lambda: len(calls) == 5, 30)
        agent.release()
        await wait_health(http, a, lambda h: h["status"] == "ready")
        opened.set()
        status, answer = await request
        assert status == 200 and answer["choices"][0]["token_ids"] == sampled and len(calls) == 24
        assert (await wait_health(http, a, lambda h: h["pipeline_sessions"] == 0))["pipeline_moved"] == 0


async def test_a_stage_answer_arriving_in_pieces_is_read_whole():
    """A final norm's frame spans several TCP segments: one read took only what had arrived (4 KiB of bf16
    norm read as 1,394 bytes: a malformed answer, the request failed)."""
    norm = torch.randn(1, 1, 2048, dtype=torch.bfloat16)
    frame = encode_frame({}, norm)

    async def stage(request):
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await response.prepare(request)
        await response.write(frame[:1000])
        await asyncio.sleep(0.05)
        await response.write(frame[1000:])
        await response.write_eof()
        return response

    async with _stage_server(STAGE_PATH, stage) as (url, client):
        answer = await client.forward((Hop(url, range(3, 6)),), "s", 0, torch.zeros(1, 1, 2048),
                                      params=None, norm_only=True, deadline=time.monotonic() + 10)
        assert torch.equal(answer, norm)


@pytest.mark.parametrize("token", [-1, 2**70, 256])
async def test_a_token_outside_the_vocabulary_from_the_last_stage_is_its_malformed_answer(token):
    """Found in review: the head took any int: -1 or 2**70 failed the tokenizer's decode (a 500, a torn stream),
    and its session stayed open."""
    await _a_malformed_answer_fails_its_stage(HeadRunner(hidden=torch.zeros(1, 3, 16)), encode_frame({"token": token}),
                                              rf"token {token} outside the vocabulary \(0-255\)")


async def _a_malformed_answer_fails_its_stage(runner: "HeadRunner", answer: bytes, problem: str) -> None:
    """A two-stage request whose last stage answers ``answer`` fails naming that stage and ``problem`` (a regular
    expression), and the head's session is closed."""
    async def stage(request):
        await request.read()
        return web.Response(body=answer, content_type="application/octet-stream")

    queue = StageQueue()
    async with _stage_server(STAGE_PATH, stage) as (url, client):
        head = PipelineHead(runner, client, queue)
        with pytest.raises(StageFailedError, match=rf"^pipeline stage {url} failed: a malformed answer: {problem}$"):
            await head.start((Hop("http://head:1", range(0, 3)), Hop(url, range(3, 6))), [1, 2, 3],
                             SamplingParams(max_tokens=8))
    queue.close()
    assert len(runner.closed) == 1


@asynccontextmanager
async def _stage_server(path: str, handler):
    """A stand-in stage answering ``path`` with ``handler`` on loopback: its base URL and a :class:`StageClient`."""
    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    client = StageClient()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}", client
    finally:
        await client.aclose()
        await runner.cleanup()


async def test_closing_a_session_passes_over_a_dead_stage_to_the_stages_after_it():
    """Found in review: the close went along the route from stage to stage, so a dead middle stage left the stages
    after it holding the session's keys and values until they expired it as idle."""
    closes = []

    async def stage_close(request):
        closes.append(await request.json())
        return web.json_response({"closed": closes[-1]["session"]})

    async with _stage_server("/v1/stage/close", stage_close) as (url, client):
        dead, tail = Hop(f"http://127.0.0.1:{free_ports(1)[0]}", range(3, 6)), Hop(url, range(6, 9))
        await client.close_sessions((dead, tail), "s")
        assert closes == [{"session": "s", "next": []}]
        await client.close_sessions((tail, dead), "t")  # taken by the first: it passes the close on itself
        assert closes[1:] == [{"session": "t", "next": [dead.to_json()]}]



async def test_a_stage_asked_to_close_answers_before_the_stages_after_it_do(pkg, monkeypatch):
    """Found in review: a stage answered a close only once it had passed it on; its caller timed it out and asked the
    stages after it itself, so a close along hanging stages took minutes and thousands of calls."""
    from pipecast.serve import pipeline

    monkeypatch.setattr(pipeline, "CLOSE_TIMEOUT_S", 60.0)  # the next stage hangs for longer than this test runs
    entered, release = asyncio.Event(), asyncio.Event()

    async def hanging_close(request):
        entered.set()
        await release.wait()
        return web.json_response({"closed": "s"})

    async with _stage_server("/v1/stage/close", hanging_close) as (hanging, _), \
            serving(WorkerConfig(str(pkg))) as (a, _, _, http):
        body = {"session": "s", "next": [Hop(hanging, range(3, 6)).to_json()]}
        async with asyncio.timeout(10):  # the hanging stage has not answered: this one did
            async with http.post(f"{a}/v1/stage/close", json=body) as response:
                assert response.status == 200 and await response.json() == {"closed": "s"}
            await entered.wait()  # passed on all the same
        release.set()


async def test_closes_passed_on_at_once_are_bounded(monkeypatch):
    """Found in review of the close passed on in the background: every close asked for left a task behind, without
    bound (2,000 closes along 64 hanging hops: 2,000 tasks and their sockets)."""
    from pipecast.serve import pipeline

    started = asyncio.Event()

    async def hang(hops, session):
        started.set()
        await asyncio.Event().wait()

    client = StageClient()
    monkeypatch.setattr(client, "close_sessions", hang)
    for n in range(pipeline.MAX_CLOSES_PASSING + 10):
        client.pass_close_on((Hop("http://stage:1", range(3, 6)),), f"s{n}")
    await started.wait()
    assert len(client._passing) == pipeline.MAX_CLOSES_PASSING
    await client.aclose()  # cancels those still passing on
    assert not client._passing


@pytest.mark.parametrize("shape", [(1, 1, 7), (1, 2, 16)])
async def test_a_malformed_final_norm_from_the_last_stage_is_its_failure_not_the_heads(shape):
    """Found in review: with tied embeddings the head checked the last stage's final norm in its own sample step
    and named itself the failed stage."""
    runner = HeadRunner(hidden=torch.zeros(1, 3, 16))
    runner.model = SimpleNamespace(vocab_size=256, skeleton=SimpleNamespace(tied_embeddings=True),
                                   config=SimpleNamespace(hidden_size=16))
    got = ", ".join(map(str, shape))
    await _a_malformed_answer_fails_its_stage(runner, encode_frame({}, torch.zeros(*shape)),
                                              rf"the final norm must be \[1, 1, 16\], got \[{got}\]")

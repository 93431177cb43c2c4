"""The daemon's tick over real HTTP to a stub router's /stats, with a recording control-plane client (a fake:
this is the daemon's unit test; tests/integration/test_scaler.py runs it against the real services)."""

import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

import aiohttp
import pytest
from aiohttp import web

from control_plane.deployments import Deployment, ScaleEvent, ScalingPolicy
from control_plane.errors import (
    ChangeNotStored, ControlPlaneDeadlineExceeded, ControlPlaneError, ControlPlaneUnavailable, InsufficientWorkers,
    Unauthenticated, UnknownDeployment)
from control_plane.messages import PeerInfo
from control_plane.routes import CanaryGate, ModelRoute, RouteChange
from pipecast.core.credentials import SERVING_KEY_HEADER
from pipecast.core.httpserve import RUNNER_OPTIONS, listening
from pipecast.router.app import Router, RouterConfig, build_app
from pipecast.router.discovery import StaticDiscovery
from pipecast.scaler import daemon as daemon_module
from pipecast.scaler.daemon import REFUSED_RETRY_S, Scaler, ScalerConfig, resolve_addresses
from pipecast.scaler.policy import HISTORY_S
from pipecast.scaler.signals import add_up
from pipecast.v1 import control_pb2 as pb
from pipecast.v1.manifest_pb2 import Block, Manifest
from tests.core.test_httpserve import answer_in_pieces

pytestmark = pytest.mark.timeout(30)
PKG = "p" * 64
STORE = "w9"  # the package's store node
BLOCKS = 4
POLICY = ScalingPolicy(max_replicas=4, keep_alive_s=10.0, scale_down_cooldown_s=5.0, replica_concurrency=2)


def worker(node: str, held: int = 0) -> pb.WorkerState:
    spec = pb.WorkerSpec(peer=pb.Peer(node_id=node, address=f"10.0.0.{node[1:]}:7070"),
                         serve_url=f"http://10.0.0.{node[1:]}:8000")
    blocks = [pb.PackageBlocks(package_id=PKG, blocks=list(range(held)))] if held else []
    return pb.WorkerState(worker=spec, alive=True, held=blocks)


class RecordingClient:
    """The control plane's client as the daemon uses it, recording what it is asked."""

    def __init__(self, workers: list[pb.WorkerState], routers: tuple[str, ...], events: list[ScaleEvent] = ()):
        self.workers, self.events, self.calls = workers, list(events), []
        self.serving_key = b""
        self.deployment = Deployment(PKG, POLICY, routers)
        self.refuse: Exception | None = None  # scale-ups are refused
        self.refuse_release: Exception | None = None
        self.placeable: int | None = None  # scale-ups of more workers are refused (memory short)
        self.routes: list[ModelRoute] = []
        self.unchanged: list[str] = []  # workers a scale-up takes that hold the package already
        self.store = STORE  # the package's store node
        self.listed: list[int] = []  # the limit of each listing of the trail

    async def list_deployments(self):
        return [self.deployment]

    async def list_workers_keyed(self):
        return self.workers, self.serving_key

    async def list_plans(self, package_id: str = ""):
        return []

    async def get_package(self, package_id):
        blocks = [Block(index=i) for i in range(BLOCKS)]
        return Manifest(package_id=PKG, blocks=blocks), PeerInfo(self.store, "10.0.0.9:7070")

    async def list_packages(self):
        return [pb.PackageSummary(package_id=PKG, num_blocks=BLOCKS, store=pb.Peer(node_id=self.store))]

    async def list_scale_events(self, package_id="", *, after_seq=0, limit=0):
        self.listed.append(limit)
        return self.events[-(limit or 1000):]

    async def append_scale_event(self, event: ScaleEvent) -> int:
        self.events.append(event)
        self.calls.append(("event", event.action))
        return len(self.events)

    async def scale_up(self, package_id, *, count=0, strategy="", serving_only=False, **_):
        assert serving_only  # a replica must serve: an agent alone is never one
        self.calls.append(("scale_up", count, strategy))
        if self.refuse:
            raise self.refuse
        if self.placeable is not None and count > self.placeable:
            raise InsufficientWorkers(f"only {self.placeable} fit")
        return pb.ScaleUpResponse(plan_id="plan1", receivers=[f"w{i}" for i in range(count)],
                                  unchanged=self.unchanged)

    async def release(self, package_id, node_ids, *, keep_alive_s=0.0):
        self.calls.append(("release", tuple(node_ids), keep_alive_s))
        if self.refuse_release:
            raise self.refuse_release
        return 0.0

    async def list_routes(self):
        return self.routes

    async def change_route(self, change: RouteChange):
        self.calls.append(("change_route", change.name, change.action, change.package_id, change.reason))


def stats(queue: int = 0, idle: dict[str, float | None] | None = None, arrived: int = 0) -> dict:
    return {"format": 1, "now_unix": 0.0, "started_unix": 0.0, "queue_depth": queue, "in_flight": 0,
            "workers": [{"url": f"http://10.0.0.{n[1:]}:8000", "node_id": "", "status": "ready", "in_flight": 0,
                         "idle_s": s} for n, s in (idle or {}).items()],
            "counters": {"arrived": arrived, "prompt_tokens": 0, "answered": 0, "rejected": 0, "failed": 0},
            "ttft": {"window_s": 60.0, "count": 0, "p50": None, "p95": None, "p99": None}, "tenants": {}}


def clocks(now: list[float]) -> dict:
    """Both of the daemon's clocks at ``now[0]``: the wall clock of its audit trail and the monotonic one of its
    timing."""
    return {"clock": lambda: now[0], "monotonic": lambda: now[0]}


async def a_keep_alive_on(scaler: Scaler, now: list[float]) -> None:
    """A first tick, then the clock a keep-alive on: the policy releases nothing before its signals span one."""
    [(_, first)] = await scaler.tick()
    assert not first.release and "not releasing on 0 s of signals" in first.reason, first.reason
    now[0] += POLICY.keep_alive_s


@asynccontextmanager
async def stub_router(answer: dict, host: str = "127.0.0.1", port: int = 0, in_pieces: bool = False,
                      redirect: str = "", delay_s: float = 0.0) -> AsyncIterator[tuple[str, dict]]:
    """A router on ``host``:``port`` whose /stats answers ``state["answer"]`` (changeable while it runs; with
    ``in_pieces``, as a path between hosts delivers it; with ``redirect``, a 302 to that URL instead; after
    ``delay_s``); ``state["keys"]`` lists the serving key header of each request (None where absent),
    ``state["hosts"]`` its Host header."""
    state = {"answer": answer, "keys": [], "hosts": []}

    async def handler(request: web.Request) -> web.StreamResponse:
        state["keys"].append(request.headers.get(SERVING_KEY_HEADER))
        state["hosts"].append(request.host)
        await asyncio.sleep(delay_s)
        if redirect:
            raise web.HTTPFound(redirect)
        if in_pieces:
            return await answer_in_pieces(request, json.dumps(state["answer"]).encode())
        return web.json_response(state["answer"])

    app = web.Application()
    app.add_routes([web.get("/stats", handler)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}", state
    finally:
        await runner.cleanup()


async def test_a_queue_at_the_router_scales_up_once_recorded_before_acting():
    async with stub_router(stats(queue=5, arrived=5)) as (url, _):
        client = RecordingClient([worker("w1"), worker("w2"), worker("w3")], (url,))
        async with Scaler(client, ScalerConfig(plan_strategy="unicast")) as scaler:
            [(package, decision)] = await scaler.tick()
    assert package == PKG and decision.add == 3  # 5 queued at 2 each, capped at the 3 free workers
    assert client.calls == [("event", "scale_up"), ("scale_up", 3, "unicast")]
    event = client.events[0]
    assert (event.desired, event.actual) == (3, 0) and json.loads(event.inputs_json)["queue_depth"] == 5


async def test_the_routers_are_asked_with_the_serving_key_the_control_plane_lists_with_its_workers():
    async with stub_router(stats(queue=5, arrived=5)) as (url, state):
        client = RecordingClient([worker("w1")], (url,))
        async with Scaler(client) as scaler:
            await scaler.tick()  # auth off: no key, no header
            client.serving_key = bytes(range(32))
            await scaler.tick()
    assert state["keys"] == [None, bytes(range(32)).hex()]


async def test_a_silent_router_holds_the_pool_recording_the_hold_once():
    client = RecordingClient([worker("w1", held=BLOCKS)], ("http://127.0.0.1:9",))
    async with Scaler(client, ScalerConfig(router_timeout_s=0.5)) as scaler:
        for _ in range(3):
            [(_, decision)] = await scaler.tick()
            assert decision.kind == "no_signals"
    assert client.calls == [("event", "hold")]  # recorded when it began, never a release
    assert client.events[0].reason == "no signals from any router: holding 1 replicas"


async def test_a_router_redirecting_its_stats_is_silent_and_its_target_never_gets_the_serving_key(caplog):
    """Found in review: a /stats redirect was followed, the serving key's header with it, to wherever it led."""
    async with stub_router(stats(queue=5, arrived=5)) as (target, elsewhere):
        async with stub_router(stats(), redirect=f"{target}/stats") as (url, state):
            client = RecordingClient([worker("w1", held=BLOCKS)], (url,))
            client.serving_key = bytes(range(32))
            async with Scaler(client) as scaler:
                [(_, decision)] = await scaler.tick()
    assert decision.kind == "no_signals"  # its only router silent
    assert state["keys"] == [bytes(range(32)).hex()] and elsewhere["keys"] == []
    [warning] = [r.getMessage() for r in caplog.records if "gave no signals" in r.getMessage()]
    assert "HTTP 302, a redirect to" in warning and f"{target}/stats" in warning and "not followed" in warning


async def test_a_router_that_times_out_is_logged_with_a_reason(caplog):
    """Found in review: a timeout's message is empty, and the warning ended with "gave no signals: "."""
    async with stub_router(stats(), delay_s=1.0) as (url, _):
        client = RecordingClient([worker("w1", held=BLOCKS)], (url,))
        async with Scaler(client, ScalerConfig(router_timeout_s=0.1)) as scaler:
            [(_, decision)] = await scaler.tick()
    assert decision.kind == "no_signals"
    [warning] = [r.getMessage() for r in caplog.records if "gave no signals" in r.getMessage()]
    assert warning == f"router {url} gave no signals: TimeoutError"


async def test_idle_replicas_are_released_after_keep_alive_and_the_refusal_of_a_scale_up_is_recorded():
    idle, now = {"w1": 30.0, "w2": 3.0}, [1000.0]
    async with stub_router(stats(idle=idle)) as (url, state):
        client = RecordingClient([worker("w1", held=BLOCKS), worker("w2", held=BLOCKS), worker("w3")], (url,))
        async with Scaler(client, ScalerConfig(source_keep_s=7.0), **clocks(now)) as scaler:
            await a_keep_alive_on(scaler, now)
            [(_, decision)] = await scaler.tick()
            assert decision.release == ("w1",)
            assert client.calls[-1] == ("release", ("w1",), 7.0)
            # w1 is released: not a replica while its drop is reported, however the control plane lists it, but
            # free (a scale-up may take it back).
            state["answer"] = stats(queue=9, arrived=9)
            client.refuse = InsufficientWorkers("no memory")
            [(_, decision)] = await scaler.tick()
            # What was done: a refused hold, the scale-up of 2 it was decided as in the trail (w1 and w3 are free).
            assert (decision.action, decision.kind, decision.inputs["replicas"]) == ("hold", "refused", 1)
    assert (client.events[-2].action, client.events[-2].count) == ("scale_up", 2)
    assert client.calls[-2:] == [("scale_up", 1, ""), ("event", "hold")]
    assert client.events[-1].reason == "scale_up refused: no memory"


async def test_a_refused_scale_up_is_asked_again_only_after_a_while_so_the_trail_does_not_grow_each_tick():
    """Found in review: a scale-up placement kept refusing was asked again every tick, two rows in the audit trail
    each time (the decision and its refusal): 170,000 a day per deployment."""
    now = [1000.0]
    async with stub_router(stats(queue=5, arrived=5)) as (url, _):
        client = RecordingClient([worker("w1")], (url,))
        client.refuse = InsufficientWorkers("no memory")
        async with Scaler(client, **clocks(now)) as scaler:
            asked = []
            for _ in range(40):  # ticks of 1 s
                [(_, decision)] = await scaler.tick()
                asked.append(len([c for c in client.calls if c[0] == "scale_up"]))
                now[0] += 1.0
            assert (decision.action, decision.kind) == ("hold", "refused")  # asked or not, nothing was added
    # Asked at once, then 2, 4, 8 and 16 s after each refusal in a row.
    assert [i for i in range(1, 40) if asked[i] > asked[i - 1]] == [2, 6, 14, 30]
    assert len([e for e in client.events if "refused" in e.reason]) == asked[-1] == 5


async def test_a_scale_up_that_cannot_be_placed_asks_half_as_many_each_time_and_logs_once(caplog):
    """Review of the scaler (7), finding 3: each count placement refused was asked again for one fewer, down to 1:
    with 100 free workers short of memory, 100 ScaleUp calls an attempt (each within its deadline), a log line
    each."""
    now = [1000.0]
    async with stub_router(stats(queue=400, arrived=400)) as (url, _):
        client = RecordingClient([worker(f"w{i}") for i in range(1, 101)], (url,))
        client.deployment = Deployment(PKG, replace(POLICY, max_replicas=100), (url,))
        client.refuse = InsufficientWorkers("no worker has the memory")
        caplog.set_level(logging.INFO, logger=daemon_module.__name__)
        async with Scaler(client, **clocks(now)) as scaler:
            [(_, decision)] = await scaler.tick()
            assert decision.kind == "refused"
            assert [c[1] for c in client.calls if c[0] == "scale_up"] == [100, 50, 25, 12, 6, 3, 1]
            logged = [r.getMessage() for r in caplog.records if r.name == daemon_module.__name__]
            assert len(logged) == 2 and logged[1].endswith("scale_up refused: no worker has the memory"), logged
            client.refuse, client.placeable = None, 30
            client.calls.clear()
            caplog.clear()
            now[0] += 2.0  # the refusal's wait
            [(_, decision)] = await scaler.tick()
    assert decision.add == 25 and [c[1] for c in client.calls if c[0] == "scale_up"] == [100, 50, 25]
    [placed] = [r.getMessage() for r in caplog.records if "placed" in r.getMessage()]
    assert placed == "scaler pppppppppppp: placed 25 of the 100 workers asked: only 30 fit"


async def test_a_refused_scale_up_counts_as_a_refused_hold_in_the_metrics_not_as_a_scale_up():
    """Found in review: the decision was counted before it was made, so a refused scale-up read as one."""
    async with stub_router(stats(queue=5, arrived=5)) as (url, _):
        client = RecordingClient([worker("w1")], (url,))
        client.refuse = InsufficientWorkers("no memory")
        async with Scaler(client) as scaler:
            [(_, decision)] = await scaler.tick()
            decisions = scaler.metrics.registry.get_sample_value
    assert (decision.action, decision.kind) == ("hold", "refused") and client.events[0].action == "scale_up"
    assert decisions("pipecast_scaler_decisions_total", {"package": PKG, "action": "hold", "kind": "refused"}) == 1
    assert decisions("pipecast_scaler_decisions_total",
                     {"package": PKG, "action": "scale_up", "kind": "demand"}) is None
    assert decisions("pipecast_scaler_replicas_changed_total", {"package": PKG, "action": "scale_up"}) is None


async def test_a_release_the_control_plane_refused_is_no_release_to_a_restarted_daemon():
    """Found in review: a restarted daemon read the release in the trail as made, not the refusal recorded after
    it, and counted the serving replica as released (free, not a replica) for the keep-alive and grace."""
    now = [1000.0]
    async with stub_router(stats(idle={"w1": 30.0, "w2": 3.0})) as (url, _):
        client = RecordingClient([worker("w1", held=BLOCKS), worker("w2", held=BLOCKS)], (url,))
        config = ScalerConfig(source_keep_s=120.0)
        async with Scaler(client, config, **clocks(now)) as scaler:
            await a_keep_alive_on(scaler, now)
            client.refuse_release = ControlPlaneError("w1 is a source of a plan")
            await scaler.tick()
            assert client.calls[-3:-1] == [("event", "release"), ("release", ("w1",), 120.0)]
            assert not scaler.tracked[PKG].released
        assert [(e.action, e.node_ids, e.reason) for e in client.events[-2:]] == [
            ("release", ("w1",), client.events[-2].reason), ("hold", (), "release refused: w1 is a source of a plan")]
        now[0] += 1.0
        async with Scaler(client, config, **clocks(now)) as restarted:
            [(_, decision)] = await restarted.tick()
            assert "w1" not in restarted.tracked[PKG].released and decision.inputs["replicas"] == 2
        refusal = client.events.pop()  # without it, the release was made: w1 is held back as released
        async with Scaler(client, config, **clocks(now)) as restarted:
            [(_, decision)] = await restarted.tick()
            assert "w1" in restarted.tracked[PKG].released and decision.inputs["replicas"] == 1
    assert refusal.action == "hold"


@pytest.mark.parametrize("error", [
    ChangeNotStored("the change was made but not stored yet (disk I/O error)"),
    ControlPlaneDeadlineExceeded("control plane at cp:7000 did not answer ScaleUp: DEADLINE_EXCEEDED: Deadline "
                                 "Exceeded")])
async def test_a_scale_up_made_but_not_stored_or_unanswered_is_no_refusal_and_starts_the_cooldown(error):
    """The database refused to store it, the control plane made it all the same (agents told): recorded as
    refused, it was asked again the next tick. Found in review: one unanswered within its deadline (made, its
    handler running on after the caller's deadline) was recorded as refused too: the released workers it took back
    counted as free and the next tick added as many again (4 replicas for a demand of 2)."""
    async with stub_router(stats(queue=9, arrived=9)) as (url, _):
        released = ScaleEvent(at=time.time() - 1.0, package_id=PKG, action="release", count=1, node_ids=("w3",),
                              seq=1)
        client = RecordingClient([worker("w1"), worker("w2"), worker("w3", held=BLOCKS)], (url,), [released])
        client.refuse = error
        async with Scaler(client, ScalerConfig(source_keep_s=300.0)) as scaler:
            [(_, decision)] = await scaler.tick()
            assert decision.add >= 1
            # Its reply lost, the released w3 it took back first counts as a replica, not as free.
            assert scaler.tracked[PKG].released == {}
            client.refuse = None
            await scaler.tick()
    assert [c for c in client.calls if c[0] == "scale_up"] == [("scale_up", decision.add, "")]  # once, in cooldown
    assert all(e.action != "hold" or "refused" not in e.reason for e in client.events)


async def test_a_scale_up_the_control_plane_was_unavailable_for_is_a_refusal_not_taken_as_made():
    """Found in review of the fix above: UNAVAILABLE (a refused connection, every replica a standby, a deposed leader)
    was taken as made with DEADLINE_EXCEEDED: a scale-up never made started the cooldown and went in the trail."""
    async with stub_router(stats(queue=9, arrived=9)) as (url, _):
        client = RecordingClient([worker("w1"), worker("w2"), worker("w3")], (url,))
        client.refuse = ControlPlaneUnavailable("control plane at cp:7000 did not answer ScaleUp: UNAVAILABLE: "
                                                "control plane me was deposed")
        async with Scaler(client) as scaler:
            [(_, decision)] = await scaler.tick()
            assert decision.kind == "refused" and scaler.tracked[PKG].last_scale_up is None
    assert client.events[-1].action == "hold" and client.events[-1].reason.startswith("scale_up refused: ")


async def test_a_scale_up_that_cannot_be_placed_whole_asks_for_fewer_and_records_the_count_placed():
    # Found in review: the pool counts every worker not serving the package as free, placement also needs its
    # memory budget; a scale-up refused whole was asked again at the same count each tick, adding none. Then:
    # the trail, the metrics and the decision returned said the 3 decided where 1 was placed.
    async with stub_router(stats(queue=9, arrived=9)) as (url, _):
        client = RecordingClient([worker("w1"), worker("w2"), worker("w3")], (url,))
        client.placeable = 1
        async with Scaler(client) as scaler:
            [(_, decision)] = await scaler.tick()
            changed = scaler.metrics.registry.get_sample_value(
                "pipecast_scaler_replicas_changed_total", {"package": PKG, "action": "scale_up"})
    assert (decision.action, decision.add, changed) == ("scale_up", 1, 1)
    assert [c for c in client.calls if c[0] == "scale_up"] == [("scale_up", 3, ""), ("scale_up", 1, "")]  # halved
    decided, placed = client.events[-2:]
    assert (decided.action, decided.count) == ("scale_up", 3)
    assert (placed.action, placed.count, placed.reason) == ("hold", 1, "scale_up placed 1 of 3: only 1 fit")


async def test_a_replica_released_with_a_keep_alive_is_not_counted_until_it_ends_nor_released_again():
    now = [1000.0]
    idle = {"w1": 30.0, "w2": 3.0}
    async with stub_router(stats(idle=idle)) as (url, _):
        client = RecordingClient([worker("w1", held=BLOCKS), worker("w2", held=BLOCKS)], (url,))
        async with Scaler(client, ScalerConfig(source_keep_s=120.0), **clocks(now)) as scaler:
            await a_keep_alive_on(scaler, now)
            [(_, decision)] = await scaler.tick()
            assert decision.release == ("w1",)
            for later in (41.0, 110.0, 159.0):  # the control plane lists w1's blocks all along its keep-alive
                now[0] = 1000.0 + later
                [(_, decision)] = await scaler.tick()
                assert decision.release == () and decision.inputs["replicas"] == 1, later
    assert [c for c in client.calls if c[0] == "release"] == [("release", ("w1",), 120.0)]


async def test_copies_on_workers_serving_another_package_are_released_once_recorded_and_a_restart_knows_it():
    """Found in review: a copy on a worker bound to another package (placed before its agent said what it serves)
    was in no pool: never released, its memory kept the worker's own package off it. The daemon releases such
    strays (with a source's keep-alive), recorded in the trail first, and not again while their drop is due."""
    now = [1000.0]
    stray = worker("w1", held=BLOCKS)
    stray.worker.serve_package = "s" * 64
    async with stub_router(stats(idle={"w2": 0.0})) as (url, _):
        client = RecordingClient([stray, worker("w2", held=BLOCKS)], (url,))
        async with Scaler(client, ScalerConfig(source_keep_s=120.0), **clocks(now)) as scaler:
            [(_, decision)] = await scaler.tick()
            assert decision.inputs["replicas"] == 1 and decision.action == "hold"
            now[0] += 60.0
            await scaler.tick()
        assert [c for c in client.calls if c[0] == "release"] == [("release", ("w1",), 120.0)]
        [event] = [e for e in client.events if e.action == "release"]
        assert (event.count, event.node_ids, event.reason, event.actual) == (
            1, ("w1",), "released 1 copies on workers serving another package", 1)
        async with Scaler(client, ScalerConfig(source_keep_s=120.0), **clocks(now)) as restarted:
            await restarted.tick()
        assert len([c for c in client.calls if c[0] == "release"]) == 1
        client.refuse_release = ControlPlaneUnavailable("down")
        now[0] += 1000.0  # its drop was due long ago, yet it is listed: released again, refused, asked again later
        async with Scaler(client, ScalerConfig(source_keep_s=120.0), **clocks(now)) as scaler:
            await scaler.tick()
            await scaler.tick()  # refused a moment ago: not asked again yet (found in review: asked every tick,
            assert len([c for c in client.calls if c[0] == "release"]) == 2  # a refusal unrecorded each time)
            assert (client.events[-1].action, client.events[-1].reason) == ("hold", "release refused: down")
            assert "w1" not in scaler.tracked[PKG].released
            now[0] += REFUSED_RETRY_S
            await scaler.tick()
        assert len([c for c in client.calls if c[0] == "release"]) == 3
        client.refuse_release = ChangeNotStored("the change was made but not stored yet (disk I/O error)")
        now[0] += 1000.0  # made all the same (found in review: recorded as refused, as _act never takes it)
        async with Scaler(client, ScalerConfig(source_keep_s=120.0), **clocks(now)) as scaler:
            await scaler.tick()
            assert "w1" in scaler.tracked[PKG].released and client.events[-1].action == "release"


async def test_a_released_worker_a_scale_up_takes_back_is_in_the_trail_and_a_restart_counts_it_as_a_replica():
    # Found in review: the trail had the release but not the taking back (the scale-up's event is written before
    # the control plane places it), so a daemon restarted within the keep-alive held a serving replica back.
    now = [1000.0]
    async with stub_router(stats(idle={"w1": 30.0, "w2": 3.0})) as (url, state):
        client = RecordingClient([worker("w1", held=BLOCKS), worker("w2", held=BLOCKS), worker("w3")], (url,))
        config = ScalerConfig(source_keep_s=120.0)
        async with Scaler(client, config, **clocks(now)) as scaler:
            await a_keep_alive_on(scaler, now)
            [(_, decision)] = await scaler.tick()
            assert decision.release == ("w1",)
            now[0] += 40.0
            state["answer"] = stats(queue=9, arrived=9)
            client.unchanged = ["w1"]  # placement takes the released holder first
            [(_, decision)] = await scaler.tick()
            assert decision.add and "w1" not in scaler.tracked[PKG].released
        [taken] = [e for e in client.events if e.action == "take_back"]
        assert (taken.node_ids, taken.count, taken.at) == (("w1",), 1, now[0])
        async with Scaler(client, config, **clocks(now)) as restarted:
            await restarted.tick()
            assert "w1" not in restarted.tracked[PKG].released
        client.events.remove(taken)  # as the trail was: the restarted daemon held w1 back as released
        async with Scaler(client, config, **clocks(now)) as restarted:
            await restarted.tick()
            assert "w1" in restarted.tracked[PKG].released


async def test_a_restarted_daemon_reads_the_trail_back_past_the_holds_to_its_last_scale_up_and_release():
    """Found in review: a restart read the latest 200 events, and holds (a router silent every other poll writes two
    a tick) pushed the last scale-up and release out of them: their cooldown and the released worker were lost."""
    now = [100_000.0]
    events = [ScaleEvent(at=now[0] - 120.0, package_id=PKG, action="scale_up", count=1, seq=1),
              ScaleEvent(at=now[0] - 100.0, package_id=PKG, action="release", count=1, node_ids=("w1",), seq=2)]
    events += [ScaleEvent(at=now[0] - 99.0 + i * 0.01, package_id=PKG, action="hold", reason="no signals", seq=3 + i)
               for i in range(3000)]
    async with stub_router(stats(idle={"w1": 60.0, "w2": 60.0})) as (url, _):
        client = RecordingClient([worker("w1", held=BLOCKS), worker("w2", held=BLOCKS)], (url,), events)
        client.deployment = replace(client.deployment, policy=replace(POLICY, scale_down_cooldown_s=300.0))
        async with Scaler(client, ScalerConfig(source_keep_s=300.0), **clocks(now)) as scaler:
            await scaler.tick()
            tracked = scaler.tracked[PKG]
            assert (tracked.last_scale_up, set(tracked.released)) == (now[0] - 120.0, {"w1"})
    assert client.listed == [1000, 4000]


async def test_every_deployments_routers_are_polled_at_once():
    """Found in review: one deployment after another, a tick took a router timeout per deployment behind slow
    routers, every other deployment's scaling waiting meanwhile."""
    async with stub_router(stats(), delay_s=0.5) as (a, first), stub_router(stats(), delay_s=0.5) as (b, second):
        class Two(RecordingClient):
            async def list_deployments(self):
                return [Deployment(PKG, POLICY, (a,)), Deployment("q" * 64, POLICY, (b,))]

            async def list_packages(self):
                return [*await super().list_packages(),
                        pb.PackageSummary(package_id="q" * 64, num_blocks=BLOCKS, store=pb.Peer(node_id=STORE))]

        client = Two([worker("w1")], (a,))
        async with Scaler(client) as scaler:
            started = asyncio.get_running_loop().time()
            ticking = asyncio.create_task(scaler.tick())
            await asyncio.sleep(0.25)  # both polls are under way at once, the first one unanswered yet
            assert (len(first["hosts"]), len(second["hosts"])) == (1, 1)
            assert len(await ticking) == 2 and asyncio.get_running_loop().time() - started >= 0.5


async def test_a_restarted_daemon_recovers_its_cooldowns_from_the_audit_trail():
    now = [1000.0]
    recent = ScaleEvent(at=now[0] - 1.0, package_id=PKG, action="scale_up", count=1, seq=1)
    async with stub_router(stats(idle={"w1": 60.0, "w2": 60.0})) as (url, _):
        client = RecordingClient([worker("w1", held=BLOCKS), worker("w2", held=BLOCKS)], (url,), [recent])
        async with Scaler(client, **clocks(now)) as scaler:
            [(_, decision)] = await scaler.tick()
        assert decision.kind == "cooldown" and not decision.release  # 1 s after a scale event: no release
        assert scaler.tracked[PKG].last_scale_up == recent.at
        # The trail's times are the wall clock's, the daemon's cooldowns the monotonic clock's: a row is as old
        # on the one as on the other; one from the wall clock's future (stepped back since) is as old as none.
        for at, recovered in ((recent.at, 49.0), (now[0] + 3600.0, 50.0)):
            client.events = [replace(recent, at=at)]
            async with Scaler(client, clock=lambda: now[0], monotonic=lambda: 50.0) as restarted:
                await restarted.tick()
            assert restarted.tracked[PKG].last_scale_up == recovered


async def test_a_scale_up_the_control_plane_refused_starts_no_cooldown_for_a_restarted_daemon():
    """Review of the scaler (7), finding 4: a restarted daemon read every scale_up row of the trail as a scale-up
    made, not the refusal recorded right after it (as it did for a release), and held its releases for the
    scale-down cooldown."""
    now = [1000.0]
    events = [ScaleEvent(at=900.0, package_id=PKG, action="scale_up", count=1, reason="queue", seq=1),
              ScaleEvent(at=999.0, package_id=PKG, action="scale_up", count=1, reason="queue", seq=2),
              ScaleEvent(at=999.0, package_id=PKG, action="hold", reason="scale_up refused: no memory", seq=3)]
    async with stub_router(stats(idle={"w1": None, "w2": 300.0})) as (url, _):
        client = RecordingClient([worker("w1", held=BLOCKS), worker("w2", held=BLOCKS)], (url,), events)
        client.deployment = replace(client.deployment, policy=replace(POLICY, scale_down_cooldown_s=60.0))
        async with Scaler(client, **clocks(now)) as scaler:
            await a_keep_alive_on(scaler, now)
            assert scaler.tracked[PKG].last_scale_up == 900.0  # the scale-up made before it
            [(_, decision)] = await scaler.tick()
    assert decision.release == ("w2",)


async def test_a_wall_clock_stepped_back_holds_no_release_nor_retry():
    """Review of the scaler (7), finding 2: the history, the cooldowns and the waits after a refusal were timed
    by the wall clock, so NTP stepping it back an hour froze releases (the polls from its future filled every
    window), queue-driven scale-ups and the retries of a refused action for that hour."""
    wall, watch = [100_000.0], [50.0]

    def later(seconds: float) -> None:
        wall[0] += seconds
        watch[0] += seconds

    async with stub_router(stats(idle={"w1": 300.0, "w2": 300.0})) as (url, _):
        client = RecordingClient([worker("w1", held=BLOCKS), worker("w2", held=BLOCKS)], (url,))
        async with Scaler(client, clock=lambda: wall[0], monotonic=lambda: watch[0]) as scaler:
            await scaler.tick()
            wall[0] -= 3600.0
            later(POLICY.keep_alive_s)
            client.refuse_release = ControlPlaneError("w1 is a source of a plan")
            [(_, decision)] = await scaler.tick()  # a keep-alive of signals since the first tick: released
            assert decision.kind == "refused"
            assert client.calls[-2:] == [("release", ("w1", "w2"), 0.0), ("event", "hold")]
            client.refuse_release = None
            later(1.0)
            [(_, decision)] = await scaler.tick()
            assert decision.kind == "refused" and client.calls[-1] == ("event", "hold")  # not asked again yet
            later(1.0)
            [(_, decision)] = await scaler.tick()
            assert decision.release == ("w1", "w2") and client.calls[-1] == ("release", ("w1", "w2"), 0.0)
    # The audit trail has the wall clock's times, stepped back.
    assert [e.at for e in client.events] == [wall[0] - 2.0, wall[0] - 2.0, wall[0]]


def version(answered: int, failed: int, p95: float | None, queue: int = 0) -> dict:
    return {"queue_depth": queue, "in_flight": 0,
            "counters": {"arrived": answered + failed, "answered": answered, "failed": failed,
                         "completion_tokens": 0},
            "ttft": {"window_s": 60.0, "count": answered, "p50": p95, "p95": p95, "p99": p95}}


async def test_the_gate_rolls_back_a_failing_canary_once_with_its_figures_and_leaves_an_ungated_one():
    canary = "c" * 64
    answer = {**stats(), "versions": {PKG: version(0, 0, 0.5), canary: version(0, 0, 0.5)}}
    async with stub_router(answer) as (url, state):
        client = RecordingClient([worker("w1", held=BLOCKS)], (url,))
        gated = ModelRoute("chat", PKG, ((PKG, 90), (canary, 10)), CanaryGate(min_requests=10))
        client.routes = [gated, ModelRoute("plain", PKG, ((PKG, 90), (canary, 10)))]
        async with Scaler(client) as scaler:
            await scaler.tick()  # the counts it is judged from
            state["answer"] = {**stats(), "versions": {PKG: version(90, 0, 0.5), canary: version(6, 4, 0.5)}}
            await scaler.tick()
            rollbacks = [c for c in client.calls if c[0] == "change_route"]
            assert rollbacks == [("change_route", "chat", "rollback", canary,
                                  "gate: canary error rate 40.0% > stable's 0.0% + 5.0% (canary: 10 requests, 4 "
                                  "failed, p95 TTFT 0.500 s; stable: 90 requests, 0 failed, p95 TTFT 0.500 s)")]
            # Slow but not failing, and fewer requests than the gate's minimum: no verdict yet.
            state["answer"] = {**stats(), "versions": {PKG: version(90, 0, 0.5), canary: version(5, 0, 2.0)}}
            client.calls.clear()
            await scaler.tick()
            assert not [c for c in client.calls if c[0] == "change_route"]
            state["answer"] = {**stats(), "versions": {PKG: version(90, 0, 0.5), canary: version(10, 0, 0.8)}}
            await scaler.tick()
            [(_, _, _, _, reason)] = [c for c in client.calls if c[0] == "change_route"]
            assert reason.startswith("gate: canary p95 TTFT 0.800 s > stable's 0.500 s x 1.5")


async def test_a_version_of_a_routed_name_is_scaled_for_its_own_queue_not_the_routers():
    canary = "c" * 64
    answer = {**stats(queue=9, arrived=9), "versions": {PKG: version(0, 0, None, queue=1),
                                                         canary: version(0, 0, None, queue=8)}}
    async with stub_router(answer) as (url, _):
        client = RecordingClient([worker("w1"), worker("w2"), worker("w3")], (url,))
        async with Scaler(client) as scaler:
            [(_, decision)] = await scaler.tick()
    assert decision.add == 1  # its own queue of 1 at 2 a replica, not the router's 9


async def test_requests_waiting_for_no_version_count_for_every_version_so_a_pool_at_zero_grows_again():
    # Requests for a model that no worker of the router names, nor did since it started (a new model's first
    # requests; routers before they remembered a model's package: every surge after a scale to zero) wait
    # there for no version, while the version the router saw before reports an empty queue of its own.
    answer = {**stats(queue=6, arrived=6), "versions": {PKG: version(95, 0, None, queue=0)}}
    async with stub_router(answer) as (url, _):
        client = RecordingClient([worker("w1"), worker("w2"), worker("w3"), worker("w4")], (url,))
        async with Scaler(client) as scaler:
            [(_, decision)] = await scaler.tick()
    assert decision.add == 3  # 6 waiting at 2 a replica


async def test_a_deployment_beside_a_busy_one_at_its_router_is_released_not_sized_to_the_others_load():
    # Found in review: no entry of its own in the router's versions read as the router's whole queue: an idle
    # deployment was scaled up for its neighbour's backlog every tick and re-acquired after each release.
    answer = {**stats(queue=8, idle={"w1": 30.0}, arrived=8), "versions": {"b" * 64: version(0, 0, None, queue=8)}}
    now = [1000.0]
    async with stub_router(answer) as (url, _):
        client = RecordingClient([worker("w1", held=BLOCKS), worker("w2"), worker("w3")], (url,))
        async with Scaler(client, **clocks(now)) as scaler:
            await a_keep_alive_on(scaler, now)
            [(_, decision)] = await scaler.tick()
    assert (decision.add, decision.release) == (0, ("w1",))


async def test_the_daemon_measures_how_long_its_scale_ups_take_and_sizes_for_it_where_asked():
    clock = [100.0]
    async with stub_router(stats(queue=1, arrived=1)) as (url, state):
        client = RecordingClient([worker("w1"), worker("w2")], (url,))
        client.deployment = Deployment(PKG, ScalingPolicy(**{**POLICY.__dict__, "cold_start_measured": True}), (url,))
        async with Scaler(client, **clocks(clock)) as scaler:
            [(_, first)] = await scaler.tick()  # t = 100: one queued, nothing measured yet
            assert first.add == 1 and first.inputs["cold_start_from"] == "policy"
            client.workers = [worker("w1", held=1), worker("w2")]  # the new replica loads
            clock[0] = 101.0
            await scaler.tick()
            client.workers = [worker("w1", held=BLOCKS), worker("w2")]
            clock[0] = 106.0
            [(_, whole)] = await scaler.tick()
            assert (whole.inputs["cold_start_s"], whole.inputs["cold_start_from"]) == (6.0, "measured")
            assert b'pipecast_scaler_cold_start_seconds{package="' + PKG.encode() + b'"} 6.0' in \
                scaler.metrics.render()[0]


async def test_a_deployment_idle_at_zero_scales_up_when_a_request_waits_not_at_the_next_tick():
    """With a tick of an hour the first tick sees nothing and the next is far off; the watch between ticks
    notices the first waiting request and ticks at once (one early tick: then the demand is seen)."""
    async with stub_router(stats()) as (url, state):
        client = RecordingClient([worker("w1"), worker("w2")], (url,))
        async with Scaler(client, ScalerConfig(tick_s=3600.0, watch_s=0.05)) as scaler:
            stop = asyncio.Event()
            task = asyncio.create_task(scaler.run(stop))
            while not scaler.tracked.get(PKG) or not scaler.tracked[PKG].history:
                await asyncio.sleep(0.01)
            assert client.calls == [] and scaler.tracked[PKG].idle_at_zero
            await asyncio.sleep(0.2)  # several watches: nothing waits, no tick
            assert len(scaler.tracked[PKG].history) == 1
            state["answer"] = stats(queue=1, arrived=1)
            async with asyncio.timeout(10):  # only the watch can tick before the hour is up
                while not any(call[0] == "scale_up" for call in client.calls):
                    await asyncio.sleep(0.01)
            assert [call[0] for call in client.calls] == ["event", "scale_up"]
            assert len(scaler.tracked[PKG].history) == 2
            assert not scaler.tracked[PKG].idle_at_zero  # the demand is seen: no more early ticks
            stop.set()
            await task


async def test_a_daemon_without_the_watch_waits_for_its_tick():
    async with stub_router(stats()) as (url, state):
        client = RecordingClient([worker("w1")], (url,))
        async with Scaler(client, ScalerConfig(tick_s=30.0, watch_s=0.0)) as scaler:
            stop = asyncio.Event()
            task = asyncio.create_task(scaler.run(stop))
            while not scaler.tracked.get(PKG) or not scaler.tracked[PKG].history:
                await asyncio.sleep(0.01)
            state["answer"] = stats(queue=1, arrived=1)
            await asyncio.sleep(0.5)
            assert client.calls == [] and len(scaler.tracked[PKG].history) == 1
            stop.set()
            await task


async def test_a_surge_right_after_a_release_takes_the_released_workers_back():
    """Found in review: a released worker counted as neither replica nor free for its keep-alive and grace, so a
    surge whose only spare workers were those just released held at no_free_workers though they held every block."""
    now = [10_000.0]
    async with stub_router(stats(idle={"w1": 100.0, "w2": 100.0})) as (url, state):
        client = RecordingClient([worker("w1", held=BLOCKS), worker("w2", held=BLOCKS)], (url,))
        async with Scaler(client, ScalerConfig(source_keep_s=300.0), **clocks(now)) as scaler:
            await a_keep_alive_on(scaler, now)
            [(_, released)] = await scaler.tick()
            assert released.release == ("w1", "w2")
            now[0] += 10.0
            state["answer"] = stats(queue=20, arrived=20)
            client.unchanged = ["w1", "w2"]  # placement takes the released holders first
            [(_, decision)] = await scaler.tick()
            assert (decision.add, decision.kind) == (2, "demand") and not scaler.tracked[PKG].released
    assert [e.action for e in client.events] == ["release", "scale_up", "take_back"]


async def test_an_undeployed_package_leaves_no_series_in_the_metrics():
    """Found in review: its gauges kept their last desired and actual replicas (and cold start) for good."""
    async with stub_router(stats(queue=1, arrived=1)) as (url, _):
        client = RecordingClient([worker("w1")], (url,))
        async with Scaler(client) as scaler:
            await scaler.tick()
            scaler.metrics.cold_start.labels(PKG).set(6.0)
            assert scaler.metrics.render()[0].count(PKG.encode()) >= 4
            client.list_deployments = lambda: asyncio.sleep(0, [])  # `pipecast cp undeploy`
            await scaler.tick()
            assert PKG.encode() not in scaler.metrics.render()[0]


async def test_a_deployment_removed_during_its_step_is_no_failed_tick():
    """Found in review: an undeploy landing between ListDeployments and the step's audit event failed the whole
    tick, as a control-plane outage would: the later deployments were skipped and /health said degraded."""
    async with stub_router(stats(queue=1, arrived=1)) as (url, _):
        client = RecordingClient([worker("w1")], (url,))

        async def undeployed(event):
            raise UnknownDeployment(f"package {PKG!r} has no deployment")

        client.append_scale_event = undeployed
        async with Scaler(client, ScalerConfig(watch_s=0.0)) as scaler:
            await one_tick(scaler, client, client.list_deployments)
            assert scaler.failed_ticks == 0 and PKG not in scaler.tracked
            assert scaler.metrics.registry.get_sample_value("pipecast_scaler_tick_failures_total") == 0


async def test_a_replica_no_router_lists_is_warned_of_once(caplog):
    """Found in review: a replica its routers list under another host name than it registered had no idle time,
    and was never released, without a word."""
    now = [1000.0]
    async with stub_router(stats(idle={"w1": 100.0})) as (url, _):
        client = RecordingClient([worker("w1", held=BLOCKS), worker("w2", held=BLOCKS)], (url,))
        async with Scaler(client, **clocks(now)) as scaler:
            for _ in range(3):
                await scaler.tick()
                now[0] += daemon_module.UNLISTED_WARN_S / 2
    warned = [r.getMessage() for r in caplog.records if "none of the deployment's routers has listed" in r.getMessage()]
    assert len(warned) == 1 and "replica w2 holds the whole package" in warned[0]


async def test_a_deployment_without_routers_is_still_raised_to_its_minimum():
    """Found in review: without signals the pool was held as it was, so --min 2 without routers (or with all of
    them down) stayed at 0 replicas for good, desired 0."""
    client = RecordingClient([worker("w1"), worker("w2"), worker("w3")], ())
    client.deployment = Deployment(PKG, ScalingPolicy(min_replicas=2, max_replicas=4), ())
    async with Scaler(client) as scaler:
        [(_, decision)] = await scaler.tick()
    assert (decision.add, decision.kind, decision.desired) == (2, "min_replicas", 2)
    assert client.calls == [("event", "scale_up"), ("scale_up", 2, "")]


async def test_a_step_that_fails_holds_its_deployment_for_the_tick_and_the_others_go_on(monkeypatch, caplog):
    """Found in review: an error that is not the control plane's (here the policy's, as a router's figure of 400
    digits overflowed its float math) ended ``tick``, and with it ``run``: no pool was scaled again."""
    broken = Deployment("b" * 64, replace(POLICY, max_replicas=3), ())
    decide = daemon_module.decide

    def failing(history, pool, policy):
        if policy is broken.policy:
            raise OverflowError("int too large to convert to float")
        return decide(history, pool, policy)

    monkeypatch.setattr(daemon_module, "decide", failing)
    now = [1000.0]
    async with stub_router(stats(queue=5, arrived=5)) as (url, _):
        client = RecordingClient([worker("w1"), worker("w2"), worker("w3")], (url,))
        broken = replace(broken, routers=(url,))
        client.list_deployments = lambda: asyncio.sleep(0, [broken, client.deployment])
        async with Scaler(client, **clocks(now)) as scaler:
            [(package, decision)] = await scaler.tick()
            gap = scaler.tracked[broken.package_id].history[-1]
    assert (package, decision.action, decision.add) == (PKG, "scale_up", 3)
    assert client.calls == [("event", "scale_up"), ("scale_up", 3, "")]
    assert (gap.at, gap.routers_total, gap.routers_answered) == (now[0], 1, 0)
    [failed] = [r for r in caplog.records if "its step failed" in r.getMessage()]
    assert failed.levelname == "ERROR" and failed.exc_info[0] is OverflowError
    assert failed.getMessage().startswith("scaler bbbbbbbbbbbb:")


async def test_a_failed_tick_is_a_gap_in_the_signals_and_nothing_is_released_for_a_keep_alive_after():
    now = [1000.0]
    async with stub_router(stats(idle={"w1": 30.0, "w2": 30.0})) as (url, _):
        client = RecordingClient([worker("w1", held=BLOCKS), worker("w2", held=BLOCKS)], (url,))
        async with Scaler(client, ScalerConfig(watch_s=0.0), **clocks(now)) as scaler:
            await a_keep_alive_on(scaler, now)
            stop = asyncio.Event()

            async def unreachable():
                stop.set()
                raise ControlPlaneError("control plane unreachable")

            client.list_deployments = unreachable
            await scaler.run(stop)  # one failed tick
            del client.list_deployments
            now[0] += 1.0
            [(_, decision)] = await scaler.tick()
            assert not decision.release and "not releasing on 0 s of signals" in decision.reason
            now[0] += POLICY.keep_alive_s
            [(_, decision)] = await scaler.tick()
            assert decision.release == ("w1", "w2")


async def test_failed_ticks_keep_no_more_history_than_the_policy_looks_back_on():
    """Found in review: each failed tick added a poll to every deployment's history, trimmed only by a tick that
    succeeded: an outage of the control plane grew it without bound."""
    now = [1000.0]
    async with stub_router(stats()) as (url, _):
        client = RecordingClient([worker("w1", held=BLOCKS)], (url,))
        async with Scaler(client, **clocks(now)) as scaler:
            await scaler.tick()
            for _ in range(1000):  # an outage of 2,000 s, a tick every 2 s
                now[0] += 2.0
                scaler._gap()
            assert len(scaler.tracked[PKG].history) == HISTORY_S / 2.0 + 1


async def one_tick(scaler: Scaler, client, list_deployments) -> None:
    """Run ``scaler`` for one tick, its client's ListDeployments answering as ``list_deployments`` does."""
    stop = asyncio.Event()

    async def answer():
        stop.set()
        return await list_deployments()

    client.list_deployments = answer
    await scaler.run(stop)


async def test_failed_ticks_are_counted_and_shown_until_a_tick_reaches_the_control_plane():
    """Found in review: a daemon whose every tick failed (the control plane out of reach, its token refused)
    showed nothing of it but a log line: /health said ok and no metric told."""
    now = [1000.0]
    async with stub_router(stats()) as (url, _):
        client = RecordingClient([worker("w1", held=BLOCKS)], (url,))
        async with Scaler(client, ScalerConfig(watch_s=0.0), **clocks(now)) as scaler:
            metric = scaler.metrics.registry.get_sample_value
            listed = client.list_deployments

            async def unreachable():
                raise ControlPlaneError("control plane unreachable")

            await one_tick(scaler, client, unreachable)  # one failed tick
            assert scaler.failed_ticks == 1 and metric("pipecast_scaler_tick_failures_total") == 1
            assert metric("pipecast_scaler_last_tick_timestamp_seconds") == 0  # never set
            now[0] += 1.0
            await one_tick(scaler, client, listed)  # one tick that reaches it
            assert scaler.failed_ticks == 0 and metric("pipecast_scaler_tick_failures_total") == 1
            assert metric("pipecast_scaler_last_tick_timestamp_seconds") == now[0] and scaler.tracked[PKG].history


async def test_a_token_refused_before_any_tick_went_through_stops_the_daemon():
    """Found in an operator's walk: with a wrong token the daemon retried for good, a warning a tick; no retry mends
    it. Refused once it has ticked (the control plane restarted with another token), it holds and retries."""
    now = [1000.0]
    async with stub_router(stats()) as (url, _):
        client = RecordingClient([worker("w1", held=BLOCKS)], (url,))
        async with Scaler(client, ScalerConfig(watch_s=0.0), **clocks(now)) as scaler:
            listed = client.list_deployments

            async def refused():
                raise Unauthenticated("control plane at cp:1 refused ListDeployments: missing or wrong token")

            with pytest.raises(Unauthenticated, match="missing or wrong token"):
                await one_tick(scaler, client, refused)
            await one_tick(scaler, client, listed)
            await one_tick(scaler, client, refused)  # no tick in this run went through, but one did before: held
            assert scaler.failed_ticks == 1


async def test_a_canary_added_again_after_a_rollback_is_judged_on_its_requests_since():
    """Found in review: the routers' counts are cumulative, so a canary added again was judged at once on the
    failures of its rolled-back run, and rolled back again before any request of the new one."""
    canary = "c" * 64
    gated = ModelRoute("chat", PKG, ((PKG, 90), (canary, 10)), CanaryGate(min_requests=10))
    answer = {**stats(), "versions": {PKG: version(0, 0, 0.5), canary: version(0, 0, 0.5)}}
    async with stub_router(answer) as (url, state):
        client = RecordingClient([worker("w1", held=BLOCKS)], (url,))
        client.routes = [gated]
        async with Scaler(client) as scaler:
            await scaler.tick()
            state["answer"] = {**stats(), "versions": {PKG: version(90, 0, 0.5), canary: version(6, 4, 0.5)}}
            await scaler.tick()
            assert [c[2] for c in client.calls if c[0] == "change_route"] == ["rollback"]
            client.routes = [ModelRoute("chat", PKG, ((PKG, 100),), gated.gate)]  # rolled back
            await scaler.tick()
            client.routes = [gated]  # added again: its 40% failed are the last run's
            client.calls.clear()
            await scaler.tick()
            state["answer"] = {**stats(), "versions": {PKG: version(180, 0, 0.5), canary: version(16, 4, 0.5)}}
            await scaler.tick()
            assert not [c for c in client.calls if c[0] == "change_route"]
            state["answer"] = {**stats(), "versions": {PKG: version(180, 0, 0.5), canary: version(16, 10, 0.5)}}
            await scaler.tick()  # 6 of 16 since failed
            [(_, _, _, _, reason)] = [c for c in client.calls if c[0] == "change_route"]
    assert reason.startswith("gate: canary error rate 37.5% > stable's 0.0% + 5.0% (canary: 16 requests, 6 failed")


async def test_the_daemon_keeps_a_history_that_spans_the_longest_the_policy_looks_back_on():
    now = [1000.0]
    long_keep_alive = replace(POLICY, keep_alive_s=900.0)
    async with stub_router(stats(idle={"w1": 1000.0})) as (url, _):
        client = RecordingClient([worker("w1", held=BLOCKS)], (url,))
        client.deployment = Deployment(PKG, long_keep_alive, (url,))
        async with Scaler(client, **clocks(now)) as scaler:
            for at in (1000.0, 1300.0, 1601.0):  # the oldest poll stays while the next is within HISTORY_S
                now[0] = at
                [(_, decision)] = await scaler.tick()
                assert bool(decision.release) == (at == 1601.0), (at, decision.reason)
            now[0] = 1902.0
            await scaler.tick()
            assert [s.at for s in scaler.tracked[PKG].history] == [1300.0, 1601.0, 1902.0]


async def test_a_stats_answer_of_many_tcp_segments_is_read_whole():
    """Review E, finding 1: one ``read(n)`` returned the first segment that arrived, so across hosts a /stats
    bigger than a segment was cut ("Unterminated string") and every pool held at no_signals."""
    idle = {f"w{i}": float(i) for i in range(1, 40)}  # some 4 kB of JSON: 3 segments
    async with stub_router(stats(queue=5, arrived=5, idle=idle), in_pieces=True) as (url, _):
        client = RecordingClient([worker("w1"), worker("w2"), worker("w3")], (url,))
        async with Scaler(client) as scaler:
            [(_, decision)] = await scaler.tick()
    assert decision.kind != "no_signals" and decision.add == 3, decision


def resolving(table: dict[str, list[str]], asked: list[tuple[str, int | None]] | None = None):
    """A resolver of the names in ``table`` (any other: no such name), recording each question in ``asked``."""
    async def resolve(host: str, port: int | None) -> list[str]:
        if asked is not None:
            asked.append((host, port))
        if host not in table:
            raise OSError(f"no such name: {host}")
        return table[host]
    return resolve


async def test_a_router_url_is_polled_at_every_address_its_name_has_a_single_one_as_it_is():
    """Review E, finding 4: two routers behind one Service name: each poll reached one of them, so the
    demand was half counted and flapped. A name with several addresses (a headless Service) is now polled at
    each of them, resolved each tick; one address or none: the URL as it is."""
    asked: list[tuple[str, int | None]] = []
    async with Scaler(None, resolve=resolving({"routers.test": ["10.1.0.1", "10.1.0.2"],
                                               "router.test": ["10.1.0.3"]}, asked)) as scaler:
        # Where to poll, and how many routers the URL stands for.
        assert await scaler._addresses("http://routers.test:8080") == (["10.1.0.1", "10.1.0.2"], 2)
        assert await scaler._addresses("http://router.test:8080") == ([None], 1)
        assert await scaler._addresses("http://unknown.test:8080") == ([None], 1)
    assert asked == [("routers.test", 8080), ("router.test", 8080), ("unknown.test", 8080)]


async def test_a_name_that_stood_for_several_routers_is_as_many_when_it_fails_to_resolve(caplog):
    """Found in review: a tick whose resolution of a headless Service's name failed polled the name as one
    router: the one it reached read as every router answering, and the replica busy at the other was released."""
    busy = {**stats(idle={"w1": 100.0, "w2": 100.0, "w3": None}), "in_flight": 1}  # w3 serves a request at B
    async with stub_router(stats(idle={"w1": 100.0, "w2": 100.0, "w3": 500.0})) as (first, _):
        port = int(first.rpartition(":")[2])
        async with stub_router(busy, host="127.0.0.2", port=port):
            table = {"localhost": ["127.0.0.1", "127.0.0.2"]}
            client = RecordingClient([worker("w1", BLOCKS), worker("w2", BLOCKS), worker("w3", BLOCKS)],
                                     (f"http://localhost:{port}",))  # the name itself reaches one router (A)
            now = [1000.0]
            async with Scaler(client, ScalerConfig(watch_s=0.0), **clocks(now),
                              resolve=resolving(table)) as scaler:
                await a_keep_alive_on(scaler, now)
                del table["localhost"]  # the resolver fails this tick
                [(_, decision)] = await scaler.tick()
    assert (decision.release, decision.inputs["routers"]) == ((), "1/2")
    assert [c for c in client.calls if c[0] == "release"] == []
    assert f"router http://localhost:{port}: its name did not resolve: 1 of the 2 routers it stood for count as " \
        "silent" in caplog.messages


async def test_a_name_resolves_to_its_addresses_of_one_family_once_each(monkeypatch):
    """A dual-stack name lists each router once per family (and per socket type): counted once each."""
    v4, v6 = socket.AF_INET, socket.AF_INET6
    infos = [(v4, socket.SOCK_STREAM, 6, "", ("10.1.0.1", 80)), (v6, socket.SOCK_STREAM, 6, "", ("fd00::1", 80, 0, 0)),
             (v4, socket.SOCK_STREAM, 6, "", ("10.1.0.2", 80)), (v4, socket.SOCK_STREAM, 6, "", ("10.1.0.1", 80))]

    async def getaddrinfo(host, port, **kwargs):
        assert (host, port, kwargs) == ("routers.test", 80, {"type": socket.SOCK_STREAM})
        return infos

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", getaddrinfo)
    assert await resolve_addresses("routers.test", 80) == ["10.1.0.1", "10.1.0.2"]


async def test_two_stub_routers_behind_one_name_add_up_with_the_names_host_header_resolved_each_tick():
    async with stub_router(stats(queue=2, arrived=2)) as (first, one):
        port = int(first.rpartition(":")[2])
        async with stub_router(stats(queue=3, arrived=3), host="127.0.0.2", port=port) as (_, two):
            asked: list[tuple[str, int | None]] = []
            resolve = resolving({"routers.test": ["127.0.0.1", "127.0.0.2"]}, asked)
            client = RecordingClient([worker("w1"), worker("w2"), worker("w3")], (f"http://routers.test:{port}",))
            async with Scaler(client, ScalerConfig(watch_s=0.0), resolve=resolve) as scaler:
                [(_, decision)] = await scaler.tick()
                await scaler.tick()
    assert json.loads(client.events[0].inputs_json)["queue_depth"] == 5 and decision.add == 3  # both queues
    assert one["hosts"] == two["hosts"] == [f"routers.test:{port}"] * 2
    assert asked == [("routers.test", port)] * 2


async def test_two_real_routers_behind_one_name_are_both_counted():
    """Two routers (their own queues and counts, as in values-ha) on 127.0.0.1 and 127.0.0.2 behind one name."""
    nowhere = ["http://127.0.0.1:9"]  # no worker: requests wait, then time out in each router's queue
    routers = [Router(RouterConfig(queue_timeout_s=0.05, health_interval_s=5), [StaticDiscovery(nowhere)])
               for _ in range(2)]
    async with listening(build_app(routers[0]), "127.0.0.1", 0, **RUNNER_OPTIONS) as first:
        port = int(first.rpartition(":")[2])
        async with listening(build_app(routers[1]), "127.0.0.2", port, **RUNNER_OPTIONS) as second:
            async with aiohttp.ClientSession() as http:
                for url, count in ((first, 2), (second, 3)):
                    for _ in range(count):
                        async with http.post(f"{url}/v1/completions", json={"model": "m", "prompt": "hi"}) as answer:
                            assert answer.status == 503
            resolve = resolving({"routers.test": ["127.0.0.1", "127.0.0.2"]})
            async with Scaler(None, resolve=resolve) as scaler:
                answers = await scaler._stats_of([f"http://routers.test:{port}"])
    signals = add_up(0.0, answers, {})
    assert (signals.routers_total, signals.routers_answered, signals.arrived) == (2, 2, 5)
    assert len(set(signals.instances)) == 2


async def test_the_watch_between_ticks_polls_every_router_behind_a_name():
    """A request waiting at the second router behind a name, idle at zero replicas: the watch sees it."""
    async with stub_router(stats()) as (first, _):
        port = int(first.rpartition(":")[2])
        async with stub_router(stats(), host="127.0.0.2", port=port) as (_, two):
            resolve = resolving({"routers.test": ["127.0.0.1", "127.0.0.2"]})
            client = RecordingClient([worker("w1")], (f"http://routers.test:{port}",))
            async with Scaler(client, ScalerConfig(tick_s=30.0, watch_s=0.05), resolve=resolve) as scaler:
                stop = asyncio.Event()
                task = asyncio.create_task(scaler.run(stop))
                while not scaler.tracked.get(PKG) or not scaler.tracked[PKG].history:
                    await asyncio.sleep(0.01)
                two["answer"] = stats(queue=1, arrived=1)
                async with asyncio.timeout(2):  # a watch interval and a tick, not the 30 s tick
                    while not any(call[0] == "scale_up" for call in client.calls):
                        await asyncio.sleep(0.01)
                stop.set()
                await task


async def test_failed_ticks_keep_their_pace_while_a_request_waits_at_zero():
    """Found in review: a failed tick left the deployment watched as idle at zero, so a waiting request started
    the next (failing) tick at once: thousands of ticks a second while the control plane was down."""
    class Failing(RecordingClient):
        fail = False
        lists = 0

        async def list_deployments(self):
            self.lists += 1
            if self.fail:
                raise ControlPlaneUnavailable("control plane down")
            return await super().list_deployments()

    async with stub_router(stats()) as (url, state):
        client = Failing([worker("w1")], (url,))
        async with Scaler(client, ScalerConfig(tick_s=0.5, watch_s=0.01)) as scaler:
            await scaler.tick()
            assert scaler.tracked[PKG].idle_at_zero
            state["answer"] = stats(queue=1, arrived=1)
            client.fail = True
            stop = asyncio.Event()
            task = asyncio.create_task(scaler.run(stop))
            await asyncio.sleep(1.2)
            stop.set()
            await task
            assert client.lists - 1 <= 4  # ticks 0.5 s apart, not one after another


async def test_a_router_name_no_resolver_takes_is_a_silent_router_not_a_failed_step():
    """Found in review: a router URL stored before such names were refused raised UnicodeError in every tick's
    poll, so its deployment never scaled, and in a gated route's judging it stopped the daemon."""
    bad = "http://router..svc:8080"
    async with stub_router(stats(queue=1, arrived=1)) as (url, _):
        client = RecordingClient([worker("w1"), worker("w2")], (url, bad))
        client.routes = [ModelRoute("m", PKG, ((PKG, 90), ("c" * 64, 10)), CanaryGate(0.5, 0.05, 10))]
        async with Scaler(client, ScalerConfig()) as scaler:
            [(_, decision)] = await scaler.tick()
            assert decision.action == "scale_up"
            assert scaler.tracked[PKG].history[-1].routers_answered == 1


async def test_the_store_serving_its_package_is_never_released_and_blocks_no_release():
    """Found in review: the package's store with a serve URL counted as a releasable replica; the control plane
    refuses to release a store, so every release (the other idle replicas too) was refused, retried for good."""
    now = [10_000.0]
    async with stub_router(stats(idle={"w1": 100.0, STORE: 200.0})) as (url, _):
        client = RecordingClient([worker("w1", held=BLOCKS), worker(STORE, held=BLOCKS)], (url,))
        async with Scaler(client, ScalerConfig(), **clocks(now)) as scaler:
            await a_keep_alive_on(scaler, now)
            [(_, released)] = await scaler.tick()
            assert released.release == ("w1",)


async def test_a_package_published_again_with_another_store_is_seen_at_the_next_tick():
    """Found in review: the daemon kept the package's store for good; published again with another store node, the
    new store was counted releasable (every release of the pool refused) and the old one never released."""
    now = [10_000.0]
    async with stub_router(stats(idle={"w1": 100.0, "w2": 100.0})) as (url, _):
        client = RecordingClient([worker("w1", held=BLOCKS), worker("w2", held=BLOCKS)], (url,))
        client.store = "w2"
        async with Scaler(client, ScalerConfig(), **clocks(now)) as scaler:
            await a_keep_alive_on(scaler, now)
            client.store = "w1"  # published again from w1
            [(_, released)] = await scaler.tick()
            assert released.release == ("w2",)  # w1, the store now, stays; w2, the store before, goes

"""The surge driver: the process inside the emulated cluster that publishes, scales up and sends the traffic.

The machine's own network namespace cannot reach the cluster's addresses, so one process on a host of the
cluster (the load generator) does everything that talks to the cluster's services, and reports through
files: an events file (JSON lines, as the agents write them) that the orchestrator follows, and a results
file at the end. ``python -m benchmarks.surge.loadgen SPEC.json``; one run:

1. publish the package on the control plane (before any agent registers, so warm holders count as
   sources), then emit ``published``;
2. wait until the cold workers (and warm sources) are registered, every worker's ``/health`` answers
   (cold ones done importing, warm ones ``ready``) and the router answers; emit ``armed``;
3. at the surge's start (``surge``, time t0) replay the schedule through the router, open loop, each
   request streamed; meanwhile poll every worker's health. Who scales: with ``scaled_by`` "daemon" the
   driver declared the deployment (step 1) and ``pipecast scaler`` decides from the routers' signals;
   with "oracle" the driver asks the control plane, at t0, to bring the package onto every cold worker
   (the whole pool at the first request: a baseline no deployment has); with "none" nobody does;
4. once every request has its answer (and, for the oracle, every worker is ready or ``ready_grace_s``
   later; for the daemon, it has released every worker above the pool's minimum or ``tail_s`` passed
   since the last answer: the keep-alive it pays after a surge is part of its cost), write the results: each
   request, each worker's health transitions, the scale events (the daemon's decisions from the control
   plane's audit trail, or the oracle's scale-up as one event).

A failure (a deadline passed, a service refused) is written to the results file as ``error`` and the
process exits with code 2.
"""

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from benchmarks.processes import driver_token
from benchmarks.surge.report import RequestResult
from benchmarks.surge.trace import ScheduledRequest, prompt_token_ids
from control_plane.client import ControlPlaneClient
from control_plane.deployments import Deployment
from control_plane.errors import ControlPlaneUnavailable
from control_plane.messages import PeerInfo
from packager.manifest import read_manifest
from pipecast.agent.events import EventLog
from pipecast.core.credentials import data_plane_key, serving_headers, serving_key
from pipecast.core.errors import PipecastError
from pipecast.router.app import QUEUE_HEADER, WORKER_HEADER

log = logging.getLogger(__name__)

POLL_S = 0.2  # health polls: the router's own interval is 0.25 s
PROGRESS_S = 2.0
HTTP_PROBE_TIMEOUT_S = 2.0
# A cold worker's serving process has imported torch and the model code and waits for the package.
COLD_STAGE = "waiting_for_package"


class DriverError(PipecastError):
    """The driver could not arm or run the surge: a service did not come up or refused (named)."""


@dataclass(frozen=True)
class WorkerEndpoint:
    """One worker of the pool: its host name, its serving URL, and whether it holds the model already."""

    name: str
    url: str
    warm: bool


@dataclass(frozen=True)
class DriverSpec:
    """Everything one run's driver needs (written as JSON by the orchestrator)."""

    router_url: str
    control_plane: str
    package: str  # the package folder: its manifest is published
    store_node: str
    store_address: str
    workers: tuple[WorkerEndpoint, ...]
    registered: tuple[str, ...]  # node ids that must be registered with the control plane before the surge
    plan_strategy: str  # "" lets the control plane choose
    schedule: tuple[ScheduledRequest, ...]
    vocab_size: int
    package_id: str  # also the model name requests carry: every worker accepts its package id
    events: str
    results: str
    prompt_seed: int = 0
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 900.0
    ready_grace_s: float = 60.0
    settle_s: float = 1.0  # a pause between armed and the surge, so start-up work does not spill over
    transports: tuple[str, ...] = field(default=("tcp",))
    scaled_by: str = "oracle"  # see benchmarks.surge.strategies.SCALERS
    deployment: dict | None = None  # Deployment.to_json() declared after publishing, for the daemon
    #: For the daemon: after the last answer, watch the pool at most this long for its releases.
    tail_s: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "DriverSpec":
        data = dict(data)
        data["workers"] = tuple(WorkerEndpoint(**w) for w in data["workers"])
        data["schedule"] = tuple(ScheduledRequest(**r) for r in data["schedule"])
        data["registered"] = tuple(data["registered"])
        data["transports"] = tuple(data["transports"])
        return cls(**data)


# -- one request ---------------------------------------------------------------------------------------


def completion_body(spec: DriverSpec, request: ScheduledRequest) -> dict:
    """The streamed, greedy completion request of ``request`` (its prompt as token ids)."""
    return {"model": spec.package_id, "prompt": prompt_token_ids(request, spec.vocab_size, spec.prompt_seed),
            "max_tokens": request.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}


def error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body, else the body's start."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace")


async def send(http: aiohttp.ClientSession, spec: DriverSpec, request: ScheduledRequest, t0: float,
               worker_names: dict[str, str]) -> RequestResult:
    """Send ``request`` at its time (already due) and follow its stream to the end or the deadline."""
    arrival = t0 + request.at_s
    sent = time.time()
    result = dict(index=request.index, arrival_s=request.at_s, sent_s=sent - t0, prompt_tokens=request.prompt_tokens,
                  max_tokens=request.max_tokens)
    first: float | None = None
    try:
        async with asyncio.timeout(spec.request_timeout_s):
            async with http.post(f"{spec.router_url}/v1/completions", json=completion_body(spec, request)) as answer:
                worker = answer.headers.get(WORKER_HEADER)
                queue = answer.headers.get(QUEUE_HEADER)
                result.update(http_status=answer.status, worker=worker_names.get(worker, worker),
                              queue_s=float(queue) if queue else None)
                if answer.status != 200:
                    status = "rejected" if answer.status == 429 else "failed"
                    return RequestResult(**result, status=status, latency_s=time.time() - arrival,
                                         error=error_message(await answer.read()))
                tokens, done, error = 0, False, ""
                async for raw in answer.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        error = str(event["error"].get("message", event["error"]))
                        break
                    if event.get("choices") and first is None:
                        first = time.time()
                    if event.get("usage"):
                        tokens = int(event["usage"]["completion_tokens"])
    except TimeoutError:
        return RequestResult(**result, status="failed", ttft_s=None if first is None else first - arrival,
                             latency_s=time.time() - arrival,
                             error=f"no complete answer within {spec.request_timeout_s:g} s")
    except (aiohttp.ClientError, ValueError, KeyError, TypeError) as exc:  # the others: a malformed event
        return RequestResult(**result, status="failed", latency_s=time.time() - arrival,
                             error=f"{type(exc).__name__}: {exc}")
    end = time.time()
    problem = error or ("the stream ended before any token" if first is None
                        else "" if done else "the stream ended without [DONE]")
    if problem:
        return RequestResult(**result, status="failed", latency_s=end - arrival, error=problem,
                             ttft_s=None if first is None else first - arrival)
    return RequestResult(**result, status="ok", ttft_s=first - arrival, latency_s=end - arrival, output_tokens=tokens)


# -- the run -------------------------------------------------------------------------------------------


def oracle_scale_event(scale_up: dict, workers: int, warm: int) -> dict:
    """The oracle's scale-up (``_scale_up``'s record) as a scale event, as the daemon's audit trail has them:
    at the surge's first instant, every cold worker."""
    receivers = list(scale_up["receivers"])
    return {"t": 0.0, "action": "scale_up", "count": len(receivers), "node_ids": receivers,
            "reason": f"oracle: every cold worker at the surge's first instant (plan {scale_up['strategy']}, "
                      f"answered in {scale_up['answered_s']:.2f} s)", "desired": workers, "actual": warm}


def holding(states: Sequence, nodes: set[str], package_id: str) -> int:
    """Of ``nodes``, how many hold blocks of ``package_id`` (the control plane's ``list_workers`` states)."""
    return sum(1 for state in states if state.worker.peer.node_id in nodes
               and any(h.package_id == package_id and h.blocks for h in state.held))


def back_at_minimum(states: Sequence, spec: DriverSpec) -> bool:
    """Whether the daemon's pool is back at its deployment's minimum: of the workers it sees (those registered
    with the control plane, warm ones included: it releases those as it does cold ones and may keep a cold one
    instead), no more than ``min_replicas`` hold the package (``states``: the control plane's ``list_workers``)."""
    return holding(states, set(spec.registered), spec.package_id) <= spec.deployment["policy"]["min_replicas"]


class Driver:
    """One run's driver; :meth:`run` does steps 1-4 of the module docstring."""

    def __init__(self, spec: DriverSpec) -> None:
        self.spec = spec
        self.events = EventLog(Path(spec.events), "load")
        self.health: dict[str, list[list]] = {w.name: [] for w in spec.workers}  # [t, status, blocks]
        self.results: list[RequestResult] = []
        self.in_flight = 0

    async def run(self) -> dict:
        """Arm, surge, replay; return the results object."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        # The serving key (none with auth off): a router with credentials names the worker that served a request
        # (x-pipecast-worker, each request's row) only to its holders.
        keyed = serving_headers(serving_key(data_plane_key(driver_token())))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout,
                                         headers=keyed) as http, \
                ControlPlaneClient(self.spec.control_plane, token=driver_token()) as cp:
            deadline = time.monotonic() + self.spec.startup_timeout_s
            await self._publish(cp, deadline)
            if self.spec.deployment is not None:
                await cp.put_deployment(Deployment.from_json(self.spec.deployment))
            await self._arm(http, cp, deadline)
            await asyncio.sleep(self.spec.settle_s)
            t0 = time.time()
            self.events.emit("surge", at=t0)
            poller = asyncio.create_task(self._poll_health(http, t0))
            progress = asyncio.create_task(self._progress(t0))
            try:
                # The scaling decision comes with the first request (it takes milliseconds; TTFT counts from
                # each request's scheduled arrival, so sending after it biases nothing) and a refusal ends
                # the run at once instead of leaving every request to time out.
                scale = await self._scale_up(cp, t0) if self.spec.scaled_by == "oracle" else None
                await self._replay(http, t0)
                if scale is not None:
                    await self._wait_all_ready()
                elif self.spec.deployment is not None:
                    await self._watch_releases(cp, t0)
                observed = time.time() - t0
            finally:
                for task in (poller, progress):
                    task.cancel()
                await asyncio.gather(poller, progress, return_exceptions=True)
            events = await cp.list_scale_events(self.spec.package_id, limit=100_000) if self.spec.deployment else []
        self.events.emit("done", answered=sum(r.status == "ok" for r in self.results))
        requests = [asdict(r) for r in sorted(self.results, key=lambda r: r.index)]
        warm = sum(w.warm for w in self.spec.workers)
        scale_events = [oracle_scale_event(scale, len(self.spec.workers), warm)] if scale is not None else \
            [{**e.to_json(), "t": e.at - t0} for e in events]
        return {"t0": t0, "scale_up": scale, "requests": requests, "health": self.health,
                "scale_events": scale_events, "observed_until_s": observed}

    async def _watch_releases(self, cp, t0: float) -> None:
        """Wait until the daemon's pool is back at its minimum (:func:`back_at_minimum`), or ``tail_s`` after the
        last answer: the workers it keeps meanwhile are billed (their agents' drops end their cost)."""
        last = max((r.finished_s for r in self.results), default=0.0)
        deadline = t0 + last + self.spec.tail_s
        while time.time() < deadline:
            try:
                if back_at_minimum(await cp.list_workers(), self.spec):
                    return
            except ControlPlaneUnavailable:
                pass  # a moment's outage: ask again
            await asyncio.sleep(POLL_S * 5)

    async def _publish(self, cp, deadline: float) -> None:
        manifest = read_manifest(Path(self.spec.package))
        store = PeerInfo(self.spec.store_node, self.spec.store_address, self.spec.transports)
        while True:
            try:
                await cp.publish_package(manifest, store)
                break
            except ControlPlaneUnavailable as exc:
                if time.monotonic() > deadline:
                    raise DriverError(f"the control plane at {self.spec.control_plane} did not answer within "
                                      f"{self.spec.startup_timeout_s:g} s: {exc}") from None
                await asyncio.sleep(POLL_S)
        self.events.emit("published", package=manifest.package_id)

    async def _arm(self, http: aiohttp.ClientSession, cp, deadline: float) -> None:
        """Wait until every registration and every worker's start-up is done (see the module docstring)."""
        pending: list[str] = []
        while time.monotonic() < deadline:
            alive = {w.worker.peer.node_id for w in await cp.list_workers() if w.alive}
            pending = [f"{n} (not registered with the control plane)" for n in self.spec.registered if n not in alive]
            for worker in self.spec.workers:
                state = await self._probe(http, f"{worker.url}/health")
                if state and state.get("status") == "failed":
                    raise DriverError(f"worker {worker.name} failed before the surge: {state.get('error')}")
                want = "status ready" if worker.warm else f"stage {COLD_STAGE}"
                got = state and (state.get("status") == "ready" if worker.warm else state.get("stage") == COLD_STAGE)
                if not got:
                    pending.append(f"{worker.name} (health {state or 'unreachable'}; waiting for {want})")
            if await self._probe(http, f"{self.spec.router_url}/health") is None:
                pending.append("the router (unreachable)")
            if not pending:
                self.events.emit("armed")
                return
            await asyncio.sleep(POLL_S * 2)
        raise DriverError(f"not armed within {self.spec.startup_timeout_s:g} s: waiting for {'; '.join(pending)}")

    async def _probe(self, http: aiohttp.ClientSession, url: str) -> dict | None:
        try:
            async with http.get(url, timeout=aiohttp.ClientTimeout(total=HTTP_PROBE_TIMEOUT_S)) as answer:
                return await answer.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    async def _scale_up(self, cp, t0: float) -> dict:
        cold = [w.name for w in self.spec.workers if not w.warm]
        reply = await cp.scale_up(self.spec.package_id, node_ids=cold, strategy=self.spec.plan_strategy)
        answered = time.time() - t0
        self.events.emit("scaled_up", plan=reply.plan_id, strategy=reply.strategy, sources=list(reply.sources))
        return {"plan_id": reply.plan_id, "strategy": reply.strategy, "sources": list(reply.sources),
                "receivers": list(reply.receivers), "answered_s": answered}

    async def _replay(self, http: aiohttp.ClientSession, t0: float) -> None:
        names = {w.url: w.name for w in self.spec.workers}
        tasks = []
        for request in self.spec.schedule:
            await asyncio.sleep(max(t0 + request.at_s - time.time(), 0.0))
            tasks.append(asyncio.create_task(self._one(http, request, t0, names)))
        await asyncio.gather(*tasks)

    async def _one(self, http: aiohttp.ClientSession, request: ScheduledRequest, t0: float,
                   names: dict[str, str]) -> None:
        self.in_flight += 1
        try:
            self.results.append(await send(http, self.spec, request, t0, names))
        finally:
            self.in_flight -= 1

    async def _poll_health(self, http: aiohttp.ClientSession, t0: float) -> None:
        async def watch(worker: WorkerEndpoint) -> None:
            while True:
                state = await self._probe(http, f"{worker.url}/health") or {}
                entry = [time.time() - t0, state.get("status", "unreachable"), state.get("blocks_present", 0)]
                history = self.health[worker.name]
                if not history or history[-1][1:] != entry[1:]:
                    history.append(entry)
                await asyncio.sleep(POLL_S)

        await asyncio.gather(*(watch(w) for w in self.spec.workers))

    def _ready(self) -> list[str]:
        return [name for name, history in self.health.items() if history and history[-1][1] == "ready"]

    async def _wait_all_ready(self) -> None:
        deadline = time.monotonic() + self.spec.ready_grace_s
        while len(self._ready()) < len(self.spec.workers) and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)

    async def _progress(self, t0: float) -> None:
        while True:
            await asyncio.sleep(PROGRESS_S)
            counts = {s: sum(r.status == s for r in self.results) for s in ("ok", "rejected", "failed")}
            serving = sum(1 for h in self.health.values() if h and h[-1][1] in ("partial", "ready"))
            self.events.emit("progress", elapsed=time.time() - t0, in_flight=self.in_flight, **counts,
                             serving=serving, ready=len(self._ready()), workers=len(self.spec.workers),
                             requests=len(self.spec.schedule))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", type=Path, help="the run's DriverSpec as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = DriverSpec.from_json(json.loads(args.spec.read_text()))
    try:
        results = asyncio.run(Driver(spec).run())
    except PipecastError as exc:
        Path(spec.results).write_text(json.dumps({"error": str(exc)}))
        log.error("%s", exc)
        return 2
    Path(spec.results).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

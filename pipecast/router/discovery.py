"""How the router learns its workers: a fixed list of URLs, or the control plane's worker list.

Every source answers the same question, :meth:`Discovery.list_workers`: which workers serve now, as
(node id, base URL) pairs, :meth:`Discovery.list_pipelines`: which groups of them serve together as
cross-node pipelines while none holds the whole model, and :meth:`Discovery.list_routes`: which packages
answer each served model name, with what share of its requests (only the control plane knows either; a
fixed list has none). The control plane's routes include each deployed package's model name, so that a
request for a deployed model waits for, and counts for, its deployment from the first one on. The router
asks each source again every discovery interval and keeps a source's last answer while it fails (a
control plane restart must not empty the pool).

Each worker comes with the serving key requests to it present (b"": none): the control plane's, with its
worker list; for a fixed list, the one the router's master token derives (a node token derives none).
"""

import logging
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from control_plane.errors import UnknownPackage
from control_plane.messages import SERVE_URL_LABEL
from pipecast.core.engines import DEFAULT_ENGINE
from pipecast.core.urls import http_base_url
from pipecast.router.errors import WorkerUrlError
from pipecast.serve.pipeline import Hop, route_header
from pipecast.v1.control_pb2 import PipelineInfo, WorkerState

if TYPE_CHECKING:
    from control_plane.deployments import Deployment
    from control_plane.routes import ModelRoute
    from pipecast.v1.manifest_pb2 import Manifest

log = logging.getLogger(__name__)

#: How a pipeline's key (the router's name for it, and the worker a request's answer names) begins.
PIPELINE_KEY_PREFIX = "pipeline:"
#: Characters of its package id a pipeline's key ends with (a content hash: 64 bits tell deployed packages apart).
PIPELINE_KEY_PACKAGE_CHARS = 16


def pipeline_key(package_id: str, node_ids: Iterable[str]) -> str:
    """The key of the pipeline of package ``package_id`` through ``node_ids``: :data:`PIPELINE_KEY_PREFIX`, the
    node ids URL-quoted (a node id may hold '+' or '@') joined by '+', then '@' and the package id's first
    :data:`PIPELINE_KEY_PACKAGE_CHARS` characters (during a rollout the same nodes serve two packages' pipelines).
    Readers count its '+' for its stages (two or more) and take its head's quoted node id before the first '+'."""
    nodes = "+".join(urllib.parse.quote(n, safe="") for n in node_ids)
    return f"{PIPELINE_KEY_PREFIX}{nodes}@{package_id[:PIPELINE_KEY_PACKAGE_CHARS]}"


@dataclass(frozen=True)
class DiscoveredWorker:
    """A serving worker: its node id, the base URL of its HTTP API (no trailing slash), what answers
    there (:data:`pipecast.core.engines.SERVING_ENGINES`), the serving key requests to it present and, for a
    vLLM worker, the package it serves as its source knows it ("": unknown). A pipecast worker names its
    package in its own health answers; a vLLM worker's name none, so the router takes this one."""

    node_id: str
    url: str
    engine: str = DEFAULT_ENGINE
    serving_key: bytes = b""
    package_id: str = ""


@dataclass(frozen=True)
class DiscoveredPipeline:
    """A cross-node pipeline: its stages' workers in order (the first, the head, receives the request
    with the route in ``header``, the value of :data:`pipecast.serve.pipeline.PIPELINE_HEADER`)."""

    key: str  # pipeline_key(package_id, its stages' node ids)
    head_url: str
    member_urls: tuple[str, ...]
    header: str
    waiting_blocks: int = 0  # blocks its stages still wait for
    package_id: str = ""


#: Served model name -> its versions as (package id, weight in percent), the stable version first.
RouteTable = dict[str, tuple[tuple[str, int], ...]]


def normalize_url(url: str, source: str) -> str:
    """``url`` as a base URL without a trailing slash; :class:`WorkerUrlError` when it is not http(s)."""
    base = http_base_url(url)
    if base is None:
        raise WorkerUrlError(url, source)
    return base


class Discovery(Protocol):
    """A source of serving workers."""

    #: Names the source in logs and errors.
    name: str
    #: The cluster's serving key as this source last knew it (b"": none known, or auth off).
    serving_key: bytes

    async def list_workers(self) -> list[DiscoveredWorker]:
        """The workers of this source now; raises when the source cannot answer."""
        ...

    async def list_pipelines(self) -> list[DiscoveredPipeline]:
        """The cross-node pipelines among this source's workers now; raises when it cannot answer."""
        ...

    async def list_routes(self) -> RouteTable:
        """The served names with versions now; raises when the source cannot answer."""
        ...


class StaticDiscovery:
    """A fixed list of worker URLs (``--worker URL``, ``--vllm-worker URL`` with ``engine="vllm"``); each
    URL is also the worker's node id. ``serving_key`` goes to pipecast's workers only."""

    def __init__(self, urls: list[str], engine: str = DEFAULT_ENGINE, serving_key: bytes = b"") -> None:
        self.name = "--worker" if engine == DEFAULT_ENGINE else f"--{engine}-worker"
        self.serving_key = serving_key
        key = serving_key if engine == DEFAULT_ENGINE else b""
        self._workers = [DiscoveredWorker(node_id=url, url=url, engine=engine, serving_key=key)
                         for url in dict.fromkeys(normalize_url(url, self.name) for url in urls)]

    async def list_workers(self) -> list[DiscoveredWorker]:
        """The configured workers."""
        return list(self._workers)

    async def list_pipelines(self) -> list[DiscoveredPipeline]:
        """None: a fixed list of workers says nothing about the blocks they hold."""
        return []

    async def list_routes(self) -> RouteTable:
        """None: a fixed list of workers has no versions."""
        return {}


# --- Control plane -----------------------------------------------------------------------------------
# A serving worker registers its HTTP base URL in WorkerSpec.serve_url (`pipecast agent --serve-url`).
# Workers registered before that field existed carried it as the label SERVE_URL_LABEL; it is still read
# when the field is empty.


class WorkerLister(Protocol):
    """The part of :class:`control_plane.client.ControlPlaneClient` the router uses."""

    async def list_workers_keyed(self) -> tuple[list[WorkerState], bytes]:
        """Every registered worker, alive or not, and the cluster's serving key."""
        ...

    async def list_pipelines(self, package_id: str = "") -> list[PipelineInfo]:
        """The cross-node pipelines of every package now."""
        ...

    async def list_routes(self) -> "list[ModelRoute]":
        """Every served model's route."""
        ...

    async def list_deployments(self) -> "list[Deployment]":
        """Every package the scaling daemon keeps."""
        ...

    async def get_package(self, package_id: str) -> "tuple[Manifest, object]":
        """A package's manifest (and its store)."""
        ...


class ControlPlaneDiscovery:
    """The workers the control plane lists as alive with a serve URL (WorkerSpec.serve_url, else the label
    :data:`SERVE_URL_LABEL`); a vLLM worker with the package its agent holds blocks of, where it holds one
    package only (``vllm serve`` runs one package, whose blocks its agent holds; with several held the
    control plane does not say which is served, so none is given)."""

    def __init__(self, client: WorkerLister, address: str) -> None:
        self._client = client
        self.name = f"control plane {address}"
        self.serving_key = b""
        self._model_names: dict[str, str] = {}  # deployed package id -> its manifest's model name

    async def list_workers(self) -> list[DiscoveredWorker]:
        """Alive serving workers; a malformed serve URL is logged and skipped (that worker's fault)."""
        found = []
        states, serving_key = await self._client.list_workers_keyed()
        self.serving_key = serving_key
        for state in states:
            worker = state.worker
            node_id, serve_url = worker.peer.node_id, worker.serve_url or worker.labels.get(SERVE_URL_LABEL, "")
            if not state.alive or not serve_url:
                continue
            engine = worker.engine or DEFAULT_ENGINE
            held = {h.package_id for h in state.held if h.blocks} if engine != DEFAULT_ENGINE else set()
            try:
                found.append(DiscoveredWorker(node_id, normalize_url(serve_url, f"{self.name}, worker {node_id}"),
                                              engine, serving_key if engine == DEFAULT_ENGINE else b"",
                                              held.pop() if len(held) == 1 else ""))
            except WorkerUrlError as exc:
                log.warning("skipping a worker: %s", exc)
        return found

    async def list_pipelines(self) -> list[DiscoveredPipeline]:
        """The control plane's pipelines (every package's), as routes; one with a malformed stage URL is
        logged and skipped."""
        found = []
        for info in await self._client.list_pipelines():
            try:
                hops = [Hop(normalize_url(s.serve_url, f"{self.name}, pipeline stage {s.node_id}"),
                            range(s.layer_start, s.layer_end)) for s in info.stages]
            except WorkerUrlError as exc:
                log.warning("skipping a pipeline: %s", exc)
                continue
            found.append(DiscoveredPipeline(pipeline_key(info.package_id, (s.node_id for s in info.stages)),
                                            hops[0].url, tuple(h.url for h in hops), route_header(hops),
                                            info.waiting_blocks, info.package_id))
        return found

    async def list_routes(self) -> RouteTable:
        """The control plane's routes (``pipecast cp route``, ``canary``, ``promote``, ``rollback``), and for
        each deployed package (``pipecast cp deploy``) whose manifest's model name no route serves and no
        other deployed package shares, that name routed to it alone. So a request for a deployed model
        waits for that package's workers, and counts in its version's signals (``/stats``), from the first
        request on: before any worker names the model (a worker waiting for its package names none), the
        request would otherwise count for no deployment, and a scaling daemon could not tell whose it is.
        """
        routes = {route.name: route.versions for route in await self._client.list_routes()}
        deployed = dict.fromkeys(d.package_id for d in await self._client.list_deployments())  # ordered set
        self._model_names = {p: name for p, name in self._model_names.items() if p in deployed}
        packages_of: dict[str, list[str]] = {}
        for package in deployed:
            if package not in self._model_names:  # a manifest never changes: asked once per deployment
                try:
                    manifest, _ = await self._client.get_package(package)
                except UnknownPackage:  # removed since it was listed: no name to route
                    continue
                self._model_names[package] = manifest.model_name
            if self._model_names.get(package):
                packages_of.setdefault(self._model_names[package], []).append(package)
        for name, packages in packages_of.items():
            if name not in routes and len(packages) == 1:
                routes[name] = ((packages[0], 100),)
        return routes

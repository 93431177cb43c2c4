"""Command line of the control plane: ``control-plane`` runs the server; the ``cp`` group is the
operator's view (workers, packages, availability, plans, deployments) and levers (publish, remove, scale-up,
release, issue-token, revoke-node, deploy, undeploy).

Settings come from pipecast's settings (env ``PIPECAST_*``, ``--config`` TOML); flags override them.
"""

import asyncio
import dataclasses
import functools
import json
import re
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any, get_args

import click
from click.core import ParameterSource
from google.protobuf import json_format

from control_plane.deployments import (
    DEFAULT_WARM_AUTO_FACTOR,
    MAX_COUNT,
    MAX_DURATION_S,
    WARM_AUTO_FACTORS,
    Deployment,
    ScalingPolicy,
)
from control_plane.errors import InvalidRequest, UnknownPackage
from control_plane.messages import PeerInfo
from control_plane.routes import CanaryGate, RouteChange
from control_plane.routes import describe as describe_route
from packager.manifest import read_manifest
from pipecast.core.clitypes import Number, SettingPath
from pipecast.core.priorities import DEFAULT_PRIORITY, PRIORITIES
from pipecast.core.settings import Settings, load_settings, read_token_file
from pipecast.core.signals import on_stop_signals
from pipecast.core.units import format_bytes, parse_duration

CONFIG = click.option("--config", type=SettingPath(path_type=Path, exists=True, dir_okay=False),
                      help="TOML config file (also PIPECAST_CONFIG).")
TOKEN = click.option("--token", help="The control plane's master token, or a node token for reads (settings: "
                                     "auth_token; env PIPECAST_AUTH_TOKEN). Any local user sees it in `ps` while "
                                     "the command runs: prefer --token-file or PIPECAST_AUTH_TOKEN.")
TOKEN_FILE = click.option("--token-file", type=SettingPath(path_type=Path, exists=True, dir_okay=False),
                          help="A file holding the token, read as --token is, out of sight of `ps` (white space "
                               "around it left out; refused if another user could change the file).")


def given_token(token: str | None, token_file: Path | None) -> str | None:
    """The token of ``--token`` or ``--token-file`` (None: neither, the settings' then)."""
    if token is not None and token_file is not None:
        raise click.UsageError("--token and --token-file both give the token: give one")
    return read_token_file(token_file) if token_file is not None else token


class Duration(click.ParamType):
    """Seconds, written as 2s, 500ms, 5m or a plain number; ``positive``: more than 0; at most ``maximum``."""

    name = "duration"

    def __init__(self, *, positive: bool = False, maximum: float | None = None) -> None:
        self.positive, self.maximum = positive, maximum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            seconds = value if isinstance(value, float) else parse_duration(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        if self.positive and seconds <= 0:
            self.fail(f"must be longer than 0, got {value!r}", param, ctx)
        if self.maximum is not None and seconds > self.maximum:
            self.fail(f"must be at most {self.maximum:g} s, got {value!r}", param, ctx)
        return seconds


@click.command("control-plane")
@CONFIG
@click.option("--host", help="Listen address (settings: control_host).")
@click.option("--port", type=click.IntRange(0, 65535), help="Listen port, 0 for any (settings: control_port).")
@click.option("--db", help="SQLite file, or a postgresql:// URL several replicas share (settings: control_db; "
                           "a password is better in PGPASSWORD or ~/.pgpass than here).")
@click.option("--advertise", metavar="HOST:PORT",
              help="Where clients reach this replica; standbys name the leader's (settings: control_advertise; "
                   "default: --host:--port).")
@click.option("--lease-s", type=Number(min=0, min_open=True),
              help="Worker lease, and the lease of the leading replica (settings: lease_s).")
@click.option("--metrics-port", type=click.IntRange(0, 65535),
              help="Serve Prometheus metrics on this port, 0 for any (settings: control_metrics_port; off unless "
                   "set).")
@click.option("--store-links", type=click.IntRange(min=1),
              help="A store's egress in worker links: scale-ups give the store this many rotated groups "
                   "(settings: control_store_links).")
@click.option("--store-beside-holders/--no-store-beside-holders", default=None,
              help="Whether a rotated scale-up also sends from the store, while it is idle, beside the workers "
                   "holding the package (settings: control_store_beside_holders; on by default). Off saves the "
                   "store's egress where peers can send.")
@click.option("--straggler-factor", type=Number(min=0, max=1, max_open=True),
              help="A receiver slower than this share of what its parents deliver (or of its declared link "
                   "rate) is a straggler: its children move to faster parents and it becomes a leaf; 0 turns "
                   "this off (settings: control_straggler_factor, 0.5).")
def control_plane_command(config: Path | None, host: str | None, port: int | None, db: str | None,
                          advertise: str | None, lease_s: float | None, metrics_port: int | None,
                          store_links: int | None, store_beside_holders: bool | None,
                          straggler_factor: float | None) -> None:
    """Run the control plane until SIGINT/SIGTERM (a replica on a shared database: until then, or until it
    loses the lease, which exits 1 so that its supervisor restarts it as a standby)."""
    from control_plane.collector import tune_collector
    from control_plane.server import ControlPlaneServer, ServerConfig  # grpc: not by `--help`

    settings = load_settings(config, control_host=host, control_port=port, control_db=db, lease_s=lease_s,
                             control_advertise=advertise, control_store_links=store_links,
                             control_store_beside_holders=store_beside_holders,
                             control_straggler_factor=straggler_factor)
    server_config = ServerConfig.from_settings(settings, metrics_port=metrics_port)

    async def serve() -> str:
        tune_collector()
        server = ControlPlaneServer(server_config)
        await server.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        on_stop_signals(loop, stop.set)
        metrics = f", metrics on :{server.metrics_port}" if server.metrics_port is not None else ""
        role = "" if not server.store.shared else ", leader" if server.leading else ", standby"
        click.echo(f"control plane listening on {server.address} (db {server.store.where}{metrics}{role})", err=True)
        ended = [asyncio.create_task(stop.wait()), asyncio.create_task(server.deposed.wait())]
        try:
            await asyncio.wait(ended, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in ended:
                task.cancel()
            await server.stop(grace_s=2.0)
        return server.deposed_reason

    deposed = asyncio.run(serve())
    if deposed:
        raise click.ClickException(f"{deposed}; exiting (restarted, it runs as a standby)")


class GroupOptionsAnywhere(click.Group):
    """A group whose own options may also follow its subcommand, as users type them (``pipecast cp publish
    PKG --store-node s --control-plane HOST:PORT``): they are moved in front before parsing. Its
    subcommands must not have options of the same names (a test checks)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        own = {opt: param for param in self.params if isinstance(param, click.Option) for opt in param.opts}
        front: list[str] = []
        rest: list[str] = []
        i = 0
        while i < len(args):
            arg = args[i]
            if arg == "--":  # the end of options: the rest is the subcommand's, as given
                rest += args[i:]
                break
            name, eq, _ = arg.partition("=")
            param = own.get(name)
            taken = 1 if param is None or param.is_flag or eq else 2
            (rest if param is None else front).extend(args[i:i + taken])
            i += taken
        return super().parse_args(ctx, front + rest)


@dataclasses.dataclass
class CpOptions:
    """``pipecast cp``'s own options, its subcommands' ``ctx.obj``. The settings are loaded when a subcommand first
    needs them, not by the group: a subcommand's ``--help`` was refused for a bad ``PIPECAST_*`` variable or a
    missing ``PIPECAST_CONFIG`` file, the group running before click reads the subcommand's options."""

    config: Path | None
    target: str | None
    token: str | None
    token_file: Path | None
    as_json: bool

    @functools.cached_property
    def settings(self) -> Settings:
        """The settings, with the group's ``--config``, ``--control-plane`` and ``--token`` (or ``--token-file``)."""
        return load_settings(self.config, control_plane=self.target,
                             auth_token=given_token(self.token, self.token_file))


@click.group("cp", cls=GroupOptionsAnywhere)
@CONFIG
@click.option("--control-plane", "target", help="host:port of the control plane (settings: control_plane).")
@TOKEN
@TOKEN_FILE
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.pass_context
def cp_group(ctx: click.Context, config: Path | None, target: str | None, token: str | None, token_file: Path | None,
             as_json: bool) -> None:
    """Operate a running control plane. A PACKAGE_ID (or --package) may be the start of a published package's id,
    8 hex digits or more, as the listings print it (in either case)."""
    ctx.obj = CpOptions(config, target, token, token_file, as_json)


def _run(ctx: click.Context, call: Callable[[Any], Awaitable[Any]]) -> Any:
    """Run ``call(client)`` against the control plane named in the settings."""
    from control_plane.client import ControlPlaneClient  # grpc: not loaded by `--help`

    settings = ctx.obj.settings

    async def go() -> Any:
        async with ControlPlaneClient.from_settings(settings) as client:
            return await call(client)

    return asyncio.run(go())


#: A package id as the cp commands take it (in either case): a whole one, or the start of one, 8 hex digits or more
#: (the listings print 12 or 20).
WHOLE_PACKAGE_ID = re.compile(r"[0-9a-f]{64}")
PACKAGE_ID_PREFIX = re.compile(r"[0-9a-f]{8,63}")


async def full_package_id(client: Any, package_id: str) -> str:
    """The whole package id ``package_id`` names, in lower case: itself if whole, else the one published id it is
    the start of (:data:`PACKAGE_ID_PREFIX`); "" (none given: every package, or a route's one canary) as is.
    Raises :class:`InvalidRequest` for anything else (a package is named by its id only: a name, a prefix too short
    or not hex would match nothing) and when several ids start with it, :class:`UnknownPackage` when none does."""
    wanted = package_id.lower()
    if not wanted or WHOLE_PACKAGE_ID.fullmatch(wanted):
        return wanted
    if not PACKAGE_ID_PREFIX.fullmatch(wanted):
        raise InvalidRequest(f"package id {package_id!r} is neither a whole package id (64 hex digits) nor the start "
                             "of one (8 hex digits or more)")
    found = sorted(p.package_id for p in await client.list_packages() if p.package_id.startswith(wanted))
    if not found:
        raise UnknownPackage(f"no published package id starts with {wanted!r}")
    if len(found) > 1:
        raise InvalidRequest(f"package id {wanted!r} is ambiguous: {len(found)} published package ids start "
                             f"with it ({', '.join(found)}); give more of it")
    return found[0]


def _run_for(ctx: click.Context, package_id: str, call: Callable[[Any, str], Awaitable[Any]]) -> tuple[str, Any]:
    """:func:`_run` of ``call(client, id)``, ``id`` the whole package id ``package_id`` may be the start of
    (:func:`full_package_id`); returns ``id`` and what ``call`` returned."""
    async def resolved(client: Any) -> tuple[str, Any]:
        full = await full_package_id(client, package_id)
        return full, await call(client, full)

    return _run(ctx, resolved)


def _emit(ctx: click.Context, data: Any, lines: list[str]) -> None:
    if ctx.obj.as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
    else:
        for line in lines:
            click.echo(line)


def _ranges(blocks: frozenset[int]) -> str:
    """{1, 2, 3, 7} -> "1-3,7"."""
    spans: list[list[int]] = []
    for block in sorted(blocks):
        if spans and block == spans[-1][1] + 1:
            spans[-1][1] = block
        else:
            spans.append([block, block])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in spans) or "-"


def _message_json(message: Any) -> dict:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


@cp_group.command("workers")
@click.pass_context
def workers_command(ctx: click.Context) -> None:
    """List workers: liveness, lease left, address, data-plane transports (a plan's nodes speak one), labels, blocks
    held in memory and cached on disk only, per package (package:blocks)."""
    workers = _run(ctx, lambda c: c.list_workers())
    lines = [f"{'NODE':<24} {'ALIVE':<5} {'LEASE':>7}  {'ADDRESS':<22} {'TRANSPORT':<9} LABELS / HELD / CACHED"]
    for w in workers:
        labels = ",".join(f"{k}={v}" for k, v in sorted(w.worker.labels.items())) or "-"
        held, cached = (" ".join(f"{h.package_id[:12]}:{len(h.blocks)}" for h in holdings) or "-"
                        for holdings in (w.held, w.cached))
        transports = ",".join(w.worker.peer.transports) or "-"
        lines.append(f"{w.worker.peer.node_id:<24} {'yes' if w.alive else 'DEAD':<5} {w.lease_remaining_s:>6.1f}s  "
                     f"{w.worker.peer.address:<22} {transports:<9} {labels} / {held} / {cached}")
    _emit(ctx, [_message_json(w) for w in workers], lines)


@cp_group.command("packages")
@click.pass_context
def packages_command(ctx: click.Context) -> None:
    """List published packages with their holders."""
    packages = _run(ctx, lambda c: c.list_packages())
    lines = [f"{'PACKAGE':<20} {'MODEL':<28} {'BLOCKS':>6} {'SIZE':>10} {'COMPLETE':>8} {'BLOCK COPIES':>12}  STORE"]
    for p in packages:
        lines.append(f"{p.package_id[:20]:<20} {p.model_name[:28]:<28} {p.num_blocks:>6} "
                     f"{format_bytes(p.total_bytes):>10} {p.complete_holders:>8} {p.block_replicas:>12}  "
                     f"{p.store.node_id}@{p.store.address}")
    _emit(ctx, [_message_json(p) for p in packages], lines)


@cp_group.command("availability")
@click.argument("package_id")
@click.pass_context
def availability_command(ctx: click.Context, package_id: str) -> None:
    """Both maps of a package: blocks per worker and workers per block."""
    _, view = _run_for(ctx, package_id, lambda c, full: c.availability(full))
    lines = [f"package {view.package_id}: {view.num_blocks} blocks", "by worker:"]
    lines += [f"  {node:<24} {len(blocks):>4}/{view.num_blocks}  {_ranges(blocks)}"
              for node, blocks in sorted(view.by_worker.items())]
    lines.append("by block:")
    lines += [f"  {block:>4}  {len(nodes):>4} holders  {' '.join(sorted(nodes)) or '-'}"
              for block, nodes in enumerate(view.by_block)]
    data = {"package_id": view.package_id, "num_blocks": view.num_blocks,
            "by_worker": {node: sorted(blocks) for node, blocks in view.by_worker.items()},
            "by_block": [sorted(nodes) for nodes in view.by_block]}
    _emit(ctx, data, lines)


@cp_group.command("plans")
@click.option("--package", "package_id", default="", help="Only this package's plans.")
@click.pass_context
def plans_command(ctx: click.Context, package_id: str) -> None:
    """List active scale-up plans."""
    _, plans = _run_for(ctx, package_id, lambda c, full: c.list_plans(full))
    lines = [f"{'PLAN':<12} {'PACKAGE':<20} {'STRATEGY':<9} {'SOURCES':>7} {'RECEIVERS':>9} {'PENDING':>7} "
             f"{'REPLANS':>7}  {'CREATED':<19}  DEMOTED"]
    for p in plans:
        created = datetime.fromtimestamp(p.created_unix).isoformat(timespec="seconds")
        lines.append(f"{p.plan_id:<12} {p.package_id[:20]:<20} {p.strategy:<9} {len(p.sources):>7} "
                     f"{len(p.receivers):>9} {len(p.pending):>7} {p.replans:>7}  {created:<19}  "
                     f"{','.join(p.demoted) or '-'}")
    _emit(ctx, [_message_json(p) for p in plans], lines)


@cp_group.command("pipelines")
@click.option("--package", "package_id", default="", help="Only this package's pipelines.")
@click.pass_context
def pipelines_command(ctx: click.Context, package_id: str) -> None:
    """List cross-node pipelines: serving workers that together hold every layer while none holds all."""
    _, pipelines = _run_for(ctx, package_id, lambda c, full: c.list_pipelines(full))
    lines = [f"{'PACKAGE':<20} {'STAGES':>6} {'SLOWEST':>8}  NODE[LAYERS] ..."]
    for p in pipelines:
        stages = " -> ".join(f"{s.node_id}[{s.layer_start}-{s.layer_end - 1}]" for s in p.stages)
        lines.append(f"{p.package_id[:20]:<20} {len(p.stages):>6} {p.bottleneck_layers:>8.1f}  {stages}")
    _emit(ctx, [_message_json(p) for p in pipelines], lines)


@cp_group.command("status")
@click.pass_context
def status_command(ctx: click.Context) -> None:
    """One screen of the cluster: workers, packages (holders), plans, pipelines, deployments (replicas), routes."""
    async def everything(c: Any) -> tuple:
        return await asyncio.gather(c.list_workers(), c.list_packages(), c.list_plans(), c.list_pipelines(),
                                    c.list_deployments(), c.list_routes())

    workers, packages, plans, pipelines, deployments, routes = _run(ctx, everything)
    alive = [w for w in workers if w.alive]
    # The model's name and the start of the id: two versions of one model (a canary) read alike by name alone.
    models = {p.package_id: f"{p.model_name}@{p.package_id[:8]}" for p in packages}
    lines = [f"workers: {len(alive)} alive of {len(workers)}"]
    for w in workers:
        held = " ".join(f"{models.get(h.package_id, h.package_id[:12])}:{len(h.blocks)}" for h in w.held) or "-"
        bound = w.worker.serve_package
        serves = f"its worker serves {models.get(bound, bound[:12])}" if bound else ""
        # A copy it never serves: placed before its agent said what it serves (the scaling daemon releases it).
        strays = [models.get(h.package_id, h.package_id[:12]) for h in w.held
                  if bound and h.package_id != bound and h.blocks]
        serves = f" (holds {', '.join(strays)}, {serves})" if strays else f" ({serves})" if serves else ""
        lines.append(f"  {w.worker.peer.node_id:<24} {'alive' if w.alive else 'DEAD':<5} {held}{serves}")
    lines.append(f"packages: {len(packages)}")
    for p in packages:
        lines.append(f"  {p.model_name[:28]:<28} {p.package_id[:12]}  {p.num_blocks} blocks, "
                     f"{format_bytes(p.total_bytes)}, {p.complete_holders} holding all, store {p.store.node_id}")
    lines.append(f"plans in progress: {len(plans)}")
    for p in plans:
        lines.append(f"  {p.plan_id:<12} {models.get(p.package_id, p.package_id[:12])}: {p.strategy} from "
                     f"{', '.join(p.sources)} to {len(p.receivers)}, {len(p.pending)} pending")
    lines.append(f"pipelines: {len(pipelines)}")
    for p in pipelines:
        lines.append(f"  {models.get(p.package_id, p.package_id[:12])}: "
                     + " -> ".join(f"{s.node_id}[{s.layer_start}-{s.layer_end - 1}]" for s in p.stages))
    lines.append(f"deployments: {len(deployments)}")
    for d in deployments:
        # Serving workers holding blocks (a store with a serve URL too), not agents alone nor workers bound to
        # another package: the daemon's replicas but those still to receive their first block.
        replicas = sum(1 for w in alive if w.worker.serve_url and w.worker.serve_package in ("", d.package_id)
                       and any(h.package_id == d.package_id and h.blocks for h in w.held))
        lines.append(f"  {models.get(d.package_id, d.package_id[:12])}: {replicas} serving workers holding blocks, "
                     f"{_describe_policy(d.policy)}; priority {d.priority}")
    lines.append(f"routes: {len(routes)}")
    lines.extend(f"  {describe_route(r, r.name)}" + (" (gated)" if r.gate else "") for r in routes)
    _emit(ctx, {"workers": [_message_json(w) for w in workers], "packages": [_message_json(p) for p in packages],
                "plans": [_message_json(p) for p in plans], "pipelines": [_message_json(p) for p in pipelines],
                "deployments": [d.to_json() for d in deployments], "routes": [r.to_json() for r in routes]}, lines)


@click.command("status", params=list(cp_group.params))
@click.pass_context
def cluster_status_command(ctx: click.Context, **options: Any) -> None:
    """One screen of the cluster: `pipecast cp status`, with the options of `pipecast cp`."""
    ctx.invoke(cp_group.callback, **options)  # the settings and --json, as `pipecast cp` keeps them
    ctx.invoke(status_command.callback)


#: How many heartbeats (heartbeat_s, this command's setting), and at least how long, `cp publish` waits for an alive
#: store to report the package's blocks before it warns that it holds none: a store registered before the publish
#: reports the package at its next heartbeat (the control plane's, which may be set otherwise than here).
STORE_REPORT_WAIT_HEARTBEATS = 2.5
STORE_REPORT_WAIT_MIN_S = 5.0
#: The data-plane transports a store may serve over: the agents' ``agent_transport`` less ``auto`` (which an agent
#: resolves to one of them).
TRANSPORTS = tuple(name for name in get_args(Settings.model_fields["agent_transport"].annotation) if name != "auto")


@cp_group.command("publish")
@click.argument("package_dir", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--store-node", required=True, help="Node id of the store that serves the package.")
@click.option("--store-address", required=True, help="host:port of that store's data plane.")
@click.option("--transport", "transports", type=click.Choice(TRANSPORTS), multiple=True, default=("tcp",),
              show_default=True, help="A data-plane transport the store serves the package over (repeat for "
                                      "several, in order of preference).")
@click.pass_context
def publish_command(ctx: click.Context, package_dir: Path, store_node: str, store_address: str,
                    transports: tuple[str, ...]) -> None:
    """Publish the package in PACKAGE_DIR (its manifest.json), served by a store node. Published before its store
    registers (a supported order), it says so: its scale-ups have no source until then."""
    manifest = read_manifest(package_dir)
    store = PeerInfo(store_node, store_address, transports)

    async def publish(client: Any) -> tuple[str, bool, str | None, bool]:
        try:
            before = (await client.get_package(manifest.package_id))[1].node_id
        except UnknownPackage:
            before = None
        package_id = await client.publish_package(manifest, store)
        alive = any(w.alive and w.worker.peer.node_id == store_node for w in await client.list_workers())
        # A store that registered before the publish reports the package within a heartbeat of it.
        holds, deadline = False, time.monotonic() + wait_s
        while alive and not holds and time.monotonic() < deadline:
            holds = bool((await client.availability(package_id)).by_worker.get(store_node))
            if not holds:
                await asyncio.sleep(0.2)
        return package_id, alive, before, holds

    wait_s = max(STORE_REPORT_WAIT_HEARTBEATS * ctx.obj.settings.heartbeat_s, STORE_REPORT_WAIT_MIN_S)
    package_id, store_alive, before, holds = _run(ctx, publish)
    warnings = []
    if not store_alive:
        warnings.append(f"store node {store_node!r} is not a registered, alive worker: scale-ups of {package_id[:12]} "
                        f"that need it as their source are planned, but their receivers fetch nothing (retrying, with "
                        f"warnings) until an agent serving it registers as {store_node!r} at {store_address}")
    elif not holds:  # found in review: a store whose agent dropped its seed gave no sign of it
        warnings.append(f"store node {store_node!r} holds none of the blocks of {package_id[:12]} "
                        f"{wait_s:g} s after the publish: if its agent dropped them (`cp remove`, a release "
                        "from it) or seeds another package, scale-ups from it fetch nothing until an agent seeding the "
                        "package folder (`pipecast agent --seed`) serves it there")
    if before is not None and before != store_node:
        warnings.append(f"the package's store was {before!r}: it is {store_node!r} now ({before!r} may be released "
                        "from it, as any worker)")
    warning = "; ".join(warnings)
    if warning and not ctx.obj.as_json:  # with --json it is in the answer
        click.echo(f"warning: {warning}", err=True)
    _emit(ctx, {"package_id": package_id, **({"warning": warning} if warning else {})},
          [f"published {package_id} ({len(manifest.blocks)} blocks)"])


@cp_group.command("remove")
@click.argument("package_id")
@click.option("--force", is_flag=True,
              help="Also when workers besides its store hold it or plans use it: cancel its plans.")
@click.pass_context
def remove_command(ctx: click.Context, package_id: str, force: bool) -> None:
    """Remove a published package: its holders, its store too, are told to drop it."""
    package_id, _ = _run_for(ctx, package_id, lambda c, full: c.remove_package(full, force=force))
    _emit(ctx, {"removed": package_id}, [f"removed {package_id}"])


@cp_group.command("scale-up")
@click.argument("package_id")
@click.option("--worker", "workers", multiple=True, help="Target worker (repeat); or use --count.")
@click.option("--count", type=click.IntRange(1, MAX_COUNT), help="Bring the package onto this many more workers.")
@click.option("--strategy", default="", help="unicast, chain, tree, binomial or rotated (default: picked).")
@click.option("--fanout", type=click.IntRange(1, MAX_COUNT), default=None, help="Children per parent for tree.")
@click.pass_context
def scale_up_command(ctx: click.Context, package_id: str, workers: tuple[str, ...], count: int | None,
                     strategy: str, fanout: int | None) -> None:
    """Bring a package onto workers with a multicast plan."""
    if bool(workers) == bool(count):
        raise click.UsageError("give either --worker (one or more) or --count")
    if fanout is not None and strategy != "tree":  # else accepted and silently of no use
        raise click.UsageError("--fanout is for --strategy tree only")
    _, reply = _run_for(ctx, package_id, lambda c, full: c.scale_up(full, node_ids=workers, count=count or 0,
                                                                   strategy=strategy, fanout=fanout or 0))
    lines = [f"plan {reply.plan_id or '(none needed)'}: {reply.strategy or '-'} from {', '.join(reply.sources) or '-'} "
             f"to {len(reply.receivers)} workers"]
    if reply.unchanged:
        lines.append(f"already holding or receiving: {', '.join(reply.unchanged)}")
    _emit(ctx, _message_json(reply), lines)


@cp_group.command("release")
@click.argument("package_id")
@click.argument("workers", nargs=-1, required=True)
@click.option("--keep-alive", "keep_alive_s", type=Duration(maximum=MAX_DURATION_S), default=0.0,
              show_default=True,
              help="How long the workers stay sources before they drop the package, e.g. 5m (0: they drop it at "
                   "once).")
@click.pass_context
def release_command(ctx: click.Context, package_id: str, workers: tuple[str, ...], keep_alive_s: float) -> None:
    """Release a package from workers (scale-down)."""
    package_id, drop_at = _run_for(ctx, package_id, lambda c, full: c.release(full, workers, keep_alive_s=keep_alive_s))
    when = datetime.fromtimestamp(drop_at).isoformat(timespec="seconds")
    _emit(ctx, {"drop_at_unix": drop_at},
          [f"released {package_id} from {len(workers)} workers; they drop it at {when}"])


#: ``--warm auto``: the warm pool is sized from the traffic.
WARM_AUTO = "auto"


class WarmCount(click.ParamType):
    """A number of warm replicas, or ``auto``: sized from the traffic (a negative number is refused with the
    policy's other values, all named at once)."""

    name = "count|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | str:
        if isinstance(value, int) or value == WARM_AUTO:
            return value
        try:
            count = int(value)
        except ValueError:
            self.fail(f"{value!r} is neither a number of replicas nor {WARM_AUTO!r}", param, ctx)
        return count


DEFAULT_POLICY = ScalingPolicy()
#: The flag of ``cp deploy`` that sets each ScalingPolicy field: a refusal names what the operator typed.
DEPLOY_FLAGS = {"min_replicas": "--min", "max_replicas": "--max", "slo_ttft_p99_s": "--slo-ttft-p99", "warm": "--warm",
                "warm_auto_factor": "--warm-factor", "keep_alive_s": "--keep-alive",
                "scale_up_cooldown_s": "--scale-up-cooldown", "scale_down_cooldown_s": "--scale-down-cooldown",
                "replica_rps": "--replica-rps", "replica_concurrency": "--replica-concurrency",
                "cold_start_s": "--cold-start", "cold_start_measured": "--measure-cold-start"}


@cp_group.command("deploy")
@click.argument("package_id")
@click.option("--min", "min_replicas", type=int, default=DEFAULT_POLICY.min_replicas,
              show_default=True, help="Replicas kept loaded with no traffic (0: scale to zero).")
@click.option("--max", "max_replicas", type=int, default=DEFAULT_POLICY.max_replicas,
              show_default=True, help="Most replicas.")
@click.option("--slo-ttft-p99", type=Duration(), default=DEFAULT_POLICY.slo_ttft_p99_s, show_default=True,
              help="p99 time to first token to hold, e.g. 2s.")
@click.option("--warm", type=WarmCount(), default=DEFAULT_POLICY.warm, show_default=True,
              help="Idle replicas kept loaded beyond what the load needs, or 'auto': enough to absorb "
                   "--warm-factor times the baseline demand.")
@click.option("--warm-factor", type=float, default=DEFAULT_WARM_AUTO_FACTOR, show_default=True,
              help="With --warm auto: the warm pool absorbs this many times the baseline demand (1..10).")
@click.option("--keep-alive", type=Duration(), default=DEFAULT_POLICY.keep_alive_s, show_default=True,
              help="A replica idle this long may be released.")
@click.option("--scale-up-cooldown", type=Duration(), default=DEFAULT_POLICY.scale_up_cooldown_s, show_default=True,
              help="After a scale-up, none again this long unless the rate grew or the SLO is missed.")
@click.option("--scale-down-cooldown", type=Duration(), default=DEFAULT_POLICY.scale_down_cooldown_s,
              show_default=True, help="After a scale-up, no release this long.")
@click.option("--replica-rps", type=float, default=DEFAULT_POLICY.replica_rps, show_default=True,
              help="Requests/s one replica serves, until the scaler has measured it.")
@click.option("--replica-concurrency", type=int, default=DEFAULT_POLICY.replica_concurrency,
              show_default=True, help="Requests one replica runs at once (its batch).")
@click.option("--cold-start", type=Duration(), default=DEFAULT_POLICY.cold_start_s, show_default=True,
              help="How long a new replica takes to serve (about S/B; 0: not counted): a scale-up then also drains "
                   "what arrives meanwhile within the SLO or the cold start, the longer, and adds none for requests "
                   "that wait no longer than it behind those at the ready replicas.")
@click.option("--measure-cold-start", "cold_start_measured", is_flag=True, default=False,
              help="Size for the cold starts the scaler measures on this deployment's scale-ups once it has one "
                   "(--cold-start until then).")
@click.option("--router", "routers", multiple=True, metavar="URL",
              help="Base URL of a router whose /stats feed the scaler, e.g. http://host:8080, not its /v1 "
                   "(repeat for several).")
@click.option("--priority", type=click.Choice(PRIORITIES), default=DEFAULT_PRIORITY, show_default=True,
              help="The package's priority: its multicast takes the share of each link the agents' "
                   "priority_shares give it (else their multicast_share).")
@click.pass_context
def deploy_command(ctx: click.Context, package_id: str, routers: tuple[str, ...], priority: str,
                   **policy: Any) -> None:
    """Create or replace the deployment of a published package: the policy `pipecast scaler` keeps it by."""
    policy["slo_ttft_p99_s"] = policy.pop("slo_ttft_p99")
    policy["keep_alive_s"] = policy.pop("keep_alive")
    policy["scale_up_cooldown_s"] = policy.pop("scale_up_cooldown")
    policy["scale_down_cooldown_s"] = policy.pop("scale_down_cooldown")
    policy["cold_start_s"] = policy.pop("cold_start")
    warm, factor = policy.pop("warm"), policy.pop("warm_factor")
    if warm == WARM_AUTO:
        policy["warm_auto_factor"] = factor
    elif ctx.get_parameter_source("warm_factor") is not ParameterSource.DEFAULT:
        raise click.BadParameter("is used only with --warm auto", param_hint="'--warm-factor'")
    else:
        policy["warm"] = warm
    wanted = Deployment(package_id, ScalingPolicy(**policy), routers, priority=priority)
    # Checked here too, as the control plane would, to name the flags typed (it names the fields) and every bad
    # value at once (click stops at its first).
    problems = [f"{'/'.join(DEPLOY_FLAGS[f] for f in fields)}: {message}"
                for fields, message in wanted.policy.problems_by_field()]
    if warm == WARM_AUTO and factor == 0:  # the policy takes 0 as "warm fixed": a fixed warm pool of 0, not auto
        low, high = WARM_AUTO_FACTORS
        problems.append(f"--warm-factor: warm_auto_factor must be within {low:g}..{high:g} with --warm auto, "
                        f"got {factor}")
    if problems:
        raise InvalidRequest(f"deployment of package {package_id!r} refused: {'; '.join(problems)}")
    _, stored = _run_for(ctx, package_id,
                         lambda c, full: c.put_deployment(dataclasses.replace(wanted, package_id=full)))
    warning = "" if stored.routers else (
        "no --router: the scaling daemon reads no signals for this deployment and holds its pool (raised to --min); a "
        "deployment is replaced whole, so give every --router again with each change")
    if warning and not ctx.obj.as_json:  # with --json it is in the answer, as publish's
        click.echo(f"warning: {warning}", err=True)
    _emit(ctx, {**stored.to_json(), **({"warning": warning} if warning else {})},
          [f"deployed {stored.package_id}: {_describe_policy(stored.policy)}; priority {stored.priority}; routers "
           f"{', '.join(stored.routers) or '-'}"])


def _describe_policy(p: ScalingPolicy) -> str:
    warm = f"auto ({p.warm_auto_factor}x baseline)" if p.warm_auto_factor else p.warm
    return (f"replicas {p.min_replicas}..{p.max_replicas}, warm {warm}, p99 TTFT SLO {p.slo_ttft_p99_s:g} s, "
            f"keep-alive {p.keep_alive_s:g} s, cooldowns up {p.scale_up_cooldown_s:g} s / down "
            f"{p.scale_down_cooldown_s:g} s, {p.replica_rps:g} req/s and {p.replica_concurrency} at once per replica"
            + (f", cold start {p.cold_start_s:g} s" if p.cold_start_s else "")
            + (", cold start measured" if p.cold_start_measured else ""))


@cp_group.command("deployments")
@click.pass_context
def deployments_command(ctx: click.Context) -> None:
    """List deployments and their policies."""
    deployments = _run(ctx, lambda c: c.list_deployments())
    lines = [f"{d.package_id[:20]:<20} {_describe_policy(d.policy)}; priority {d.priority}; routers "
             f"{', '.join(d.routers) or '-'}" for d in deployments] or ["no deployments"]
    _emit(ctx, [d.to_json() for d in deployments], lines)


@cp_group.command("undeploy")
@click.argument("package_id")
@click.pass_context
def undeploy_command(ctx: click.Context, package_id: str) -> None:
    """Remove a package's deployment (its replicas stay until released; the scaler stops scaling it)."""
    package_id, _ = _run_for(ctx, package_id, lambda c, full: c.remove_deployment(full))
    _emit(ctx, {"undeployed": package_id}, [f"undeployed {package_id}"])


DEFAULT_GATE = CanaryGate()
#: The most control.proto carries in a count (uint32).
UINT32_MAX = 2**32 - 1


def _gate_options(command: Callable) -> Callable:
    """The automatic canary gate's options (``pipecast cp route`` and ``canary``)."""
    for decorator in reversed((
            click.option("--gate/--no-gate", "gate", default=None,
                         help="Let `pipecast scaler` roll canaries back on their own (default: keep the route's "
                              "setting; a new route has none)."),
            click.option("--gate-ttft-margin", type=Number(min=0), default=DEFAULT_GATE.ttft_p95_margin,
                         show_default=True, help="Roll back when the canary's p95 TTFT exceeds the stable "
                                                 "version's by this fraction (0.5: 50%)."),
            click.option("--gate-error-margin", type=Number(min=0), default=DEFAULT_GATE.error_rate_margin,
                         show_default=True, help="Roll back when the canary's error rate exceeds the stable "
                                                 "version's by this much (0.05: 5 points)."),
            click.option("--gate-min-requests", type=click.IntRange(1, UINT32_MAX), default=DEFAULT_GATE.min_requests,
                         show_default=True, help="Judge only once each version served this many requests."))):
        command = decorator(command)
    return command


def _gate(ctx: click.Context, gate: bool | None, ttft_margin: float, error_margin: float,
          min_requests: int) -> dict[str, Any]:
    """The gate fields of a :class:`RouteChange`: keep the route's (None), set one, or remove it."""
    if not gate:  # else accepted and silently of no use
        for name in ("gate_ttft_margin", "gate_error_margin", "gate_min_requests"):
            if ctx.get_parameter_source(name) is not ParameterSource.DEFAULT:
                raise click.BadParameter("is used only with --gate", param_hint=f"'--{name.replace('_', '-')}'")
    if gate is None:
        return {}
    return {"gate": CanaryGate(ttft_margin, error_margin, min_requests)} if gate else {"no_gate": True}


def _change_route(ctx: click.Context, change: RouteChange) -> None:
    _, route = _run_for(ctx, change.package_id,
                        lambda c, full: c.change_route(dataclasses.replace(change, package_id=full)))
    _emit(ctx, route.to_json() if route else {"unrouted": change.name}, [describe_route(route, change.name)])


@cp_group.command("route")
@click.argument("name")
@click.argument("package_id")
@_gate_options
@click.pass_context
def route_command(ctx: click.Context, name: str, package_id: str, gate: bool | None, gate_ttft_margin: float,
                  gate_error_margin: float, gate_min_requests: int) -> None:
    """Serve model NAME (what clients send as "model") with PACKAGE_ID, all of its requests: create the route
    or switch its stable version (refused while canaries run). Its workers must serve the name
    (`pipecast serve --served-model-name NAME`)."""
    _change_route(ctx, RouteChange(name, "route", package_id,
                                   **_gate(ctx, gate, gate_ttft_margin, gate_error_margin, gate_min_requests)))


@cp_group.command("canary")
@click.argument("name")
@click.argument("package_id")
@click.option("--weight", type=click.IntRange(1, 99), required=True, help="Percent of NAME's requests (1..99).")
@_gate_options
@click.pass_context
def canary_command(ctx: click.Context, name: str, package_id: str, weight: int, gate: bool | None,
                   gate_ttft_margin: float, gate_error_margin: float, gate_min_requests: int) -> None:
    """Send WEIGHT percent of NAME's requests to PACKAGE_ID, a canary beside the stable version (again: a new
    weight). With --gate, `pipecast scaler` rolls it back when it does worse than the stable version."""
    _change_route(ctx, RouteChange(name, "canary", package_id, weight,
                                   **_gate(ctx, gate, gate_ttft_margin, gate_error_margin, gate_min_requests)))


@cp_group.command("promote")
@click.argument("name")
@click.argument("package_id", required=False, default="")
@click.pass_context
def promote_command(ctx: click.Context, name: str, package_id: str) -> None:
    """Make NAME's canary (PACKAGE_ID, optional with one canary) its stable version, with every request."""
    _change_route(ctx, RouteChange(name, "promote", package_id))


@cp_group.command("rollback")
@click.argument("name")
@click.argument("package_id", required=False, default="")
@click.pass_context
def rollback_command(ctx: click.Context, name: str, package_id: str) -> None:
    """Take NAME's canary PACKAGE_ID (default: every canary) out of its route: the stable version gets its share."""
    _change_route(ctx, RouteChange(name, "rollback", package_id))


@cp_group.command("unroute")
@click.argument("name")
@click.pass_context
def unroute_command(ctx: click.Context, name: str) -> None:
    """Remove NAME's route (routers then send its requests to any worker that serves the name)."""
    _change_route(ctx, RouteChange(name, "unroute"))


@cp_group.command("routes")
@click.pass_context
def routes_command(ctx: click.Context) -> None:
    """List served model names, their versions and weights."""
    routes = _run(ctx, lambda c: c.list_routes())
    lines = [describe_route(r, r.name) + (" (gated)" if r.gate else "") for r in routes] or ["no routes"]
    _emit(ctx, [r.to_json() for r in routes], lines)


@cp_group.command("serving-key")
@click.pass_context
def serving_key_command(ctx: click.Context) -> None:
    """Print the cluster's serving key (hex; empty with auth off), which the router's /stats, /v1/workers and
    /metrics ask for in the X-Pipecast-Serving-Key header: e.g. curl -H "X-Pipecast-Serving-Key: $(pipecast cp
    serving-key)"."""
    key = _run(ctx, lambda c: c.list_workers_keyed())[1]
    _emit(ctx, {"serving_key": key.hex()}, [key.hex()])


@cp_group.command("issue-token")
@click.argument("node_id")
@click.pass_context
def issue_token_command(ctx: click.Context, node_id: str) -> None:
    """Print a node token for NODE_ID (needs the master token): give it to that node's agent as its
    auth_token; it may then register, report and watch only as NODE_ID."""
    token = _run(ctx, lambda c: c.issue_token(node_id))
    _emit(ctx, {"node_id": node_id, "token": token}, [token])


@cp_group.command("revoke-node")
@click.argument("node_id", required=False, default="")
@click.option("--restore", is_flag=True, help="Admit NODE_ID's token again instead.")
@click.pass_context
def revoke_node_command(ctx: click.Context, node_id: str, restore: bool) -> None:
    """Revoke NODE_ID's token (needs the master token): every call with it is refused from then on, and the node
    leaves every plan (a package whose store it is has none until published with another). Its agent exits; a
    machine that replaces it registers under another node id. The data-plane and serving keys the node was given
    stay valid until the master token is changed. Without NODE_ID: list the nodes revoked."""
    if restore and not node_id:
        raise click.UsageError("--restore needs the NODE_ID to admit again")
    revoked, changed = _run(ctx, lambda c: c.revoke_node(node_id, restore=restore))
    done = "admitted again" if restore else "revoked"
    said = f"node {node_id}: token {done if changed else ('was not revoked' if restore else 'was revoked already')}; "
    _emit(ctx, {"node_id": node_id, "restored": restore, "changed": changed, "revoked": revoked},
          [f"{said if node_id else ''}revoked now: {', '.join(revoked) or '-'}"])

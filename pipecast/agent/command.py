"""``pipecast agent``: run the node agent (data plane) in the foreground until SIGTERM, SIGINT or SIGHUP."""

import asyncio
import functools
import math
import socket
import time
from pathlib import Path

import click

from packager.manifest import HEX_DIGEST
from pipecast.agent.daemon import AgentDaemon, AgentOptions
from pipecast.agent.errors import PlanFileError
from pipecast.agent.fetcher import FetchPolicy
from pipecast.agent.ratelimit import DataPlaneCaps
from pipecast.agent.transport.base import split_address
from pipecast.agent.transport.registry import transport_names
from pipecast.core.allocator import keep_freed_memory
from pipecast.core.clitypes import Number, SettingPath
from pipecast.core.engines import SERVING_ENGINES
from pipecast.core.settings import configured_control_plane, load_settings
from pipecast.core.units import parse_size


def _size(ctx: click.Context, param: click.Parameter, value: str | None, allow_zero: bool = False) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value, allow_zero=allow_zero)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _address(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    try:
        for address in value.split(","):  # the control plane's replicas, comma-separated
            split_address(address.strip())
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


def _listen_address(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    # One address: split_address alone would take "a:1,b" for the host of "a:1,b:2".
    if value is not None and "," in value:
        raise click.BadParameter(f"one host:port address to listen on, not a list: {value!r}")
    return _address(ctx, param, value)


def _events_file(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    # Opened as the agent will, now: a file it cannot append to (its folder missing, say) is a mistake to name here,
    # not a traceback once the agent starts.
    if value is not None:
        try:
            value.open("a").close()
        except OSError as exc:
            raise click.BadParameter(f"cannot append to {value}: {exc.strerror}") from None
    return value


def _labels(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    labels = {}
    for value in values:
        key, sep, label = value.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"expected KEY=VALUE, got {value!r}")
        labels[key.strip()] = label.strip()
    return labels


#: Furthest ahead a --start-at may lie (s): a later one is a mistake (milliseconds given for seconds), not a wait.
MAX_START_AHEAD_S = 86400.0


def _start_at(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is None:
        return None
    if not math.isfinite(value) or value - time.time() > MAX_START_AHEAD_S:
        raise click.BadParameter(f"{value!r} is no time within a day from now in seconds since the epoch (now: "
                                 f"{time.time():.0f})")
    return value


def _priority_shares(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, float]:
    shares = {}
    for value in _labels(ctx, param, values).items():
        priority, share = value
        try:
            shares[priority] = float(share)
        except ValueError:
            raise click.BadParameter(f"expected PRIORITY=SHARE with a number, got {priority}={share!r}") from None
    return shares


@click.command("agent")
@click.option("--listen", metavar="HOST:PORT", callback=_listen_address,
              help="Where peers connect (port 0: any free port, which needs --node-id under a control plane). "
                   "Default: this node's address in --plan, else PIPECAST_AGENT_HOST:PIPECAST_AGENT_PORT.")
@click.option("--node-id", help="This node's id (as named in --plan). Default: hostname:port (under a control "
                                "plane, given where --listen's port is 0).")
@click.option("--seed", "seed", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Serve this package folder (verified on start).")
@click.option("--plan", "plan", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Static plan file: fetch this node's assignments, falling back to the plan's sources.")
@click.option("--cache-dir", type=SettingPath(file_okay=False, path_type=Path),
              help="Disk cache of verified blocks, served again after a restart.")
@click.option("--memory", callback=_size, metavar="SIZE",
              help="Host memory budget for received blocks, e.g. 16GiB (a package that does not fit is refused).")
# 0 is "no reserve", as the setting's default says (and overrides a reserve set in the environment)
@click.option("--reserve", callback=functools.partial(_size, allow_zero=True), metavar="SIZE",
              help="Host memory to populate at start and hand over to received blocks, e.g. 1GiB (0: none): on a VM "
                   "that backs its memory lazily a surge's blocks then take pages already backed (settings: "
                   "agent_reserve_bytes).")
@click.option("--transport", type=click.Choice(transport_names()), help="Data transport (default: auto).")
@click.option("--local-socket", type=SettingPath(dir_okay=False, path_type=Path),
              help="Unix socket of the local API for engines on this node.")
@click.option("--events", type=click.Path(dir_okay=False, path_type=Path), callback=_events_file,
              help="Append a JSON line per event (block started/verified, peer requests and failures, "
                   "assignments) to this file.")
@click.option("--exit-when-complete", is_flag=True,
              help="Exit once this node holds its assigned blocks and every child the plan gives it has come "
                   "and gone (without --plan: once no peer has been connected for a moment); children that have "
                   "not come when no peer has been connected for agent_idle_timeout_s are named and given up.")
@click.option("--control-plane", "control_plane", metavar="HOST:PORT", callback=_address,
              help="Register with this control plane and fetch what its assignments say (settings: control_plane, "
                   "where set, unless --plan or --exit-when-complete; token and TLS: auth_token, tls_*).")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE", callback=_labels,
              help="Topology label to register with, e.g. rack=r1 (repeat; added to settings agent_labels).")
@click.option("--serve-url", metavar="URL",
              help="HTTP base URL of this node's serving worker, registered for the router (settings: "
                   "agent_serve_url).")
@click.option("--engine", type=click.Choice(SERVING_ENGINES),
              help="What answers at --serve-url: pipecast's serving worker, or vLLM with pipecast's loader "
                   "(settings: agent_engine).")
@click.option("--serve-package", metavar="PACKAGE_ID",
              help="The package id the worker at --serve-url serves (its `pipecast serve PACKAGE_ID`, or the package "
                   "folder `vllm serve` loads): a deployment's scale-ups place its package only on nodes whose worker "
                   "serves it or that name none (settings: agent_serve_package).")
@click.option("--link-mbit", type=Number(min=0), metavar="MBIT",
              help="This node's link rate, Mbit/s, that --multicast-share is a share of and the control plane judges "
                   "stragglers by (settings: agent_link_mbit).")
@click.option("--multicast-share", type=Number(min=0, max=1, min_open=True), metavar="SHARE",
              help="Largest share of the link, in (0, 1], the data plane takes each direction, so that serving "
                   "traffic on the same link keeps its latency; below 1 needs --link-mbit (settings: "
                   "multicast_share).")
@click.option("--priority-share", "priority_shares", multiple=True, metavar="PRIORITY=SHARE",
              callback=_priority_shares,
              help="A share of the link for the packages of one priority (high, normal, low; a deployment's "
                   "--priority), e.g. low=0.25 (repeat; given, replaces settings priority_shares; below 1 needs "
                   "--link-mbit).")
@click.option("--start-at", type=float, metavar="EPOCH_SECONDS", callback=_start_at,
              help="Listen at once but begin fetching at this wall-clock time (seconds since the epoch), so "
                   "that agents started one after another fetch together (benchmarks).")
def agent_command(listen: str | None, node_id: str | None, seed: Path | None, plan: Path | None,
                  cache_dir: Path | None, memory: int | None, reserve: int | None, transport: str | None,
                  local_socket: Path | None, events: Path | None, exit_when_complete: bool, control_plane: str | None,
                  labels: dict[str, str],
                  serve_url: str | None, engine: str | None, serve_package: str | None, link_mbit: float | None,
                  multicast_share: float | None,
                  priority_shares: dict[str, float], start_at: float | None) -> None:
    """Run the node agent: serve blocks to peers, fetch this node's share, feed local engines.

    Peers authenticate each other with a data-plane key: under --control-plane it comes with the
    registration; without one it derives from the cluster's master token (settings auth_token,
    PIPECAST_AUTH_TOKEN), which every agent of a static plan is given. Without credentials the data plane
    is open, and the agent says so."""
    if control_plane is not None and (plan is not None or exit_when_complete):
        raise click.UsageError("--control-plane decides what this node fetches: it goes with neither --plan nor "
                               "--exit-when-complete")
    settings = load_settings(agent_cache_dir=cache_dir, agent_memory_bytes=memory, agent_reserve_bytes=reserve,
                             agent_transport=transport,
                             agent_local_socket=local_socket, agent_node_id=node_id, agent_serve_url=serve_url,
                             agent_engine=engine, agent_serve_package=serve_package,
                             agent_link_mbit=link_mbit, multicast_share=multicast_share,
                             priority_shares=priority_shares or None)
    if control_plane is None and plan is None and not exit_when_complete:
        control_plane = configured_control_plane(settings)  # PIPECAST_CONTROL_PLANE or the config file
    DataPlaneCaps.of(settings)  # refuse a share without the link rate now, not after verifying a seed
    cache = settings.agent_cache_dir
    if cache is not None and cache.exists() and not cache.is_dir():  # --cache-dir's own check, for the setting
        raise click.BadParameter(f"{str(cache)!r} is not a folder",
                                 param_hint="'--cache-dir' (setting agent_cache_dir)")
    local_socket = settings.agent_local_socket
    if local_socket is not None and not local_socket.parent.is_dir():  # refused now, not after a seed's verifying
        why = "is not a folder" if local_socket.parent.exists() else "does not exist"
        raise click.BadParameter(f"the folder of {str(local_socket)!r}, {str(local_socket.parent)!r}, {why}",
                                 param_hint="'--local-socket' (setting agent_local_socket)")
    if settings.agent_serve_package and not HEX_DIGEST.fullmatch(settings.agent_serve_package):
        raise click.BadParameter(f"{settings.agent_serve_package!r} is not a whole package id (64 lowercase hex "
                                 "digits, as `pipecast cp publish` prints it)",
                                 param_hint="'--serve-package' (setting agent_serve_package)")
    if settings.agent_serve_package and not settings.agent_serve_url:
        raise click.UsageError("--serve-package names what the serving worker at --serve-url serves: it needs "
                               "--serve-url (setting agent_serve_url)")
    if plan is not None and not settings.agent_node_id:
        raise PlanFileError(f"{plan}: --node-id is needed to know which of the plan's nodes this agent is")
    policy = FetchPolicy(concurrency=settings.agent_fetch_concurrency, retries=settings.agent_fetch_retries,
                         backoff_s=settings.agent_fetch_backoff_s)
    port = split_address(listen)[1] if listen else settings.agent_port
    if control_plane is not None and port == 0 and not settings.agent_node_id:
        # The port is picked only once listening: every such agent on this host would register as hostname:0.
        raise click.UsageError("--listen HOST:0 (any free port) under a control plane needs --node-id: the default "
                               "node id, hostname:port, would be hostname:0 for every such agent on this host")
    options = AgentOptions(node_id=settings.agent_node_id or f"{socket.gethostname()}:{port}", listen=listen,
                           seed=seed, plan=plan, events=events, exit_when_complete=exit_when_complete,
                           start_at=start_at, policy=policy, control_plane=control_plane,
                           labels={**settings.agent_labels, **labels}, serve_url=settings.agent_serve_url,
                           engine=settings.agent_engine, serve_package=settings.agent_serve_package,
                           announce=click.echo)
    keep_freed_memory()  # send buffers churn by megabytes: reuse their memory (pipecast.core.allocator)
    asyncio.run(AgentDaemon(options, settings).run())

"""``pipecast scaler``: ``run`` the scaling daemon until SIGTERM, SIGINT or SIGHUP; ``events`` prints its
audit trail."""

import asyncio
import json
import logging
from datetime import datetime
from pathlib import Path

import click

from control_plane.command import CONFIG, TOKEN, TOKEN_FILE, UINT32_MAX, Duration, full_package_id, given_token
from control_plane.deployments import MAX_DURATION_S
from control_plane.planner.plan import STRATEGIES
from pipecast.core.credentials import parse_node_token
from pipecast.core.settings import Settings, load_settings
from pipecast.scaler.daemon import ScalerConfig

log = logging.getLogger(__name__)
DEFAULTS = ScalerConfig()


@click.group("scaler")
def scaler_group() -> None:
    """The scaling daemon: keeps every deployment (`pipecast cp deploy`) at its SLO."""


@scaler_group.command("run")
@CONFIG
@click.option("--control-plane", help="host:port of the control plane (settings: control_plane).")
@click.option("--tick", "tick_s", type=Duration(positive=True), default=DEFAULTS.tick_s, show_default=True,
              help="How often every deployment is looked at (more than 0).")
@click.option("--watch", "watch_s", type=Duration(), default=DEFAULTS.watch_s, show_default=True,
              help="Between ticks, how often the routers of deployments idle at zero replicas are polled, "
                   "to scale from zero at a request's arrival (0: only at ticks).")
@click.option("--router-timeout", "router_timeout_s", type=Duration(positive=True),
              default=DEFAULTS.router_timeout_s, show_default=True,
              help="Deadline of one router's /stats (more than 0).")
@click.option("--plan-strategy", type=click.Choice(("", *STRATEGIES)), default=DEFAULTS.plan_strategy,
              metavar="STRATEGY", help=f"Plan strategy of the scale-ups, one of {', '.join(STRATEGIES)} (unicast: each "
                                       "from the store); unset or '': the control plane picks.")
@click.option("--source-keep", "source_keep_s", type=Duration(maximum=MAX_DURATION_S), default=DEFAULTS.source_keep_s,
              show_default=True,
              help="A released replica stays a multicast source this long before it drops the package.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address of /metrics and /health.")
@click.option("--port", type=click.IntRange(0, 65535), default=None,
              help="Port of /metrics and /health (0: any free port; unset: none).")
def run_command(config: Path | None, control_plane: str | None, tick_s: float, watch_s: float,
                router_timeout_s: float, plan_strategy: str, source_keep_s: float, host: str,
                port: int | None) -> None:
    """Run the scaling daemon (one per cluster; it keeps no state: restart it any time)."""
    settings = load_settings(config, control_plane=control_plane)
    node = parse_node_token(settings.auth_token)
    if node is not None:  # it ran, /health ok, and failed only at its first action, every tick from then on
        raise click.UsageError(f"auth_token is node {node[0]!r}'s token: the scaling daemon acts as the operator and "
                               "needs the cluster's master token")
    scaler_config = ScalerConfig(tick_s=tick_s, watch_s=watch_s, router_timeout_s=router_timeout_s,
                                 plan_strategy=plan_strategy, source_keep_s=source_keep_s)
    asyncio.run(_run(settings, scaler_config, host, port))


async def _run(settings: Settings, config: ScalerConfig, host: str, port: int | None) -> None:
    """Run the daemon until SIGTERM, SIGINT or SIGHUP, serving /metrics and /health on ``port`` (None: none). An error
    that ends its loop ends it too, raised: the process exits non-zero (its supervisor restarts it), not on with
    /health ok and no pool scaled."""
    from control_plane.client import ControlPlaneClient
    from pipecast.core.httpserve import listening
    from pipecast.core.signals import on_stop_signals
    from pipecast.scaler.daemon import Scaler

    async with ControlPlaneClient.from_settings(settings) as client, Scaler(client, config) as scaler:
        stop = asyncio.Event()
        on_stop_signals(asyncio.get_running_loop(), stop.set)
        log.info("scaler: control plane %s, tick %g s, plan strategy %s", settings.control_plane, config.tick_s,
                 config.plan_strategy or "(control plane's choice)")
        task = asyncio.create_task(scaler.run(stop), name="scaler")
        if port is None:
            await task
            return
        async with listening(_app(scaler, task), host, port, shutdown_timeout=0.0) as url:
            click.echo(f"scaler metrics on {url}", err=True)
            await task


def _app(scaler, task: asyncio.Task):
    """The daemon's /metrics, and its /health: 503 once the ``task`` of its loop has ended (stopped, or
    failed)."""
    from aiohttp import web

    async def metrics(request: web.Request) -> web.Response:
        body, content_type = scaler.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def health(request: web.Request) -> web.Response:
        if task.done():
            error = None if task.cancelled() else task.exception()
            return web.json_response({"status": "failed" if error else "stopped",
                                      "error": f"{type(error).__name__}: {error}" if error else None}, status=503)
        # Still 200: a restart mends no control-plane outage; the status and the metrics say it, for alerts.
        status = "degraded" if scaler.failed_ticks else "ok"
        return web.json_response({"status": status, "failed_ticks": scaler.failed_ticks,
                                  "deployments": sorted(scaler.tracked)})

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics), web.get("/health", health)])
    return app


@scaler_group.command("events")
@CONFIG
@click.option("--control-plane", help="host:port of the control plane (settings: control_plane).")
@TOKEN
@TOKEN_FILE
@click.option("--package", "package_id", default="",
              help="Only this deployment's events (its id, or the start of it as the listings print it).")
@click.option("--limit", type=click.IntRange(1, UINT32_MAX), default=100, show_default=True,
              help="The latest this many.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines.")
def events_command(config: Path | None, control_plane: str | None, token: str | None, token_file: Path | None,
                   package_id: str, limit: int, as_json: bool) -> None:
    """Print the scaling daemon's decisions (kept by the control plane), oldest first."""
    from control_plane.client import ControlPlaneClient

    settings = load_settings(config, control_plane=control_plane, auth_token=given_token(token, token_file))

    async def fetch():
        async with ControlPlaneClient.from_settings(settings) as client:
            return await client.list_scale_events(await full_package_id(client, package_id), limit=limit)

    for event in asyncio.run(fetch()):
        if as_json:
            click.echo(json.dumps(event.to_json(), sort_keys=True))
            continue
        when = datetime.fromtimestamp(event.at).isoformat(timespec="milliseconds")
        nodes = f" [{','.join(event.node_ids)}]" if event.node_ids else ""
        click.echo(f"{event.seq:>6} {when} {event.package_id[:12]} {event.action:<8} {event.count:>2}{nodes} "
                   f"desired {event.desired} actual {event.actual}: {event.reason}")

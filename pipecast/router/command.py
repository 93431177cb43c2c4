"""The ``pipecast router`` command: run the request router until SIGTERM, SIGINT or SIGHUP."""

import asyncio
from collections.abc import Callable
from contextlib import AsyncExitStack

import click

from pipecast.core.clitypes import Number
from pipecast.core.credentials import check_master_token, data_plane_key, parse_node_token, serving_key
from pipecast.core.httpserve import RUNNER_OPTIONS, listening, serve_until_signalled
from pipecast.core.settings import (MIN_TENANT_RATE, Settings, TenantLimit, configured_control_plane,
                                    load_settings)
from pipecast.router.admission import AdmissionConfig
from pipecast.router.app import Router, RouterConfig, build_app, build_metrics_app
from pipecast.router.discovery import ControlPlaneDiscovery, Discovery, StaticDiscovery
from pipecast.router.errors import WorkerUrlError

DEFAULTS = RouterConfig()
TENANT_LIMIT_FORM = "NAME=RATE:BURST"


def parse_tenant_limits(ctx: click.Context, param: click.Parameter,
                        values: tuple[str, ...]) -> dict[str, TenantLimit]:
    """The ``--tenant-limit NAME=RATE:BURST`` values as tenant -> limit (a later one for a name wins)."""
    limits: dict[str, TenantLimit] = {}
    for value in values:
        name, equals, spec = value.partition("=")
        rate, colon, burst = spec.partition(":")
        try:
            if not (name and equals and colon):
                raise ValueError(value)
            limits[name] = TenantLimit(rate=float(rate), burst=int(burst))
        except ValueError:  # pydantic's ValidationError is one
            raise click.BadParameter(f"{value!r} is not {TENANT_LIMIT_FORM} with RATE >= {MIN_TENANT_RATE:.3g} "
                                     "requests/s (one a day) and BURST >= 1 requests, e.g. team-a=5:10") from None
    return limits


def admission_config(settings: Settings, tenant_limits: dict[str, TenantLimit]) -> AdmissionConfig:
    """The router's admission: the settings' tenants and limits, ``tenant_limits`` (the command line)
    added to the settings' limits or replacing them tenant by tenant."""
    return AdmissionConfig(limits=settings.router_tenant_limits | tenant_limits,
                           default_limit=settings.router_default_tenant_limit,
                           api_keys=settings.router_api_keys, tenant_header=settings.router_tenant_header)


async def run_router(router: Router, host: str, port: int, drain_timeout_s: float,
                     announce: Callable[[str], None]) -> None:
    """Serve ``router`` on host:port (port 0: any free port) until SIGTERM, SIGINT or SIGHUP.

    ``announce`` gets the bound base URL once the router listens. On a signal the router stops
    listening, fails its queued requests (503) and gives requests already at a worker ``drain_timeout_s``
    to finish before closing.
    """
    await serve_until_signalled(build_app(router), host, port, drain_timeout_s, announce, **RUNNER_OPTIONS)


@click.command("router")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True,
              help="Port to listen on (0: any free port, printed at start).")
@click.option("--metrics-port", type=click.IntRange(0, 65535),
              help="Also serve /metrics alone on this port, to anyone (0: any free port; settings: "
                   "router_metrics_port, also from PIPECAST_ROUTER_METRICS_PORT or the config file; unset: off). With "
                   "an auth_token the main port's /metrics answers only the serving key: expose this port to "
                   "Prometheus, inside the cluster only.")
@click.option("--worker", "workers", multiple=True, metavar="URL",
              help="Base URL of a serving worker, e.g. http://10.0.0.5:8000 (repeatable).")
@click.option("--vllm-worker", "vllm_workers", multiple=True, metavar="URL",
              help="Base URL of a vLLM worker (`vllm serve PACKAGE --load-format pipecast`): its /health, "
                   "/metrics and /v1/models are polled (repeatable).")
@click.option("--control-plane", metavar="HOST:PORT",
              help="Also learn workers from this control plane (settings: control_plane, where set).")
@click.option("--max-queue", type=click.IntRange(min=1), default=DEFAULTS.max_queue, show_default=True,
              help="Requests that may wait for a worker; beyond it the router answers 429.")
@click.option("--queue-timeout", type=Number(min=0, min_open=True),
              default=DEFAULTS.queue_timeout_s, show_default=True,
              help="Seconds a request may wait for a worker before a 503.")
@click.option("--health-interval", type=Number(min=0.01), default=DEFAULTS.health_interval_s,
              show_default=True, help="Seconds between two health polls of a worker.")
@click.option("--health-timeout", type=Number(min=0, min_open=True),
              default=DEFAULTS.health_timeout_s, show_default=True,
              help="Seconds a health poll may take; a slower worker counts as down.")
@click.option("--upstream-timeout", type=Number(min=0, min_open=True),
              default=DEFAULTS.upstream_timeout_s, show_default=True,
              help="Longest silence from a worker before its answer or between two chunks of it, longest it may "
                   "take to read each 256 KiB of a request's body, and longest a client may take to send its "
                   "whole request body (else 408).")
@click.option("--max-retries", type=click.IntRange(min=0), default=DEFAULTS.max_retries, show_default=True,
              help="Other workers tried when one fails before answering.")
@click.option("--drain-timeout", type=Number(min=0), default=30.0, show_default=True,
              help="On SIGTERM, SIGINT or SIGHUP, seconds given to requests at workers to finish.")
@click.option("--forward-auth/--no-forward-auth", default=None,
              help="Pass clients' Authorization header on to the workers (settings: router_forward_auth; off "
                   "by default).")
@click.option("--discovery-interval", type=Number(min=0.05), default=DEFAULTS.discovery_interval_s,
              show_default=True, help="Seconds between two questions to the control plane for workers and "
                                      "pipelines.")
@click.option("--pipelines/--no-pipelines", default=True, show_default=True,
              help="Route to the cross-node pipelines the control plane forms while no worker holds the whole "
                   "model.")
@click.option("--pipeline-max-in-flight", type=click.IntRange(min=1), default=DEFAULTS.pipeline_max_in_flight,
              show_default=True, help="Requests at once on one pipeline.")
@click.option("--tenant-limit", "tenant_limits", multiple=True, metavar=TENANT_LIMIT_FORM,
              callback=parse_tenant_limits,
              help="Admit at most RATE requests/s of tenant NAME, BURST at once; beyond it 429 (repeatable; adds "
                   "to or overrides the settings' router_tenant_limits).")
def router_command(host, port, metrics_port, workers, vllm_workers, control_plane, max_queue, queue_timeout,
                   health_interval, health_timeout, upstream_timeout, max_retries, drain_timeout, forward_auth,
                   discovery_interval, pipelines, pipeline_max_in_flight, tenant_limits):
    """Route OpenAI-style completion requests to the least-loaded serving worker.

    Workers come from --worker (and --vllm-worker) URLs and/or the control plane; a worker serves once its /health says
    ready or partial (a vLLM worker: once it answers). With a control plane, groups of workers that together hold every
    layer serve as pipelines until each holds the model. Requests wait in the router while nothing can take them.

    Tenants: API keys (router_api_keys: key -> tenant) are read only from the config file or
    PIPECAST_ROUTER_API_KEYS, never from the command line, where other users of the host could read
    them; without keys a request's tenant is its router_tenant_header header. Limits per tenant:
    router_tenant_limits, router_default_tenant_limit and --tenant-limit.

    With an auth_token, /stats, /v1/workers and /metrics answer only requests presenting the cluster's serving
    key (X-Pipecast-Serving-Key), as the scaling daemon does; Prometheus scrapes --metrics-port.
    """
    # The token and TLS files of the control plane come from the settings (PIPECAST_* variables or config file).
    settings = load_settings(control_plane=control_plane, router_forward_auth=forward_auth,
                             router_metrics_port=metrics_port)
    control_plane = configured_control_plane(settings)  # --control-plane, else PIPECAST_CONTROL_PLANE or the file
    if not workers and not vllm_workers and not control_plane:
        raise click.UsageError("give at least one --worker URL or --control-plane (settings: control_plane)")
    key = static_serving_key(settings.auth_token)
    if settings.auth_token and not key and not control_plane:
        raise click.UsageError("the auth_token is a node token, from which no serving key derives: give the router "
                               "the cluster's master token, or --control-plane to learn the key from (pipecast's "
                               "workers take requests, and its /stats answers, only with the key)")
    try:
        static = [StaticDiscovery(list(urls), engine, key) for urls, engine in ((workers, "pipecast"),
                                                                               (vllm_workers, "vllm")) if urls]
    except WorkerUrlError as exc:
        raise click.UsageError(str(exc)) from None
    config = RouterConfig(max_queue=max_queue, queue_timeout_s=queue_timeout, health_interval_s=health_interval,
                          health_timeout_s=health_timeout, upstream_timeout_s=upstream_timeout,
                          max_retries=max_retries, forward_auth=settings.router_forward_auth,
                          admission=admission_config(settings, tenant_limits),
                          tenant_pacing=settings.router_tenant_pacing, discovery_interval_s=discovery_interval,
                          pipelines=pipelines, pipeline_max_in_flight=pipeline_max_in_flight,
                          views_need_key=bool(settings.auth_token))
    asyncio.run(_serve(config, static, settings if control_plane else None, host, port, drain_timeout,
                       settings.router_metrics_port))


def static_serving_key(token: str) -> bytes:
    """The serving key a router presents to its ``--worker`` URLs: the one the cluster's master token derives
    (b"" with none: auth off). A node token derives none: such a router learns the key from its control plane.
    A master token too short or too plain to resist guessing is refused (CredentialError), as by the agents."""
    if not token or parse_node_token(token) is not None:
        return b""
    return serving_key(data_plane_key(check_master_token(token)))


async def _serve(config: RouterConfig, static: list[StaticDiscovery], settings: Settings | None, host: str,
                 port: int, drain_timeout_s: float, metrics_port: int | None) -> None:
    async with AsyncExitStack() as stack:
        sources: list[Discovery] = list(static)
        if settings is not None:
            # Imported here: grpc loads only when a control plane is used.
            from control_plane.client import ControlPlaneClient

            client = ControlPlaneClient.from_settings(settings)
            await stack.enter_async_context(client)
            sources.append(ControlPlaneDiscovery(client, settings.control_plane))
        router = Router(config, sources)
        if metrics_port is not None:
            url = await stack.enter_async_context(listening(build_metrics_app(router), host, metrics_port))
            click.echo(f"router metrics on {url}/metrics")
        await run_router(router, host, port, drain_timeout_s, lambda url: click.echo(f"router listening on {url}"))

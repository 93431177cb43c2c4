"""``pipecast serve``: run the serving worker in the foreground until SIGTERM, SIGINT or SIGHUP."""

import asyncio
import re
import sys
from pathlib import Path

import click

from packager.manifest import HEX_DIGEST, MANIFEST_FILE
from pipecast.agent.local_client import MAX_TIMEOUT_S
from pipecast.core.clitypes import Number, SettingPath
from pipecast.core.settings import load_settings
from pipecast.engine.errors import DeviceError
from pipecast.engine.progressive import engine_device
from pipecast.loading import local_folder
from pipecast.serve.app import run_worker
from pipecast.serve.pipeline import DISSOLVE_AUTO, DISSOLVE_CHOICES, MAX_DEADLINE_S, STEP_TIMEOUT_S
from pipecast.serve.worker import ServingWorker, WorkerConfig

SWITCH_INTERVAL_S = 0.0005
#: The device strings the engine runs on, checked before the worker listens (a typo, or a CUDA device this host
#: lacks, would leave it answering 503 until killed): this first, then ``engine_device`` for a CUDA one.
DEVICE = re.compile(r"(cpu|cuda)(:(0|[1-9][0-9]*))?")


@click.command("serve")
@click.argument("package")
@click.option("--agent-socket", type=SettingPath(dir_okay=False, path_type=Path),
              help="The node agent's local socket: blocks arrive through it, zero-copy, as they are verified "
                   "(settings: agent_local_socket). Without a reachable agent holding the package, PACKAGE must "
                   "be a folder (or in the agent's disk cache): the unicast fallback.")
@click.option("--host", help="Address to listen on (settings: serve_host).")
@click.option("--port", type=click.IntRange(0, 65535), help="Port to listen on, 0 for any (settings: serve_port).")
@click.option("--max-queue", type=click.IntRange(min=1),
              help="Requests that may wait (for the model or a batch slot); beyond it 429 (settings: max_queue).")
@click.option("--max-batch", type=click.IntRange(min=1),
              help="Sequences sharing one forward pass (settings: max_batch).")
@click.option("--device", help="Where the model runs: cpu, cuda, cuda:1 ... (settings: device).")
@click.option("--model-name", "--served-model-name", "model_name",
              help="The model name requests use (default: the package's model name; vLLM's option name works too).")
@click.option("--wait-full-load", is_flag=True,
              help="Load-then-serve: hold every request until the whole model is in (the baseline of "
                   "`pipecast bench coldstart`). By default prompts run layer by layer as blocks arrive.")
@click.option("--agent-timeout", type=Number(min=0, max=MAX_TIMEOUT_S, min_open=True), default=60.0,
              show_default=True,
              help="Seconds the agent's socket may take to appear (an agent started after the worker), and each "
                   "request to the agent may take (for the package's manifest: then a PACKAGE folder, or its copy "
                   "in the disk cache, is read instead; for a block's memory). A package id with neither is waited "
                   "for however long it takes, until a scale-up places the package on this node.")
@click.option("--stall-timeout", type=Number(min=0, min_open=True), default=600.0,
              show_default=True, help="Loading fails after this many seconds without a new block.")
@click.option("--drain-timeout", type=Number(min=0), default=30.0, show_default=True,
              help="On SIGTERM, SIGINT or SIGHUP: seconds running requests may take to finish before they are cut.")
@click.option("--pipeline-step-timeout", type=Number(min=0, max=MAX_DEADLINE_S, min_open=True),
              default=STEP_TIMEOUT_S,
              show_default=True, help="As the head stage of a cross-node pipeline: seconds one token may take "
                                      "through every stage, waits for arriving layers included.")
@click.option("--pipeline-dissolve", type=click.Choice(DISSOLVE_CHOICES), default=DISSOLVE_AUTO,
              show_default=True, help="As the head stage: a request whose pipeline dissolves under it (this "
                                      "worker came to hold the whole model) moves to this worker's engine with "
                                      "its tokens so far (move), finishes through the stages (finish), or "
                                      "does whichever this worker's measured step times say ends it sooner "
                                      "(auto).")
def serve_command(package: str, agent_socket: Path | None, host: str | None, port: int | None,
                  max_queue: int | None, max_batch: int | None, device: str | None, model_name: str | None,
                  wait_full_load: bool, agent_timeout: float, stall_timeout: float, drain_timeout: float,
                  pipeline_step_timeout: float, pipeline_dissolve: str) -> None:
    """Serve PACKAGE (a package folder or id) with an OpenAI-compatible API, from the moment it starts loading.

    Prints the URL it listens on. Register that URL for the router with the node agent's --serve-url. With
    an agent that holds cluster credentials, completion requests and pipeline stage calls must present the
    cluster's serving key (the router's and other workers' do); without one the worker takes them from anyone.
    """
    settings = load_settings(serve_host=host, serve_port=port, max_queue=max_queue, max_batch=max_batch,
                             device=device, agent_local_socket=agent_socket)
    device_hint = "'--device'" if device is not None else "setting 'device'"
    if not DEVICE.fullmatch(settings.device):
        raise click.BadParameter(f"{settings.device!r} is not a device the engine runs on (cpu, cuda or cuda:N)",
                                 param_hint=device_hint)
    if settings.device != "cpu":  # a CUDA device this host lacks (a CPU image on a GPU node, cuda:1 on one GPU)
        try:
            engine_device(settings.device)
        except DeviceError as exc:
            raise click.BadParameter(str(exc), param_hint=device_hint) from None
    # Without an agent the worker can only read a folder: one that is not there would fail it for good, after it
    # listens. With an agent, a package id is waited for (the scale-up that brings it may come later).
    folder = local_folder(package, settings.agent_cache_dir)
    if settings.agent_local_socket is None and (folder is None or not (folder / MANIFEST_FILE).is_file()):
        raise click.BadParameter(f"{package!r} is neither a package folder (a folder with a {MANIFEST_FILE}) nor in "
                                 "the agent's disk cache, and no agent is configured to hold it (--agent-socket; "
                                 "settings: agent_local_socket)", param_hint="'PACKAGE'")
    if folder is None and not HEX_DIGEST.fullmatch(package):  # an id's prefix, or a model's name, waited for good
        raise click.BadParameter(f"{package!r} is neither a package folder nor a whole package id (64 hex digits, as "
                                 "`pipecast cp availability PREFIX` prints it whole)", param_hint="'PACKAGE'")
    config = WorkerConfig(package=package, agent=settings.agent_local_socket, device=settings.device,
                          max_queue=settings.max_queue, max_batch=settings.max_batch, model_name=model_name,
                          wait_full_load=wait_full_load, agent_timeout_s=agent_timeout,
                          stall_timeout_s=stall_timeout, pipeline_step_timeout_s=pipeline_step_timeout,
                          pipeline_dissolve=pipeline_dissolve)
    # The engine thread holds the GIL between torch ops; the event loop that streams its tokens would wait
    # up to the default 5 ms switch interval for each hand-over (measured: first tokens 1.5-4 ms late).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    asyncio.run(run_worker(ServingWorker(config), settings.serve_host, settings.serve_port, drain_timeout,
                           lambda url: click.echo(f"pipecast serve: listening on {url}")))

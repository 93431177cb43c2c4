"""The ``pipecast`` command. Subcommands load lazily so that ``pipecast --help`` starts fast."""

import importlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click

from pipecast.core.errors import PipecastError

# name -> (module:attribute, one-line help shown by `pipecast --help` without importing the module)
COMMANDS = {
    "pack": ("packager.command:pack_command", "Pack a safetensors checkpoint folder into a block package."),
    "verify": ("packager.command:verify_command", "Re-hash every block, chunk and file of a package."),
    "inspect": ("packager.command:inspect_command", "Print a package's blocks, layers, sizes and digests."),
    "convert-gguf": ("packager.command:convert_gguf_command",
                     "Convert a GGUF model file to a safetensors checkpoint folder."),
    "agent": ("pipecast.agent.command:agent_command",
              "Run the node agent: serve blocks, fetch this node's share, feed local engines."),
    "control-plane": ("control_plane.command:control_plane_command", "Run the control plane (gRPC)."),
    "cp": ("control_plane.command:cp_group", "Operate a running control plane: workers, packages, plans."),
    "status": ("control_plane.command:cluster_status_command",
               "One screen of the cluster (`pipecast cp status`): workers, packages, plans, pipelines, "
               "deployments, routes."),
    "serve": ("pipecast.serve.command:serve_command",
              "Serve a model (OpenAI API) from the moment its blocks start arriving."),
    "router": ("pipecast.router.command:router_command",
               "Route completion requests to the least-loaded serving worker."),
    "scaler": ("pipecast.scaler.command:scaler_group",
               "The scaling daemon: keep each deployment's replicas at its SLO; print its decisions."),
    "bench": ("benchmarks.command:bench_group", "Run a benchmark (pack, ...); each prints its floor."),
}

# The benchmarks are not installed with pipecast (the runtime never imports them): `pipecast bench` runs
# from a source checkout, the folder beside this package.
CHECKOUT = Path(__file__).resolve().parents[1]


def _import_command_module(module: str):
    if module.split(".")[0] == "benchmarks" and str(CHECKOUT) not in sys.path:
        if not (CHECKOUT / "benchmarks" / "command.py").is_file():
            raise click.ClickException(
                f"`pipecast bench` needs a source checkout: no benchmarks/ folder at {CHECKOUT}")
        sys.path.insert(0, str(CHECKOUT))
    return importlib.import_module(module)


class LazyGroup(click.Group):
    """A group whose subcommands are imported only when invoked."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr = COMMANDS[name][0].split(":")
        return getattr(_import_command_module(module), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, COMMANDS[name][1]) for name in sorted(COMMANDS)])


#: The long-running commands: they log at INFO without -v (what they wait for, load, transfer, decide), so that an
#: operator's journal says more than "listening" (found in review); the HTTP access log only with -vv.
DAEMONS = ("agent", "control-plane", "router", "scaler", "serve")


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug; the long-running commands, "
                                                  f"{', '.join(DAEMONS)}, log at info without it).")
@click.version_option(package_name="pipecast")
@click.pass_context
def cli(ctx: click.Context, verbose: int) -> None:
    """pipecast: get new LLM serving workers to their first token fast."""
    if ctx.invoked_subcommand in DAEMONS:
        verbose = max(verbose, 1)
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if verbose < 2:  # a line per request, health polls included
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


class _Terminated(SystemExit):
    """SIGTERM (``timeout``, systemd, Kubernetes) or SIGHUP arrived: unwinds like Ctrl-C's KeyboardInterrupt. A
    SystemExit because asyncio re-raises only that and KeyboardInterrupt out of a callback: it logs any other
    BaseException and runs on."""


def _raise_terminated(signum: int, frame: object) -> None:
    import asyncio  # here: `pipecast --help` starts without it

    terminated = _Terminated(128 + signum)  # as a shell reports a SIGTERM death
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # no event loop: unwind from here
        raise terminated from None
    # From a callback of the loop's own: raised inside a task, it would stay that task's unretrieved exception,
    # logged with its traceback when the task is collected.
    loop.call_soon_threadsafe(_throw, terminated)


def _throw(exc: BaseException) -> None:
    raise exc


#: What kills a command at once by default, and so is made to unwind instead: the service manager's stop and a
#: closed terminal (an ssh session dropped mid-pack).
_UNWOUND = (signal.SIGTERM, signal.SIGHUP)


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM and SIGHUP raise :class:`_Terminated` meanwhile (from the next callback of an event loop that runs)
    instead of killing the process at once, so that with and finally blocks run: an interrupted pack leaves no
    partial folder and no MLflow download, as on Ctrl-C.
    Installed only over the default disposition (``nohup`` ignores SIGHUP: it stays ignored); the servers' own
    handlers (agent, serve, router, control plane, scaler: a graceful drain on SIGTERM, SIGINT or SIGHUP,
    :mod:`pipecast.core.signals`) replace it while their event loop runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    installed = [s for s in _UNWOUND if signal.getsignal(s) == signal.SIG_DFL]
    for signum in installed:
        signal.signal(signum, _raise_terminated)
    try:
        yield
    finally:
        for signum in installed:
            signal.signal(signum, signal.SIG_DFL)


def main(argv: list[str] | None = None) -> int:
    """Entry point: a PipecastError becomes a one-line message and exit code 2."""
    try:
        # Without standalone mode click returns a command's Exit code instead of raising it.
        with _sigterm_unwinds():
            code = cli.main(args=argv, standalone_mode=False)
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except _Terminated as exc:
        click.echo("terminated", err=True)
        return exc.code
    except PipecastError as exc:
        click.echo(f"error: {exc}", err=True)
        return 2
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())

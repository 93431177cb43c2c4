"""``pipecast-vllm-folder PACKAGE_ID DEST``: the folder vLLM needs for a package that only the node agent holds.

vLLM's API server reads ``config.json`` and the tokenizer from the model path before any loader runs, so the
path must be a local folder. This writes the package's manifest and small files (config, tokenizer, generation
config) into ``DEST`` as the agent holds them, verified against the manifest's digests, and no block:
``vllm serve DEST --load-format pipecast`` then takes every block from the agent.
"""

import argparse
import sys
from pathlib import Path
from typing import Any

from packager.manifest import HEX_DIGEST, MANIFEST_FILE, manifest_to_json
from pipecast.core.errors import PipecastError
from pipecast.core.fsutil import atomic_directory
from pipecast.v1.manifest_pb2 import Manifest


def write_package_folder(client: Any, package_id: str, dest: Path, timeout_s: float) -> Manifest:
    """Write the manifest and small files of ``package_id`` from the agent behind ``client`` (a
    :class:`LocalAgentClient`) into the new folder ``dest`` (built aside, renamed into place when complete)."""
    manifest = client.manifest(package_id, timeout=timeout_s)
    with atomic_directory(dest) as tmp:
        for file in manifest.files:  # paths checked by the manifest's validation: they stay inside the folder
            path = tmp / file.path
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(client.package_file(file.path, manifest.package_id, timeout=timeout_s))
        (tmp / MANIFEST_FILE).write_text(manifest_to_json(manifest))
    return manifest


def _held_package(folder: Path) -> str | None:
    """The id of the package whose manifest and small files ``folder`` holds, all verified; None otherwise."""
    from packager.errors import PackageError
    from packager.package import Package

    try:
        package = Package.open(folder)
        for entry in package.manifest.files:
            package.small_file(entry.path, verify=True)
    except (PackageError, OSError):
        return None
    return package.package_id


def main(argv: list[str] | None = None) -> int:
    """The command line; exit status 2 with a one-line message on an expected failure."""
    parser = argparse.ArgumentParser(prog="pipecast-vllm-folder", description=__doc__.split("\n\n")[0])
    parser.add_argument("package_id", help="the package id (the agent waits for its manifest up to --timeout)")
    parser.add_argument("dest", type=Path, help="the folder to create (vLLM's model path)")
    parser.add_argument("--agent", help="the agent's local socket (default: PIPECAST_AGENT_LOCAL_SOCKET)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the package (default 30)")
    args = parser.parse_args(argv)
    from pipecast.agent.local_client import LocalAgentClient
    from pipecast.core.settings import load_settings

    try:
        if not HEX_DIGEST.fullmatch(args.package_id):  # asked of the agent, it waited --timeout for no package
            raise PipecastError(f"{args.package_id!r} is not a whole package id (64 hex digits, as `pipecast cp "
                                "availability PREFIX` prints it whole)")
        socket = args.agent or load_settings().agent_local_socket
        if socket is None:
            raise PipecastError("no agent socket: pass --agent or set PIPECAST_AGENT_LOCAL_SOCKET")
        if args.dest.exists():
            held = _held_package(args.dest)
            if held != args.package_id:
                raise PipecastError(f"{args.dest}: already exists" + (f" (package {held[:12]})" if held else ""))
            # The folder of an earlier scale-up of the package, whole: a scale-up may run this every time.
            print(f"{args.dest}: already holds package {held[:12]} (vllm serve {args.dest} --load-format pipecast)")
            return 0
        with LocalAgentClient(socket) as client:
            manifest = write_package_folder(client, args.package_id, args.dest, args.timeout)
    except (PipecastError, OSError) as exc:
        print(f"pipecast-vllm-folder: {exc}", file=sys.stderr)
        return 2
    print(f"{args.dest}: package {manifest.package_id[:12]} ({manifest.model_name}), "
          f"{len(manifest.files)} files, no blocks (vllm serve {args.dest} --load-format pipecast)")
    return 0

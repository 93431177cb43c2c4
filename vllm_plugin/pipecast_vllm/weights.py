"""The (name, tensor) pairs a vLLM model loads, block after block in the manifest's order; a block's tensors
are handed over only once all its bytes are verified against the manifest's digests:

- from the node agent (:class:`AgentBlocks`): views of the agent's own memory (no copy), each block as soon as
  the agent has verified it, so the model loads block ``i`` while later blocks are still being multicast;
- from the package folder (:class:`FolderBlocks`), when no agent can serve the package (the unicast fallback,
  logged as a warning): each block file mapped and checked here, every chunk digest and the block's, before
  any tensor of it exists.

Without vLLM: the loader (:mod:`pipecast_vllm.loader`) feeds :func:`iter_weights` to the model's own
``load_weights``.
"""

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from packager.errors import PackageError
from packager.package import Package, block_tensors_of
from pipecast.core.errors import PipecastError
from pipecast.v1.manifest_pb2 import Block, Manifest

from .errors import BlockLoadError, LoaderConfigError, PackageUnavailableError

if TYPE_CHECKING:
    import torch

# A child of vLLM's logger, so that vLLM's handler, format and level (VLLM_LOGGING_LEVEL) apply to these lines.
log = logging.getLogger("vllm.pipecast")

LOAD_FORMAT = "pipecast"
#: How often a wait for a block looks whether the agent verified other bytes of the package meanwhile.
STALL_POLL_S = 5.0
#: What making a block's tensors may raise besides PackageError: an unreadable block file (OSError), a dtype
#: torch cannot view (TypeError), a view torch refuses (ValueError); each becomes a BlockLoadError.
BLOCK_ERRORS = (PackageError, OSError, TypeError, ValueError)


@dataclass(frozen=True)
class LoaderOptions:
    """What ``--model-loader-extra-config`` may set for ``--load-format pipecast`` (a JSON object)."""

    agent_socket: str | None = None
    """The node agent's local socket; unset: pipecast's setting ``agent_local_socket``
    (``PIPECAST_AGENT_LOCAL_SOCKET``)."""
    agent_timeout_s: float = 30.0
    """How long the agent may take to hold the package's manifest before the package folder is read instead."""
    block_timeout_s: float = 120.0
    """How long the loader waits for the next block while the agent verifies no new byte of the package: a
    stall, not a load's length, so a large package loads for as long as it keeps arriving. Well under vLLM's
    own limit on its whole start-up (VLLM_ENGINE_READY_TIMEOUT_S, 600 s by default), so that a stalled load
    ends with this loader's error rather than vLLM's bare timeout."""

    @classmethod
    def from_extra_config(cls, extra: Any) -> "LoaderOptions":
        """Check ``--model-loader-extra-config``; :class:`LoaderConfigError` (a ``ValueError``) says what is wrong."""
        if not isinstance(extra, dict):
            raise LoaderConfigError(f"--model-loader-extra-config must be a JSON object for load format "
                                    f"{LOAD_FORMAT}, got {type(extra).__name__}")
        known = tuple(cls.__dataclass_fields__)
        unexpected = sorted(set(extra) - set(known))
        if unexpected:
            raise LoaderConfigError(f"unexpected --model-loader-extra-config keys for load format {LOAD_FORMAT}: "
                                    f"{', '.join(unexpected)} (known: {', '.join(known)})")
        socket = extra.get("agent_socket")
        if socket is not None and (not isinstance(socket, str) or not socket):
            raise LoaderConfigError(f"agent_socket must be the path of the agent's local socket, got {socket!r}")
        from pipecast.agent.local_client import MAX_TIMEOUT_S

        for name in ("agent_timeout_s", "block_timeout_s"):
            value = extra.get(name, 1.0)
            # Compared, not passed to math.isfinite, which overflows on an integer of hundreds of digits.
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
                raise LoaderConfigError(f"{name} must be a positive number of seconds, got {value!r}")
            if value > MAX_TIMEOUT_S:  # the local API refuses a longer wait: every request would fail
                raise LoaderConfigError(f"{name} must be at most {MAX_TIMEOUT_S:g} s (the longest wait the agent's "
                                        f"local API takes), got {value!r}")
        return cls(**extra)


class BlockSource(Protocol):
    """Where a package's verified blocks come from."""

    @property
    def manifest(self) -> Manifest:
        """The package's manifest (validated: its package id is its digest)."""

    @property
    def origin(self) -> str:
        """Where the blocks come from, for logs and messages."""

    def tensors(self, block: Block) -> dict[str, "torch.Tensor"]:
        """``block``'s tensors once all its bytes are verified (views, no copy); :class:`BlockLoadError` if
        they cannot be had."""

    def close(self) -> None:
        """Let go of the source (the views already handed over stay valid)."""


class AgentBlocks:
    """Blocks of the node agent's memory, through its local API (:class:`LocalAgentClient`); the agent
    verifies every chunk before it counts it, and hands out verified blocks only."""

    def __init__(self, client: Any, manifest: Manifest, socket: str, block_timeout_s: float) -> None:
        self._client = client
        self._manifest = manifest
        self._origin = f"agent at {socket}"
        self._timeout_s = block_timeout_s

    @classmethod
    def connect(cls, socket: str, package_id: str, options: LoaderOptions) -> "AgentBlocks":
        """The agent at ``socket``, once it holds the package's manifest (``options.agent_timeout_s``);
        ``OSError`` or :class:`PipecastError` if it cannot serve the package."""
        from pipecast.agent.local_client import LocalAgentClient

        client = LocalAgentClient(socket)
        try:
            manifest = client.manifest(package_id, timeout=options.agent_timeout_s)
        except BaseException:
            client.close()
            raise
        return cls(client, manifest, socket, options.block_timeout_s)

    @property
    def manifest(self) -> Manifest:
        return self._manifest

    @property
    def origin(self) -> str:
        return self._origin

    def tensors(self, block: Block) -> dict[str, "torch.Tensor"]:
        package_id = self._manifest.package_id
        try:
            buf = self._wait(block.index)
        except PipecastError as exc:  # the agent dropped the package, its event stream ended, ...
            raise BlockLoadError(package_id, block.index, self._origin,
                                 str(exc).removeprefix(f"{self._origin}: ")) from None
        if buf is None:
            raise BlockLoadError(package_id, block.index, self._origin,
                                 f"not verified, and no new byte of the package verified for {self._timeout_s:g} s"
                                 f"{self._held(block.index)}")
        where = f"{self._origin}, block {block.index}"
        try:
            return block_tensors_of(block, buf, where)
        except BLOCK_ERRORS as exc:
            raise BlockLoadError(package_id, block.index, self._origin, _problem(exc, where)) from None

    def _wait(self, index: int) -> memoryview | None:
        """Block ``index``'s bytes once the agent has verified them; None once the agent has verified no new byte
        of the package (from any block's start, as its events tell) for ``block_timeout_s``."""
        package_id = self._manifest.package_id
        seen, progressed = self._verified_bytes(), time.monotonic()
        while True:
            left = progressed + self._timeout_s - time.monotonic()
            if left <= 0:
                return None
            try:
                # Mapped once, with the request's own timeout (the agent populates the block's memory before
                # it answers); the waits after it are on the agent's events and need no request.
                self._client.map_ahead(index, package_id, left)
                return self._client.wait_block(index, min(left, STALL_POLL_S), package_id)
            except TimeoutError:
                if (verified := self._verified_bytes()) != seen:  # != : a package held again counts afresh
                    seen, progressed = verified, time.monotonic()

    def _verified_bytes(self) -> int:
        """Bytes of the package the agent has verified by now, from each block's start (no request)."""
        package_id = self._manifest.package_id
        return sum(self._client.verified_bytes(b.index, package_id) for b in self._manifest.blocks)

    def _held(self, index: int) -> str:
        """What the agent holds of block ``index``, for a timeout's message ("" if it cannot say): its peers
        and their failures are in the agent's own log."""
        try:
            block = self._client.progress(self._manifest.package_id, timeout=5.0).blocks[index]
        except (OSError, PipecastError, IndexError):
            return ""
        return f" (the agent holds {block.chunks_present} of its {block.chunks_total} chunks)"

    def close(self) -> None:
        self._client.close()


class FolderBlocks:
    """Blocks of the package folder, each file mapped copy-on-write and checked against the manifest (size,
    every chunk digest, the block digest, the header's tensor names) before any tensor of it is made."""

    def __init__(self, package: Package) -> None:
        self._package = package

    @property
    def manifest(self) -> Manifest:
        return self._package.manifest

    @property
    def origin(self) -> str:
        return f"package folder {self._package.root}"

    def tensors(self, block: Block) -> dict[str, "torch.Tensor"]:
        path = str(self._package.block_path(block.index))
        try:
            return self._package.block_tensors(block.index)
        except BLOCK_ERRORS as exc:
            raise BlockLoadError(self._package.package_id, block.index, path, _problem(exc, path)) from None
        finally:
            # The tensors hold the mapping while the model needs them; the package's cache of it would hold every
            # block's until the load ends (a whole model mapped and read, per tensor-parallel worker).
            self._package.forget_block(block.index)

    def close(self) -> None:
        """Nothing to do: each block's mapping goes with the last view of it."""


def _problem(exc: Exception, where: str) -> str:
    """What went wrong with a block, for :class:`BlockLoadError` (which names the block and its source)."""
    if isinstance(exc, PackageError):
        return getattr(exc, "problem", str(exc))
    if isinstance(exc, OSError):
        return f"cannot read ({exc.strerror or exc})"
    return str(exc).removeprefix(f"{where}: ")


def open_package(folder: Path | str) -> Package:
    """The package at ``folder`` (vLLM's model path), its manifest validated."""
    try:
        return Package.open(folder)
    except PackageError as exc:
        raise LoaderConfigError(f"{folder} is not a pipecast package ({exc}): --load-format {LOAD_FORMAT} serves "
                                "a package folder (manifest.json, config.json and the tokenizer files at its root; "
                                "`pipecast pack` writes one, `pipecast-vllm-folder` one without blocks from the "
                                "agent)") from None


def open_blocks(folder: Path | str, options: LoaderOptions) -> BlockSource:
    """The node agent's blocks of the package at ``folder`` if an agent can serve it, else the folder's own
    (the unicast fallback, logged as a warning)."""
    package = open_package(folder)
    package_id = package.package_id
    for entry in package.manifest.files:  # what vLLM builds the model from (config.json) must be the package's
        try:
            package.small_file(entry.path, verify=True)
        except PackageError as exc:
            raise LoaderConfigError(f"package {package_id[:12]} at {folder}: {exc}") from None
    socket = options.agent_socket or _configured_socket()
    if socket is None:
        reason = "no pipecast agent configured (agent_socket, PIPECAST_AGENT_LOCAL_SOCKET unset)"
    else:
        asked = time.monotonic()
        try:
            blocks = AgentBlocks.connect(socket, package_id, options)
            log.info("agent at %s holds package %s (its manifest came after %.2f s)", socket, package_id[:12],
                     time.monotonic() - asked)
            return blocks
        except (OSError, PipecastError) as exc:
            reason = f"pipecast agent at {socket} cannot serve package {package_id[:12]} ({exc})"
    # Checked before any block: a folder missing some (a copy cut short) would fail only after loading the others.
    missing = [b.index for b in package.manifest.blocks if not package.has_block(b.index)]
    if len(missing) == len(package.manifest.blocks):
        raise PackageUnavailableError(f"package {package_id[:12]}: {reason}, and the package folder {folder} holds "
                                      "none of its blocks")
    if missing:
        raise PackageUnavailableError(f"package {package_id[:12]}: {reason}, and the package folder {folder} lacks "
                                      f"block(s) {', '.join(map(str, missing))} of {len(package.manifest.blocks)}")
    log.warning("%s: loading %s from the package folder (unicast fallback)", reason, folder)
    return FolderBlocks(package)


def _configured_socket() -> str | None:
    from pipecast.core.settings import load_settings

    socket = load_settings().agent_local_socket
    return None if socket is None else str(socket)


def iter_weights(source: BlockSource, last: list[str] | None = None) -> Iterator[tuple[str, "torch.Tensor"]]:
    """Every tensor of the package as (checkpoint name, tensor), block after block, each block once verified;
    closes ``source`` at the end. ``last``, if given, holds what was handed over last ("tensor NAME of block
    I"), for an error of the model's loading to name it."""
    manifest = source.manifest
    started = time.monotonic()
    log.info("loading package %s (%s, %d blocks) from %s", manifest.package_id[:12], manifest.model_name,
             len(manifest.blocks), source.origin)
    try:
        for block in manifest.blocks:
            asked = time.monotonic()
            tensors = source.tensors(block)
            # Blocks by index, from 0, as the loader's errors name them.
            log.info("block %d verified (%d of %d, %d tensors, %.1f MB) after waiting %.2f s", block.index,
                     block.index + 1, len(manifest.blocks), len(tensors), block.bytes / 1e6, time.monotonic() - asked)
            for name, tensor in tensors.items():
                if last is not None:
                    last[:] = [f"tensor {name} of block {block.index}"]
                yield name, tensor
    finally:
        source.close()
    log.info("package %s: every block handed over in %.2f s", manifest.package_id[:12], time.monotonic() - started)

"""Where an engine's blocks come from: the :class:`BlockProvider` protocol and its implementations.

- :class:`PackageFolderProvider`: a package folder on local disk, blocks mapped zero-copy (the unicast /
  local-cache fallback);
- :class:`AgentBlockProvider`: blocks from the node agent's shared memory, through its local client, and
  (a :class:`StreamingBlockProvider`) each block's layers as soon as their own bytes are verified;
- :class:`DelayedProvider`: wraps another provider and releases blocks one by one, by hand or on a
  schedule (tests, and benchmarks that emulate blocks arriving over a link).
"""

import struct
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from packager.blockfile import tensors_from_buffer
from packager.errors import PackageError, PackageFileError
from packager.package import CONFIG_FILE, Package, parse_config
from packager.safetensors_format import Header, parse_header
from pipecast.agent.local_client import RequestScope
from pipecast.engine.errors import BlockBindError, BlockWaitTimeout
from pipecast.v1.manifest_pb2 import Manifest

if TYPE_CHECKING:
    import torch


@runtime_checkable
class BlockProvider(Protocol):
    """Where an engine gets a package's verified blocks, each as tensors named as in the original checkpoint."""

    @property
    def manifest(self) -> Manifest:
        """The package manifest (blocks, layer ranges, tensor names)."""

    @property
    def config(self) -> dict:
        """The model's config.json."""

    @property
    def num_blocks(self) -> int:
        """How many blocks the package has."""

    @property
    def origin(self) -> str:
        """Where blocks come from, for logs and error messages (e.g. ``package folder /data/pkg``)."""

    def small_file(self, path: str) -> bytes | None:
        """A small file of the package (e.g. ``generation_config.json``), or None if it has none."""

    def present_blocks(self) -> set[int]:
        """The blocks that can be had now without waiting (one question however many blocks are missing)."""

    def wait_block(self, index: int, timeout: float) -> Mapping[str, "torch.Tensor"]:
        """Block ``index``'s tensors (views of the block's buffer, no copy), waiting up to ``timeout`` s.

        Raises :class:`BlockWaitTimeout` if it is not there in time; other errors are final.
        """


@runtime_checkable
class StreamingBlockProvider(BlockProvider, Protocol):
    """A provider that also hands out a block's tensors before the whole block is verified: its bytes are
    verified chunk by chunk, so the tensors wholly inside the verified prefix are safe to use."""

    def wait_header(self, index: int, timeout: float) -> Header:
        """Block ``index``'s layout once its header's bytes are verified; :class:`BlockWaitTimeout` if not."""

    def wait_tensors(self, index: int, names: Sequence[str], timeout: float) -> Mapping[str, "torch.Tensor"]:
        """The named tensors of block ``index`` once the bytes up to the last of them are verified."""

    def verified_bytes(self, index: int) -> int:
        """Bytes of block ``index`` verified from its start by now (0: none yet), without waiting."""


class PackageFolderProvider:
    """Blocks of a package folder on this node, mapped copy-on-write and checked against the manifest.

    With ``verify`` (the default) config.json and the small files are checked against the manifest too, as
    blocks are: :class:`~packager.errors.PackageFileError` naming the file otherwise; a small file that cannot be
    read is one either way.
    """

    def __init__(self, root: Path | str, *, verify: bool = True):
        self.package = Package.open(root)
        self._config = self.package.read_config(verify=verify)
        self._verify = verify

    @property
    def manifest(self) -> Manifest:
        return self.package.manifest

    @property
    def config(self) -> dict:
        return self._config

    @property
    def num_blocks(self) -> int:
        return self.package.num_blocks

    @property
    def origin(self) -> str:
        return f"package folder {self.package.root}"

    def small_file(self, path: str) -> bytes | None:
        try:
            return self.package.small_file(path, verify=self._verify)
        except OSError as exc:  # without verify the packager lets it through: typed here as read_config does
            raise PackageFileError(self.package.root / path, f"cannot read it ({exc.strerror})") from None

    def present_blocks(self) -> set[int]:
        return {i for i in range(self.num_blocks) if self.package.has_block(i)}

    def wait_block(self, index: int, timeout: float) -> Mapping[str, "torch.Tensor"]:
        # A local folder has every block or is broken: nothing to wait for, and a bad or missing file is
        # reported at once by the packager (BlockMismatchError naming the file).
        tensors = self.package.block_tensors(index, verify=self._verify)
        # The tensors hold the mapping from here: it goes with the weights (close), not with the package object.
        self.package.forget_block(index)
        return tensors


class AgentBlockProvider:
    """Blocks held by the node agent, read from its shared memory through its local client (no copy).

    ``client`` is a :class:`pipecast.agent.local_client.LocalAgentClient` (or an object with its methods): ``manifest``,
    ``map_ahead``, ``wait_block`` / ``wait_prefix`` (a read-only view of a verified block or prefix; ``TimeoutError`` if
    not verified in time), ``verified_blocks``, ``verified_bytes`` and ``package_file``. The agent hands out verified
    bytes only. Besides whole blocks, this provider hands out a block's layers one by one as their bytes are verified
    (:meth:`wait_header`, :meth:`wait_tensors`): a :class:`StreamingBlockProvider`. Its requests are a
    :class:`~pipecast.agent.local_client.RequestScope` of their own: :meth:`interrupt` ends them, not those of other
    models the client serves.
    """

    def __init__(self, client: Any, *, package_id: str | None, where: str, timeout_s: float = 10.0):
        self.client = client
        self._where = where
        self._scope = RequestScope()
        with self._scope.active():
            self._manifest = client.manifest(package_id, timeout=timeout_s)
        self._package_id = self._manifest.package_id
        self._timeout_s = timeout_s
        config = self.small_file(CONFIG_FILE)
        if config is None:
            raise PackageError(f"package {self._package_id[:12]} held by {self.origin} has no config.json")
        self._config = parse_config(config, f"config.json of package {self._package_id[:12]} held by {self.origin}")
        self._mapped: set[int] = set()
        self._headers: dict[int, Header] = {}

    @property
    def manifest(self) -> Manifest:
        return self._manifest

    @property
    def config(self) -> dict:
        return self._config

    @property
    def num_blocks(self) -> int:
        return len(self._manifest.blocks)

    @property
    def origin(self) -> str:
        return f"agent at {self._where}"

    def small_file(self, path: str) -> bytes | None:
        if path not in {f.path for f in self._manifest.files}:
            return None
        with self._scope.active():
            return self.client.package_file(path, self._package_id, timeout=self._timeout_s)

    def present_blocks(self) -> set[int]:
        with self._scope.active():  # its first call may subscribe to the agent's events
            return self.client.verified_blocks(self._package_id)

    def verified_bytes(self, index: int) -> int:
        with self._scope.active():
            return self.client.verified_bytes(index, self._package_id)

    def wait_block(self, index: int, timeout: float) -> Mapping[str, "torch.Tensor"]:
        buf = self._wait(index, None, timeout)
        return tensors_from_buffer(buf, self._where_block(index), self._header(index, buf))

    def interrupt(self) -> None:
        """End this provider's requests to the client in flight (loading stops: one waiting on a silent agent would
        hold the loader thread for agent_timeout_s + 5 s), not those of other models the client serves."""
        interrupt = getattr(self.client, "interrupt", None)
        if interrupt is not None:
            interrupt(self._scope)

    def wait_header(self, index: int, timeout: float) -> Header:
        """Block ``index``'s layout (tensor names, dtypes, byte ranges) once the chunks holding its header
        are verified, usually long before the block is. Raises :class:`BlockWaitTimeout`."""
        if index not in self._headers:
            size = self._manifest.blocks[index].bytes
            length = struct.unpack("<Q", bytes(self._wait(index, min(8, size), timeout)[:8]))[0]
            self._header(index, self._wait(index, min(8 + length, size), timeout))
        return self._headers[index]

    def wait_tensors(self, index: int, names: Sequence[str], timeout: float) -> Mapping[str, "torch.Tensor"]:
        """Some of block ``index``'s tensors (views, no copy) as soon as the bytes up to the last of them
        are verified, while the rest of the block may still be in flight. Raises :class:`BlockWaitTimeout`."""
        header = self.wait_header(index, timeout)
        end = header.data_start + max(header.tensors[n].end for n in names)
        return tensors_from_buffer(self._wait(index, end, timeout), self._where_block(index), header, names)

    def _wait(self, index: int, nbytes: int | None, timeout: float) -> memoryview:
        """The block's verified bytes: all of it, or its first ``nbytes``."""
        try:
            with self._scope.active():
                if index not in self._mapped:  # the first wait for a block finds it in flight: map it then
                    self.client.map_ahead(index, self._package_id, timeout=self._timeout_s)
                    self._mapped.add(index)
                if nbytes is None:
                    return self.client.wait_block(index, timeout, self._package_id)
                # Asked each time (the client answers from its own mapping, in microseconds), not kept: a view
                # held here would keep the client from unmapping the block when the model closes (a BufferError
                # it swallows).
                return self.client.wait_prefix(index, nbytes, timeout, self._package_id)[:nbytes]
        except TimeoutError:
            raise BlockWaitTimeout(index, self.origin, timeout) from None

    def _where_block(self, index: int) -> str:
        return f"{self.origin}, block {index}"

    def _header(self, index: int, buf: memoryview) -> Header:
        """Parse and check block ``index``'s header from ``buf`` (the block or a prefix holding the header)."""
        if index not in self._headers:
            header = parse_header(buf, self._manifest.blocks[index].bytes, self._where_block(index))
            expected = set(self._manifest.blocks[index].tensor_names)
            if set(header.tensors) != expected:
                raise BlockBindError(index, self.origin, f"holds tensors {sorted(set(header.tensors) ^ expected)} "
                                                         "that differ from the manifest")
            self._headers[index] = header
        return self._headers[index]


class DelayedProvider:
    """Another provider whose blocks become available only when released, by hand or on a schedule.

    ``release_after[i]`` is the time in seconds at which block ``i`` appears, counted from the first time
    any block is asked for (so building the engine does not eat into the schedule); without a schedule
    every block waits for :meth:`release`.
    """

    def __init__(self, inner: BlockProvider, *, release_after: Sequence[float] | None = None):
        if release_after is not None and len(release_after) != inner.num_blocks:
            raise ValueError(f"release_after has {len(release_after)} times for {inner.num_blocks} blocks")
        self.inner = inner
        self._release_after = list(release_after) if release_after is not None else None
        self._due: list[float] | None = None
        self._released_at: dict[int, float] = {}
        self._cond = threading.Condition()

    @classmethod
    def at_bandwidth(cls, inner: BlockProvider, bytes_per_s: float) -> "DelayedProvider":
        """Blocks arriving in order over one link of ``bytes_per_s``: block i lands after its prefix."""
        arrivals, total = [], 0
        for block in inner.manifest.blocks:
            total += block.bytes
            arrivals.append(total / bytes_per_s)
        return cls(inner, release_after=arrivals)

    @property
    def manifest(self) -> Manifest:
        return self.inner.manifest

    @property
    def config(self) -> dict:
        return self.inner.config

    @property
    def num_blocks(self) -> int:
        return self.inner.num_blocks

    @property
    def origin(self) -> str:
        return f"delayed {self.inner.origin}"

    def small_file(self, path: str) -> bytes | None:
        return self.inner.small_file(path)

    def release(self, *indexes: int) -> None:
        """Make the given blocks available now."""
        with self._cond:
            now = time.monotonic()
            for i in indexes:
                self._released_at.setdefault(i, now)
            self._cond.notify_all()

    def release_all(self) -> None:
        """Make every block available now."""
        self.release(*range(self.num_blocks))

    def released_at(self, index: int) -> float | None:
        """``time.monotonic()`` at which block ``index`` became available, or None if it has not."""
        with self._cond:
            return self._released_at.get(index) if self._present(index) else None

    def present_blocks(self) -> set[int]:
        with self._cond:
            return {i for i in range(self.num_blocks) if self._present(i)}

    def wait_block(self, index: int, timeout: float) -> Mapping[str, "torch.Tensor"]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._present(index):
                now = time.monotonic()
                if now >= deadline:
                    raise BlockWaitTimeout(index, self.origin, timeout)
                due = self._due[index] if self._due is not None else deadline
                self._cond.wait(min(deadline, max(due, now)) - now)
        return self.inner.wait_block(index, timeout)

    def _present(self, index: int) -> bool:
        if self._due is None and self._release_after is not None:
            start = time.monotonic()
            self._due = [start + t for t in self._release_after]
        if index in self._released_at:
            return True
        if self._due is not None and time.monotonic() >= self._due[index]:
            self._released_at[index] = self._due[index]
            return True
        return False

"""The engine's side of the local API: verified blocks of the node agent, mapped without a copy.

Blocking and light (no asyncio, no torch): an engine's loader thread calls it. The protocol is described
in :mod:`pipecast.agent.local_api`.
"""

import base64
import json
import math
import mmap
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

from packager.manifest import manifest_from_json
from pipecast.agent.errors import LocalApiError, LocalApiTimeoutError
from pipecast.agent.store import BlockProgress, StoreProgress
from pipecast.core.strictjson import JSONInputError, loads_object
from pipecast.v1.manifest_pb2 import Manifest

# Slack on top of a request's own timeout before the client gives up on the agent itself.
CLIENT_SLACK_S = 5.0
#: Longest wait a request may ask for (a day): any finite number would do, but a sane bound keeps every
#: deadline computation (the agent's timers, this socket's timeout) far from overflow.
MAX_TIMEOUT_S = 86_400.0


class LocalAgentClient:
    """An engine's handle on the agent of its node.

    Thread-safe: calls are serialised on one connection (keep waits short when several threads share a
    client). A block's memory stays mapped until :meth:`close` and, after it, for as long as a view of
    it (a tensor) is alive.
    """

    def __init__(self, socket_path: Path | str, connect_timeout_s: float = 5.0) -> None:
        self.socket_path = str(socket_path)
        self._connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()
        self._sock = self._connect()
        self._lines = self._sock.makefile("rb")
        self._maps: dict[tuple[str, int], mmap.mmap] = {}

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self._connect_timeout_s)
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            raise LocalApiError(f"no agent at {self.socket_path} ({exc.strerror or exc})") from None
        return sock

    def _call(self, request: dict, timeout: float) -> dict:
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not (
                math.isfinite(timeout) and 0 <= timeout <= MAX_TIMEOUT_S):
            raise LocalApiError(f"timeout must be a number of seconds from 0 to {MAX_TIMEOUT_S:g}, got {timeout!r}")
        with self._lock:
            self._sock.settimeout(timeout + CLIENT_SLACK_S)
            try:
                self._sock.sendall(json.dumps(request).encode() + b"\n")
                line = self._lines.readline()
            except TimeoutError:
                raise LocalApiTimeoutError(f"agent at {self.socket_path} did not answer {request['op']} "
                                           f"within {timeout + CLIENT_SLACK_S:g} s") from None
            except OSError as exc:
                raise LocalApiError(f"agent at {self.socket_path}: {exc.strerror or exc}") from None
        if not line:
            raise LocalApiError(f"agent at {self.socket_path} closed the connection")
        answer = self._decode(line)
        if not answer.get("ok"):
            error = LocalApiTimeoutError if answer.get("timeout") else LocalApiError
            raise error(f"agent at {self.socket_path}: {answer.get('error')}")
        return answer

    def _decode(self, line: bytes) -> dict:
        try:
            return loads_object(line)
        except JSONInputError as exc:
            raise LocalApiError(f"agent at {self.socket_path} answered something that is not a JSON object: "
                                f"{exc}") from None

    def manifest(self, package_id: str | None = None, timeout: float = 30.0) -> Manifest:
        """The package's manifest (waits until the agent has it)."""
        answer = self._call({"op": "manifest", "package": package_id, "timeout": timeout}, timeout)
        return manifest_from_json(json.dumps(answer["manifest"]), where=f"agent at {self.socket_path}")

    def wait_block(self, index: int, timeout: float, package_id: str | None = None) -> memoryview:
        """Block ``index``'s bytes once verified: a read-only view of the agent's own memory (no copy).

        Raises :class:`LocalApiTimeoutError` (a ``TimeoutError``) if not verified within ``timeout``.
        """
        answer = self._call({"op": "wait_block", "block": index, "package": package_id, "timeout": timeout},
                            timeout)
        return memoryview(self._map(answer))

    def wait_prefix(self, index: int, nbytes: int, timeout: float, package_id: str | None = None) -> memoryview:
        """The first ``nbytes`` bytes of block ``index`` once verified (chunk by chunk), while the rest of
        the block may still be arriving: a read-only view (no copy) of every byte verified from the block's
        start by then, so at least ``nbytes``.

        Raises :class:`LocalApiTimeoutError` (a ``TimeoutError``) if not verified within ``timeout``.
        """
        answer = self._call({"op": "wait_prefix", "block": index, "bytes": nbytes, "package": package_id,
                             "timeout": timeout}, timeout)
        return memoryview(self._map(answer))[:max(nbytes, answer.get("verified", nbytes))]

    def map_ahead(self, index: int, package_id: str | None = None, timeout: float = 30.0) -> None:
        """Map block ``index``'s buffer now, verified or not, so that :meth:`wait_block` finds it mapped.

        Call it while the block is in flight: the page-table set-up then happens during the transfer
        instead of between the block's verification and its first use. Nothing is read from it here.
        """
        self._map(self._call({"op": "buffer", "block": index, "package": package_id, "timeout": timeout}, timeout))

    def _map(self, answer: dict) -> mmap.mmap:
        key = (answer["package"], answer["block"])
        with self._lock:
            mapped = self._maps.get(key)
        if mapped is None:
            fd = os.open(answer["path"], os.O_RDONLY | os.O_CLOEXEC)
            try:
                # MAP_POPULATE: every page table entry now (mmap runs without the GIL), none faulted in
                # during the prefill that first reads the block (measured ~0.6 ms/MB of first touches).
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                mapped = mmap.mmap(fd, answer["bytes"], flags=flags, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            with self._lock:
                if self._maps.setdefault(key, mapped) is not mapped:
                    mapped.close()  # another thread mapped it meanwhile: use that one
                    mapped = self._maps[key]
        return mapped

    def package_file(self, path: str, package_id: str | None = None, timeout: float = 30.0) -> bytes:
        """A small package file (config.json, tokenizer files), verified by the agent."""
        answer = self._call({"op": "file", "path": path, "package": package_id, "timeout": timeout}, timeout)
        return base64.b64decode(answer["data"])

    def progress(self, package_id: str | None = None, timeout: float = 30.0) -> StoreProgress:
        """What the agent holds of the package: per block, chunks present and when it was verified."""
        data = self._call({"op": "progress", "package": package_id, "timeout": timeout}, timeout)["progress"]
        blocks = tuple(BlockProgress(**b) for b in data.pop("blocks"))
        return StoreProgress(**data, blocks=blocks)

    def status(self) -> dict:
        """The agent's state: node, address, bytes moved, and every package it holds with its goodput."""
        return self._call({"op": "status"}, 0.0)["status"]

    def events(self, timeout: float | None = None) -> Iterator[dict]:
        """Verified-block events (past ones first), on a connection of their own.

        ``timeout`` bounds the wait for each event (:class:`LocalApiTimeoutError`); None waits forever.
        """
        sock = self._connect()
        try:
            sock.settimeout(timeout)
            sock.sendall(b'{"op": "subscribe"}\n')
            lines = sock.makefile("rb")
            while True:
                try:
                    line = lines.readline()
                except TimeoutError:
                    raise LocalApiTimeoutError(f"no event from {self.socket_path} within {timeout:g} s") \
                        from None
                if not line:
                    return
                message = self._decode(line)
                if "event" in message:
                    yield message
        finally:
            sock.close()

    def close(self) -> None:
        """Close the connection and unmap the blocks (views still held keep their mapping alive)."""
        with self._lock:
            for mapped in self._maps.values():
                try:
                    mapped.close()
                except BufferError:
                    pass  # a caller still holds a view (a tensor): the mapping goes when that view does
            self._maps.clear()
            self._lines.close()
            self._sock.close()

    def __enter__(self) -> "LocalAgentClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The engine's side of the local API: verified blocks of the node agent, mapped without a copy.

Blocking and light (no asyncio, no torch): an engine's loader thread calls it. The protocol is described
in :mod:`pipecast.agent.local_api`.
"""

import base64
import json
import mmap
import os
import re
import socket
import struct
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from packager.manifest import manifest_from_json
from pipecast.agent.errors import LocalApiError, LocalApiTimeoutError, PackageDroppedError
from pipecast.agent.store import BlockProgress, StoreProgress
from pipecast.core.fsutil import start_ticks
from pipecast.core.strictjson import JSONInputError, loads_object
from pipecast.v1.manifest_pb2 import Manifest

# Slack on top of a request's own timeout before the client gives up on the agent itself.
CLIENT_SLACK_S = 5.0
#: Longest wait a request may ask for (a day): any finite number would do, but a sane bound keeps every
#: deadline computation (the agent's timers, this socket's timeout) far from overflow.
MAX_TIMEOUT_S = 86_400.0
#: What a request that answers at once (mapping a buffer) may take on a busy agent.
DEFAULT_REQUEST_TIMEOUT_S = 30.0


class RequestScope:
    """The requests of one user of a client others use too (a model's loader: a client given to ``pipecast.load``
    serves every model loaded with it): those a thread starts inside ``with scope.active():`` are the scope's, and
    :meth:`LocalAgentClient.interrupt` given the scope ends those only."""

    def __init__(self) -> None:
        self.interrupts = 0  # LocalAgentClient.interrupt(self) calls so far (under that client's lock)

    @contextmanager
    def active(self) -> Iterator[None]:
        """The requests this thread starts meanwhile are the scope's."""
        token = _SCOPE.set(self)
        try:
            yield
        finally:
            _SCOPE.reset(token)


#: The scope of the requests this thread starts: by default one that no interrupt() is given.
_SCOPE: ContextVar[RequestScope] = ContextVar("pipecast_agent_request_scope", default=RequestScope())


@dataclass(frozen=True)
class _Mapped:
    package: str
    memory: mmap.mmap
    size: int  # len(memory), known without it: close() may unmap it under a wait
    generation: int  # the client's event stream when it was mapped: another one is of another agent's memory


class LocalAgentClient:
    """An engine's handle on the agent of its node.

    Thread-safe: each thread's request goes over a connection of its own (kept for the next request), so a
    long one, such as a small file the agent is still receiving, holds up no other. What the agent has
    verified the client learns from the agent's event stream, on a thread and a connection of their own
    started by the first wait: :meth:`wait_block`, :meth:`wait_prefix` and :meth:`verified_blocks` then
    wait on that knowledge, not on a request, so a busy agent answering late delays no block by more than
    the event's own delivery. A block's memory stays mapped until :meth:`close` (or :meth:`unmap` of its
    package) and, after it, for as long as a view of it (a tensor) is alive. Users that share a client (the
    models loaded through it) each start their requests in a :class:`RequestScope` of their own, for
    :meth:`interrupt` to end one user's only.
    """

    def __init__(self, socket_path: Path | str, connect_timeout_s: float = 5.0) -> None:
        self.socket_path = str(socket_path)
        self._connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()  # guards the idle connections, those in use, the mappings and closed
        self._idle: list[tuple[socket.socket, BinaryIO]] = [self._open()]  # fails at once without an agent
        #: Connections a request is using, with its scope: close() shuts them all down, interrupt() the scope's.
        self._busy: dict[socket.socket, RequestScope] = {}
        self._closed = False
        self._maps: dict[tuple[str, int], mmap.mmap] = {}
        self._drops = 0  # drops seen so far (under _lock): an answer given before a drop maps the memory dropped
        self._known = threading.Condition()  # guards the five below, filled by the event thread
        self._verified: dict[tuple[str, int], int] = {}  # (package, block) -> bytes verified from its start
        self._complete: dict[str, set[int]] = {}  # package -> its verified blocks
        self._dropped: set[str] = set()  # packages the agent dropped, none of their blocks verified since
        self._stream: socket.socket | None = None
        #: The agent process whose events the stream brings (:func:`_process`; None: not told): memory another one
        #: answers is not what those events say is verified.
        self._stream_agent: tuple[int, int] | None = None
        #: Event streams followed afresh (_follow_afresh; under _known and _lock): memory mapped before another
        #: was the agent's before, whose verified blocks the new stream does not speak of.
        self._generation = 0
        self._stream_error: str | None = None

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self._connect_timeout_s)
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            raise LocalApiError(f"no agent at {self.socket_path} ({exc.strerror or exc})") from None
        return sock

    def _open(self) -> tuple[socket.socket, BinaryIO]:
        sock = self._connect()
        return sock, sock.makefile("rb")

    def _call(self, request: dict, timeout: float, fields: Mapping[str, type] | None = None) -> dict:
        """The agent's answer to ``request``, an ok one holding each of ``fields`` as its type (an agent of another
        version may answer otherwise: :class:`LocalApiError`, not a KeyError); else the error it answered."""
        _check_timeout(timeout)
        start = self._start()  # an interrupt of its scope from now on ends this request, its retry included
        for fresh in (False, True):
            sock, lines, reused = self._checkout(fresh, start)
            line, failure = b"", None
            try:
                sock.settimeout(timeout + CLIENT_SLACK_S)
                sock.sendall(json.dumps(request).encode() + b"\n")
                line = lines.readline()
            except OSError as exc:
                failure = exc
            finally:
                closed = self._checkin(sock, lines, answered=bool(line))
            # A connection kept from an earlier request that fails unanswered is one to an agent since gone (restarted
            # on the same socket, say): asked again once on a new one. The requests are reads, safe to ask twice.
            if line or closed or not reused or isinstance(failure, TimeoutError) or _interrupted(start):
                break
        if not line:
            if closed:  # close() shut the connection down under the request
                raise self._closed_error()
            if isinstance(failure, TimeoutError):
                raise LocalApiTimeoutError(f"agent at {self.socket_path} did not answer {request['op']} "
                                           f"within {timeout + CLIENT_SLACK_S:g} s")
            if failure is not None:
                raise LocalApiError(f"agent at {self.socket_path}: {failure.strerror or failure}")
            raise LocalApiError(f"agent at {self.socket_path} closed the connection")
        answer = self._decode(line)
        if not answer.get("ok"):
            error = (PackageDroppedError if answer.get("dropped") else
                     LocalApiTimeoutError if answer.get("timeout") else LocalApiError)
            raise error(f"agent at {self.socket_path}: {answer.get('error')}")
        for name, kind in (fields or {}).items():
            value = answer.get(name)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise LocalApiError(f"agent at {self.socket_path} answered {request['op']} without a {name} of the "
                                    f"right kind ({kind.__name__}): {str(value)[:40]!r}")
        return answer

    def _start(self) -> tuple[RequestScope, int]:
        """The scope of a request this thread starts now, and its interrupts so far (:func:`_interrupted`)."""
        scope = _SCOPE.get()
        with self._lock:
            return scope, scope.interrupts

    def _checkout(self, fresh: bool, start: tuple[RequestScope, int]) -> tuple[socket.socket, BinaryIO, bool]:
        """A connection for one request (a new one with ``fresh``), in use until :meth:`_checkin`: :meth:`close`
        and :meth:`interrupt` of its scope meanwhile shut it down (an interrupt since the request's ``start``
        ends it here); and whether it was kept from an earlier request."""
        with self._lock:
            if self._closed:
                raise self._closed_error()
            if _interrupted(start):
                raise self._interrupted_error()
            connection = self._idle.pop() if self._idle and not fresh else None
        sock, lines = connection or self._open()
        with self._lock:
            interrupted = _interrupted(start)
            if not self._closed and not interrupted:  # else closed or interrupted while it connected: unseen
                self._busy[sock] = start[0]
                return sock, lines, connection is not None
        if interrupted and not self._closed:
            self._checkin(sock, lines, answered=connection is not None)  # a kept one is still in step
            raise self._interrupted_error()
        lines.close()
        sock.close()
        raise self._closed_error()

    def _checkin(self, sock: socket.socket, lines: BinaryIO, answered: bool) -> bool:
        """Done with a connection: kept for the next request if it ``answered`` (else it is out of step or gone)
        and the client is open; whether the client is closed."""
        with self._lock:
            self._busy.pop(sock, None)
            closed = self._closed
            keep = answered and not closed
            if keep:
                self._idle.append((sock, lines))
        if not keep:
            lines.close()
            sock.close()
        return closed

    def _closed_error(self) -> LocalApiError:
        return LocalApiError(f"agent at {self.socket_path}: the client is closed")

    def _interrupted_error(self) -> LocalApiError:
        return LocalApiError(f"agent at {self.socket_path}: the request was interrupted")

    def _decode(self, line: bytes) -> dict:
        try:
            return loads_object(line)
        except JSONInputError as exc:
            raise LocalApiError(f"agent at {self.socket_path} answered something that is not a JSON object: "
                                f"{exc}") from None

    def manifest(self, package_id: str | None = None, timeout: float = 30.0) -> Manifest:
        """The package's manifest (waits until the agent has it)."""
        answer = self._call({"op": "manifest", "package": package_id, "timeout": timeout}, timeout,
                            {"manifest": dict})
        return manifest_from_json(json.dumps(answer["manifest"]), where=f"agent at {self.socket_path}")

    def wait_block(self, index: int, timeout: float, package_id: str | None = None) -> memoryview:
        """Block ``index``'s bytes once verified: a read-only view of the agent's own memory (no copy).

        Raises :class:`LocalApiTimeoutError` (a ``TimeoutError``) if not verified within ``timeout``,
        :class:`PackageDroppedError` once the agent drops the package.
        """
        _check_timeout(timeout)
        started = time.monotonic()
        mapped = self._buffer(index, package_id, timeout)
        self._await(mapped.package, index, mapped.size, timeout, started, f"block {index} not verified",
                    mapped.generation)
        return self._view(mapped, index, timeout)

    def wait_prefix(self, index: int, nbytes: int, timeout: float, package_id: str | None = None) -> memoryview:
        """The first ``nbytes`` bytes of block ``index`` once verified (chunk by chunk), while the rest of
        the block may still be arriving: a read-only view (no copy) of every byte verified from the block's
        start by then, so at least ``nbytes``.

        Raises :class:`LocalApiTimeoutError` (a ``TimeoutError``) if not verified within ``timeout``,
        :class:`PackageDroppedError` once the agent drops the package.
        """
        _check_timeout(timeout)
        started = time.monotonic()
        mapped = self._buffer(index, package_id, timeout)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 < nbytes <= mapped.size:
            raise LocalApiError(f"agent at {self.socket_path}: block {index} has {mapped.size} bytes: no prefix of "
                                f"{nbytes!r}")
        verified = self._await(mapped.package, index, nbytes, timeout, started,
                               f"the first {nbytes} bytes of block {index} not verified", mapped.generation)
        return self._view(mapped, index, timeout)[:verified]

    def _view(self, mapped: "_Mapped", index: int, timeout: float) -> memoryview:
        """A view of ``mapped``'s memory, block ``index``'s (under the lock :meth:`close` and :meth:`unmap` unmap
        under: taken before, or never); a :class:`LocalApiError` where it was mapped from the agent before a restart
        (its bytes are not the ones the event stream now says are verified: one half written would read as zeros)."""
        with self._lock:
            if self._closed:
                raise self._closed_error()
            if mapped.generation != self._generation:
                raise self._restarted_error()
            if not mapped.memory.closed:
                return memoryview(mapped.memory)
        # unmap() let it go meanwhile (another model of its package closed): mapped again, for this wait
        return self._view(self._buffer(index, mapped.package, timeout), index, timeout)

    def _restarted_error(self, why: str = "its event stream ended") -> LocalApiError:
        return LocalApiError(f"agent at {self.socket_path}: the agent restarted meanwhile ({why}): memory mapped "
                             "before is not the memory it now verifies")

    def verified_bytes(self, index: int, package_id: str | None = None) -> int:
        """Bytes of block ``index`` verified from its start by now, as the agent's events told (no wait)."""
        package = self._package(package_id)
        self._watch()
        with self._known:
            return self._verified.get((package, index), 0)

    def verified_blocks(self, package_id: str | None = None) -> set[int]:
        """The blocks of the package verified by now, as the agent's events told (no request once the
        event stream runs)."""
        package = self._package(package_id)
        self._watch()
        with self._known:
            return set(self._complete.get(package, ()))

    def map_ahead(self, index: int, package_id: str | None = None, timeout: float = 30.0) -> None:
        """Map block ``index``'s buffer now, verified or not, so that :meth:`wait_block` finds it mapped.

        Call it while the block is in flight: the page-table set-up then happens during the transfer
        instead of between the block's verification and its first use. Nothing is read from it here.
        """
        _check_timeout(timeout)  # a block mapped already asks the agent nothing, which checks it too
        self._buffer(index, package_id, timeout)

    def _package(self, package_id: str | None) -> str:
        return package_id if package_id is not None else self.manifest(None).package_id

    def _buffer(self, index: int, package_id: str | None, timeout: float) -> "_Mapped":
        """Block ``index``'s buffer, mapped (one request the first time; the agent checks the block).

        :class:`PackageDroppedError` at once for a package the agent dropped: the agent would wait for it
        until the request's timeout.
        """
        # Mapped only while an event stream runs (followed afresh first, where one ended): a restart then ends it
        # and makes the mapping an older generation's, which no wait hands out.
        self._watch()
        with self._lock:
            generation = self._generation
        if package_id is not None:
            self._raise_if_dropped(package_id, f"block {index} not verified")
            with self._lock:  # as close() unmaps: a mapping it closed is not found here
                mapped = self._maps.get((package_id, index))
                if mapped is not None:
                    return _Mapped(package_id, mapped, len(mapped), generation)
        with self._lock:
            drops = self._drops
        try:
            answer = self._call({"op": "buffer", "block": index, "package": package_id,
                                 "timeout": min(timeout, DEFAULT_REQUEST_TIMEOUT_S)}, timeout,
                                {"package": str, "block": int, "path": str, "bytes": int})
        except LocalApiTimeoutError:
            if package_id is not None:  # dropped while the agent waited for it: say so, not "timed out"
                self._raise_if_dropped(package_id, f"block {index} not verified")
            raise
        with self._known:
            if not self._dropped_since(drops, answer["package"]):
                self._dropped.discard(answer["package"])  # the agent holds it (again)
        return _Mapped(answer["package"], self._map(answer, drops, generation), answer["bytes"], generation)

    def _dropped_since(self, drops: int, package: str) -> bool:
        """Whether ``package`` was dropped after the client had seen ``drops`` drops (an answer about it given
        before then names memory the agent has let go of)."""
        with self._known, self._lock:
            return self._drops != drops and package in self._dropped

    def _await(self, package: str, index: int, nbytes: int, timeout: float, started: float, what: str,
               generation: int) -> int:
        """Wait until the first ``nbytes`` of block ``index`` are verified, at most ``timeout`` from ``started``
        (the wait's start: its buffer request took part of it), in memory mapped in event stream ``generation``
        (another one's is another agent's: :class:`LocalApiError` at once); the bytes verified by then."""
        self._watch()
        deadline = started + timeout
        with self._known:
            # Checked before the bytes too: the new stream's events speak of the new agent's memory, not this one.
            while self._generation == generation and (verified := self._verified.get((package, index), 0)) < nbytes:
                if self._closed:  # close() ended the event stream
                    raise self._closed_error()
                if self._stream_error is not None:
                    raise LocalApiError(f"agent at {self.socket_path}: {self._stream_error}")
                self._raise_if_dropped(package, what)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LocalApiTimeoutError(f"agent at {self.socket_path}: {what} within {timeout:g} s")
                self._known.wait(left)
            if self._generation != generation:
                raise self._restarted_error()
        return verified

    def _raise_if_dropped(self, package: str, what: str) -> None:
        """:class:`PackageDroppedError` if the agent dropped ``package`` and has verified none of its blocks since."""
        with self._known:  # reentrant: _await holds it already
            if package in self._dropped:
                raise PackageDroppedError(f"agent at {self.socket_path}: package {package[:12]} was dropped there "
                                          f"({what})")

    def _watch(self) -> None:
        """Start following the agent's event stream (once; the first events are what it holds already)."""
        start = self._start()  # an interrupt of its scope from now on ends a subscription this starts
        with self._known:
            if self._closed:  # close() sets it before it ends the stream: none starts after it
                raise self._closed_error()
            if self._stream is not None and self._stream_error is None:
                return
            if _interrupted(start):  # while it waited for another thread's subscription
                raise self._interrupted_error()
            if self._stream is not None:
                self._follow_afresh()
            sock, lines = self._subscribe(self._connect_timeout_s)
            with self._lock:  # in flight as a request is: close() and interrupt() end a silent agent's wait
                if self._closed or _interrupted(start):
                    lines.close()
                    sock.close()
                    raise self._closed_error() if self._closed else self._interrupted_error()
                self._busy[sock] = start[0]
            try:
                answer = lines.readline()
                if not answer:
                    raise LocalApiError("it closed the connection")
                self._decode(answer)  # {"ok": true}: subscribed, past events follow
            except (OSError, LocalApiError) as exc:
                lines.close()  # the file holds the socket's descriptor too, for as long as the error is kept
                sock.close()
                if self._closed:
                    raise self._closed_error() from None
                if _interrupted(start):
                    raise self._interrupted_error() from None
                raise LocalApiError(f"agent at {self.socket_path}: cannot follow its events "
                                    f"({getattr(exc, 'strerror', None) or exc})") from None
            finally:
                with self._lock:
                    self._busy.pop(sock, None)
            sock.settimeout(None)  # an idle agent sends nothing; close() ends the wait
            self._stream, self._stream_agent = sock, _peer(sock)
        threading.Thread(target=self._follow, args=(sock, lines), name="pipecast-agent-events", daemon=True).start()

    def _follow_afresh(self) -> None:
        """The event stream ended (the agent restarted on its socket, say; the waits then under way failed with
        it): forget what it said, of memory that agent may have let go of, for a new stream to say again. Without
        this a client given to ``pipecast.load`` served no load again once its agent had restarted."""
        self._stream.close()
        self._stream, self._stream_error, self._stream_agent = None, None, None
        self._verified.clear()
        self._complete.clear()
        self._dropped.clear()
        with self._lock:
            self._generation += 1  # an answer given before, a mapping made before, are of the agent before
            self._maps.clear()  # mappings still viewed stay alive with their views
        self._known.notify_all()  # the waits on the stream that ended fail (another generation's memory)

    def _subscribe(self, timeout: float | None) -> tuple[socket.socket, BinaryIO]:
        """A connection of its own on which the agent's events will come (its answer not read yet)."""
        sock = self._connect()
        try:
            sock.settimeout(timeout)
            sock.sendall(b'{"op": "subscribe"}\n')
        except OSError as exc:
            sock.close()
            raise LocalApiError(f"agent at {self.socket_path}: {exc.strerror or exc}") from None
        return sock, sock.makefile("rb")

    def _follow(self, sock: socket.socket, lines) -> None:
        """Take the events of the stream on ``sock`` until it ends, or until it is no longer the client's (followed
        afresh: an event still buffered then is the agent's before, and would say verified of another's memory)."""
        error = "closed its event stream"
        try:
            while line := lines.readline():
                event = self._decode(line)
                key = (event.get("package"), event.get("block"))
                with self._known:
                    if self._stream is not sock:
                        return
                    if event.get("event") in ("block_verified", "prefix_verified"):
                        self._verified[key] = max(self._verified.get(key, 0), event["bytes"])
                        self._dropped.discard(key[0])
                    if event.get("event") == "block_verified":
                        self._complete.setdefault(key[0], set()).add(key[1])
                    if event.get("event") == "package_dropped":
                        self._forget(key[0])
                    self._known.notify_all()
        except (OSError, ValueError, KeyError, TypeError, LocalApiError) as exc:
            error = f"its event stream failed ({type(exc).__name__}: {exc})"
        finally:
            with self._known:
                if self._stream is sock:
                    self._stream_error = error
                    self._known.notify_all()

    def _forget(self, package: str) -> None:
        """The agent dropped ``package``: its waits fail, and should it hold the package again, that is new memory
        whose blocks are verified afresh (the old mappings stay alive while views of them do)."""
        self._dropped.add(package)
        self._complete.pop(package, None)
        for key in [key for key in self._verified if key[0] == package]:
            del self._verified[key]
        with self._lock:
            self._drops += 1
            for key in [key for key in self._maps if key[0] == package]:
                del self._maps[key]

    def _map(self, answer: dict, drops: int, generation: int) -> mmap.mmap:
        """The block ``answer`` names, mapped (once per block); :class:`PackageDroppedError` where its package was
        dropped after the client had seen ``drops`` drops (before the answer): the memory is the dropped one's,
        a block of which may have been still arriving (its unwritten pages read as zeros); :class:`LocalApiError`
        where the event stream was followed afresh since ``generation`` (the answer may be the agent's before)."""
        key = (answer["package"], answer["block"])
        with self._lock:
            mapped = self._maps.get(key)
        if mapped is None:
            try:
                fd = os.open(answer["path"], os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:  # the agent's memfd is /proc/<its pid>/fd/<n>
                raise LocalApiError(f"agent at {self.socket_path}: cannot open block {key[1]}'s memory at "
                                    f"{answer['path']} ({exc.strerror or exc}): an engine must run as the agent's "
                                    "user and see its processes (the same pid namespace)") from None
            try:
                # MAP_POPULATE: every page table entry now (mmap runs without the GIL), none faulted in
                # during the prefill that first reads the block (measured ~0.6 ms/MB of first touches).
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                mapped = mmap.mmap(fd, answer["bytes"], flags=flags, prot=mmap.PROT_READ)
            except (OSError, ValueError) as exc:
                raise LocalApiError(f"agent at {self.socket_path}: cannot map block {key[1]}'s memory at "
                                    f"{answer['path']} ({exc})") from None
            finally:
                os.close(fd)
            match = _MEMORY_PATH.fullmatch(answer["path"])
            owner = _process(int(match.group(1))) if match else None
            with self._known, self._lock:  # as _forget takes them: a drop is seen whole, before or after
                # Another agent's memory than the stream speaks of: the agent restarted and the stream has not
                # ended yet (its end not read), or ended since the answer.
                other = owner is not None and self._stream_agent is not None and owner != self._stream_agent
                restarted = generation != self._generation or other
                if other and self._stream_error is None:  # the stream is the agent's before: followed afresh next
                    self._stream_error = "another agent process answers on its socket"
                    _shut_down(self._stream)
                    self._known.notify_all()
                stale = self._drops != drops and key[0] in self._dropped
                kept = None if stale or restarted else self._maps.setdefault(key, mapped)
            if kept is not mapped:
                mapped.close()  # the dropped memory, or another thread mapped the block meanwhile: use that one
            if restarted:
                raise self._restarted_error("another agent process answers on its socket" if other else
                                            "its event stream ended")
            if stale:
                raise PackageDroppedError(f"agent at {self.socket_path}: package {key[0][:12]} was dropped there "
                                          f"(block {key[1]} not verified)")
            mapped = kept
        return mapped

    def package_file(self, path: str, package_id: str | None = None, timeout: float = 30.0) -> bytes:
        """A small package file (config.json, tokenizer files), verified by the agent."""
        answer = self._call({"op": "file", "path": path, "package": package_id, "timeout": timeout}, timeout,
                            {"data": str})
        try:
            return base64.b64decode(answer["data"], validate=True)
        except ValueError:  # binascii.Error
            raise LocalApiError(f"agent at {self.socket_path} answered file {path} with data that is not base64") \
                from None

    def progress(self, package_id: str | None = None, timeout: float = 30.0) -> StoreProgress:
        """What the agent holds of the package: per block, chunks present and when it was verified."""
        data = self._call({"op": "progress", "package": package_id, "timeout": timeout}, timeout,
                          {"progress": dict})["progress"]
        try:
            blocks = tuple(BlockProgress(**b) for b in data.pop("blocks"))
            return StoreProgress(**data, blocks=blocks)
        except (KeyError, TypeError):  # a field missing or of another version
            raise LocalApiError(f"agent at {self.socket_path} answered progress of another shape: "
                                f"{str(data)[:80]!r}") from None

    def status(self) -> dict:
        """The agent's state: node, address, bytes moved, and every package it holds with its goodput."""
        return self._call({"op": "status"}, 0.0, {"status": dict})["status"]

    def serving_key(self, timeout: float = 30.0) -> bytes:
        """The key requests to this cluster's serving workers present (b"": auth off), once the agent knows
        its cluster credentials; :class:`LocalApiTimeoutError` if it does not within ``timeout``."""
        value = self._call({"op": "serving_key", "timeout": timeout}, timeout, {"serving_key": str})["serving_key"]
        try:
            return bytes.fromhex(value)
        except (TypeError, ValueError):
            raise LocalApiError(f"the agent answered a malformed serving key: {str(value)[:40]!r}") from None

    def events(self, timeout: float | None = None) -> Iterator[dict]:
        """The agent's block events (``block_verified``, ``prefix_verified``; past ones first), on a connection
        of their own.

        ``timeout`` bounds the wait for each event (:class:`LocalApiTimeoutError`); None waits forever.
        """
        if timeout is not None:
            _check_timeout(timeout)
        sock, lines = self._subscribe(timeout)
        try:
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
        """Close the connections and unmap the blocks (views still held keep their mapping alive); a request or
        wait in flight ends with :class:`LocalApiError` (the client is closed)."""
        with self._lock:
            self._closed = True  # first: no request, wait or event stream starts from now on
            for sock in self._busy:  # its request's thread closes it, once its read or write ends; before the
                _shut_down(sock)     # lock below, which a subscription waiting on a silent agent holds
        with self._known:
            if self._stream is not None:
                _shut_down(self._stream)  # ends the event thread's read
                self._stream.close()
        with self._lock:
            for mapped in self._maps.values():
                try:
                    mapped.close()
                except BufferError:
                    pass  # a caller still holds a view (a tensor): the mapping goes when that view does
            self._maps.clear()
            for sock, lines in self._idle:
                lines.close()
                sock.close()
            self._idle.clear()

    def unmap(self, package_id: str) -> None:
        """Unmap the package's blocks (views still held keep their mapping alive), the client staying open: what a
        model loaded through a client others share calls as it closes, once its weights are dropped (else a
        long-lived client kept every package it ever served mapped). A wait for a block later maps it again."""
        with self._lock:
            for key in [key for key in self._maps if key[0] == package_id]:
                try:
                    self._maps.pop(key).close()
                except BufferError:
                    pass  # a caller still holds a view (a tensor): the mapping goes when that view does

    def interrupt(self, scope: RequestScope) -> None:
        """End ``scope``'s requests in flight now (each raises :class:`LocalApiError`), the client staying open and
        other scopes' requests going on: what a model closing while its loader waits on a silent agent calls, so
        that its loader thread ends at once, and the other models loading through the same client go on."""
        with self._lock:
            scope.interrupts += 1  # a request it ends is not asked again
            for sock, owner in self._busy.items():
                if owner is scope:
                    _shut_down(sock)  # its request's thread closes it, once its read or write ends

    def __enter__(self) -> "LocalAgentClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_timeout(value: object) -> bool:
    """Whether ``value`` is a number of seconds from 0 to ``MAX_TIMEOUT_S``, what the agent's waits take (NaN spun a
    wait on the events for ever, an infinite or huge one overflowed the timers). Compared, not passed to
    math.isfinite, which overflows on an integer of hundreds of digits; NaN fails the comparison."""
    return not isinstance(value, bool) and isinstance(value, int | float) and 0 <= value <= MAX_TIMEOUT_S


def _interrupted(start: tuple[RequestScope, int]) -> bool:
    """Whether the scope of a request started at ``start`` (:meth:`LocalAgentClient._start`) was interrupted since."""
    scope, interrupts = start
    return scope.interrupts != interrupts


def _check_timeout(timeout: object) -> None:
    """:class:`LocalApiError` unless :func:`is_timeout`."""
    if not is_timeout(timeout):
        raise LocalApiError(f"timeout must be a number of seconds from 0 to {MAX_TIMEOUT_S:g}, got {timeout!r}")


#: Where the agent answers a block's memory is: its own descriptor, ``/proc/<its pid>/fd/<n>``.
_MEMORY_PATH = re.compile(r"/proc/([0-9]+)/fd/[0-9]+")


def _process(pid: int | None) -> tuple[int, int] | None:
    """Process ``pid`` told apart from any other ever given its pid: (pid, start in clock ticks since boot); None
    where it is gone or cannot be read (another pid namespace's peer is pid 0)."""
    ticks = start_ticks(pid) if pid else None
    return None if ticks is None else (pid, ticks)


def _peer(sock: socket.socket) -> tuple[int, int] | None:
    """The process at the other end of the local socket ``sock`` (:func:`_process`), None where not told."""
    try:
        pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except (OSError, AttributeError):  # not Linux
        return None
    return _process(pid)


def _shut_down(sock: socket.socket) -> None:
    """End every read and write on ``sock`` now, another thread's included (closing it would not wake that one)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected any more

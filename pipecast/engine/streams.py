"""Tokens of one request, handed from the engine thread to a consumer that iterates, blocking or async.

The engine calls :meth:`TokenStream.push`, :meth:`~TokenStream.finish` or :meth:`~TokenStream.fail`; a
consumer iterates with ``for`` (blocking) or ``async for`` (woken through its event loop, no thread per
waiter), or waits for the whole answer with :meth:`~TokenStream.result`.
"""

import asyncio
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipecast.engine.sampling import SamplingParams

FINISH_STOP = "stop"          # a stop token was generated (it is the last token)
FINISH_LENGTH = "length"      # max_tokens reached
FINISH_CANCELLED = "cancelled"


class TokenStream:
    """The generated token ids of one request, as they come. One consumer reads it."""

    def __init__(self, request_id: int, on_cancel: Callable[["TokenStream"], None]):
        self.request_id = request_id
        self._on_cancel = on_cancel
        self._cond = threading.Condition()
        self._tokens: list[int] = []
        self._read = 0
        self._finish_reason: str | None = None
        self._error: BaseException | None = None
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._on_end: list[Callable[[], None]] = []

    # --- engine side ---------------------------------------------------------------------------------

    def push(self, token: int) -> None:
        """Append a generated token (engine thread)."""
        with self._cond:
            self._tokens.append(token)
        self._wake()

    def finish(self, reason: str) -> None:
        """End the stream normally (engine thread)."""
        with self._cond:
            if self._finish_reason is None and self._error is None:
                self._finish_reason = reason
        self._wake()

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error``, raised to the consumer after the tokens already out. ``error`` must be
        this stream's own, shared with no other: each raise gives it the consumer's traceback."""
        with self._cond:
            if self._finish_reason is None and self._error is None:
                self._error = error
        self._wake()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()
            waiters, self._async_waiters = self._async_waiters, []
            ended, self._on_end = (self._on_end, []) if self.done else ([], self._on_end)
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the consumer's loop is closed: nobody is waiting any more
                pass
        for callback in ended:
            callback()

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once the stream has ended, however far its consumer has read (at once if it has
        ended): from the thread that ends it, the engine's, so it must be thread-safe and must not raise."""
        with self._cond:
            if not self.done:
                self._on_end.append(callback)
                return
        callback()

    # --- consumer side -------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """True once the stream has ended (finished, cancelled or failed)."""
        with self._cond:
            return self._finish_reason is not None or self._error is not None

    @property
    def finish_reason(self) -> str | None:
        """``stop``, ``length`` or ``cancelled`` once finished normally; None before (or on failure)."""
        with self._cond:
            return self._finish_reason

    @property
    def tokens(self) -> list[int]:
        """Every token generated so far."""
        with self._cond:
            return list(self._tokens)

    def cancel(self) -> None:
        """Stop generating (e.g. the client went away); the stream then ends with ``cancelled``."""
        self._on_cancel(self)

    def result(self, timeout: float | None = None) -> list[int]:
        """Wait for the end and return every token; raise the request's error, or TimeoutError."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._finish_reason is not None or self._error is not None,
                                       timeout):
                raise TimeoutError(f"request {self.request_id} not finished within {timeout:g} s")
            if self._error is not None:
                raise self._raised()
            return list(self._tokens)

    def _raised(self) -> BaseException:
        """The stream's error, with no traceback: a raise adds its frames to the one it has, so each raise (a
        second ``result()``, a retried iteration) would grow it and keep the frames of the ones before alive."""
        return self._error.with_traceback(None)

    def _take(self) -> tuple[bool, int | None]:
        """(True, token) if one is unread; (True, None) at the end; (False, None) if none yet."""
        if self._read < len(self._tokens):
            self._read += 1
            return True, self._tokens[self._read - 1]
        if self._error is not None:
            raise self._raised()
        return (True, None) if self._finish_reason is not None else (False, None)

    def __iter__(self) -> "TokenStream":
        return self

    def __next__(self) -> int:
        with self._cond:
            while True:
                ready, token = self._take()
                if ready:
                    if token is None:
                        raise StopIteration
                    return token
                self._cond.wait()

    def __aiter__(self) -> "TokenStream":
        return self

    async def __anext__(self) -> int:
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                ready, token = self._take()
                if not ready:
                    event = asyncio.Event()
                    self._async_waiters.append((loop, event))
            if ready:
                if token is None:
                    raise StopAsyncIteration
                return token
            await event.wait()

    async def aclose(self) -> None:
        """Cancel the request (for ``contextlib.aclosing`` and servers whose client disconnected)."""
        self.cancel()


def emit(stream: TokenStream, token: int, generated: int, params: "SamplingParams") -> bool:
    """Hand ``token``, the ``generated``-th of its request, to ``stream`` and end the stream if ``params``
    say so; True if the request is finished with it."""
    stream.push(token)
    reason = params.finish_reason(token, generated)
    if reason is not None:
        stream.finish(reason)
    return reason is not None

"""Progress of long commands: a bar where stderr is a terminal, plain lines (or nothing) anywhere else.

A command hands the work it runs (pack, verify, a benchmark) one :class:`Progress`. The work describes
itself: :meth:`Progress.start` with its total, :meth:`~Progress.advance`, :meth:`~Progress.status`, and
lines by calling it. The command decides the medium: where lines go, and the terminal a bar may be drawn
on. A bar is drawn only if that stream is a terminal, so pipes, log files and tests' captured output get
the lines alone, byte for byte as before.
"""

import sys
from collections.abc import Callable
from typing import Any, TextIO

#: Where a task's lines go, one call per line (``click.echo``, ``print``, ...).
LineSink = Callable[[str], None]


class Progress:
    """Where a long task reports how far it is.

    ``lines`` receives the task's lines (None: they are dropped). ``terminal`` is the stream a bar is drawn
    on if it is a terminal (``isatty()``); otherwise there is no bar. ``Progress()`` reports nothing.
    Use it as a context manager, or :meth:`close` it, so that a bar ends on its own line.
    """

    def __init__(self, lines: LineSink | None = None, *, terminal: TextIO | None = None) -> None:
        self._lines = lines
        self._terminal = terminal if terminal is not None and terminal.isatty() else None
        self._bar: Any = None

    @classmethod
    def on_stderr(cls, lines: LineSink | None = None) -> "Progress":
        """A bar on stderr when stderr is a terminal; ``lines`` otherwise (and for lines the task writes)."""
        return cls(lines, terminal=sys.stderr)

    @property
    def draws_bar(self) -> bool:
        """Whether :meth:`start` draws a bar (the terminal given is one)."""
        return self._terminal is not None

    def __call__(self, line: str) -> None:
        """Write one line of output (shown with or without a bar; above the bar while there is one)."""
        if self._lines is None:
            return
        if self._bar is None:
            self._lines(line)
            return
        with self._bar.external_write_mode(file=self._terminal):
            self._lines(line)

    def start(self, total: float, desc: str, *, unit: str = "it", byte_units: bool = False) -> None:
        """Begin a bar of ``total`` units named ``desc`` (ending any bar before it); ``byte_units``: the
        units are bytes, shown as KiB, MiB, ... Without a terminal this does nothing."""
        if self._terminal is None:
            return
        from tqdm import tqdm  # only where a bar is drawn

        self.close()
        self._bar = tqdm(total=total, desc=desc, unit="B" if byte_units else unit, unit_scale=byte_units,
                         unit_divisor=1024, file=self._terminal, dynamic_ncols=True)

    def advance(self, n: float = 1) -> None:
        """Move the bar ``n`` units on (nothing without a bar)."""
        if self._bar is not None:
            self._bar.update(n)

    def status(self, text: str) -> None:
        """Say what the task is doing now: beside the bar while there is one, else as a line."""
        if self._bar is None:
            self(text)
        else:
            self._bar.set_postfix_str(text)

    def close(self) -> None:
        """End the bar, leaving it on screen as it stands (idempotent)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Reports nothing: the default of functions that take a :class:`Progress` (it holds no state).
NO_PROGRESS = Progress()

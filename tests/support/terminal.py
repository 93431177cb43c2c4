"""Terminals for progress bars (:mod:`pipecast.core.progress` draws one only on a terminal): a stream that
says it is one, and running ``pipecast`` with its stderr on a pseudo-terminal."""

import fcntl
import io
import os
import pty
import select
import struct
import subprocess
import sys
import termios

from tests.support import REPO


class Terminal(io.StringIO):
    """Text written to a terminal, kept in memory."""

    def isatty(self) -> bool:
        return True


def run_on_a_terminal(argv: list[str], timeout_s: float = 120.0) -> tuple[int, str, str]:
    """Run ``pipecast ARGV`` with its stderr on a pseudo-terminal of 100 columns (a terminal of 0 columns
    gets an empty bar); return its exit code, its stdout and what it drew on the terminal."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "pipecast.cli", *argv], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=terminal)
    os.close(terminal)
    drawn = b""
    try:
        while select.select([controller], [], [], timeout_s)[0]:
            chunk = os.read(controller, 65536)
            if not chunk:
                break
            drawn += chunk
    except OSError:  # EIO: the child closed the last end of the terminal
        pass
    finally:
        os.close(controller)
    stdout = proc.communicate(timeout=timeout_s)[0].decode()
    return proc.returncode, stdout, drawn.decode(errors="replace")

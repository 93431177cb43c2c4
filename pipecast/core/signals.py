"""The signals that stop a long-running server gracefully, shared by every server's event loop (agent, serve,
router, control plane, scaler): each drains on them instead of dying mid-request."""

import asyncio
import signal
from collections.abc import Callable

#: SIGTERM (a service manager's stop), SIGINT (Ctrl-C) and SIGHUP (the terminal or ssh session that started the
#: server closed): each stops a server with its drain.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def on_stop_signals(loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> list[int]:
    """Call ``callback`` on ``loop`` when any of :data:`STOP_SIGNALS` arrives, and return the signals handled.

    A SIGHUP ignored when the server starts (``nohup``) stays ignored: the operator asked the server to outlive its
    terminal. SIGTERM and SIGINT are handled whatever their disposition (a shell starts background jobs with SIGINT
    ignored, and scripts stop them with it)."""
    handled = []
    for signum in STOP_SIGNALS:
        if signum == signal.SIGHUP and signal.getsignal(signum) == signal.SIG_IGN:
            continue
        loop.add_signal_handler(signum, callback)
        handled.append(signum)
    return handled

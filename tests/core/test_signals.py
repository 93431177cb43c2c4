"""The signals every server drains on (pipecast/core/signals.py)."""

import asyncio
import os
import signal

import pytest

from pipecast.core.signals import STOP_SIGNALS, on_stop_signals


@pytest.fixture
def dispositions():
    """Each stop signal's disposition before the test, put back after it."""
    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("signum", STOP_SIGNALS, ids=lambda s: signal.Signals(s).name)
async def test_each_stop_signal_calls_back_on_the_loop_instead_of_killing_the_process(dispositions, signum):
    """Found in review: SIGHUP (a closed terminal or ssh session) stopped every server at once, without the drain
    that SIGTERM gets."""
    loop = asyncio.get_running_loop()
    stopped = asyncio.Event()
    assert on_stop_signals(loop, stopped.set) == list(STOP_SIGNALS)
    try:
        os.kill(os.getpid(), signum)
        await asyncio.wait_for(stopped.wait(), 5)
    finally:
        for each in STOP_SIGNALS:
            loop.remove_signal_handler(each)


async def test_a_sighup_ignored_at_start_stays_ignored_as_nohup_asks(dispositions):
    loop = asyncio.get_running_loop()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    stopped = asyncio.Event()
    assert on_stop_signals(loop, stopped.set) == [signal.SIGTERM, signal.SIGINT]
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        await asyncio.sleep(0.2)
        assert not stopped.is_set() and signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        for each in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(each)

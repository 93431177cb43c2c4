"""A pack stopped by SIGTERM (what ``timeout``, systemd and Kubernetes send) or SIGHUP (a closed terminal) leaves
nothing, as on Ctrl-C."""

import fcntl
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.tiny_checkpoints import write_random_checkpoint

BLOCKS = 300  # their progress lines (~40 bytes each) overfill a one-page pipe: the pack cannot end unread


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_mid_pack_removes_the_partial_folder(tmp_path, signum):
    """Finding 3: SIGTERM killed `pipecast pack` at once, leaving its hidden .OUT.partial-PID folder beside OUT (and
    SIGHUP, a later review: an ssh session dropped mid-pack)."""
    write_random_checkpoint(tmp_path / "ck", BLOCKS, 1024)
    out = tmp_path / "out"
    pack = subprocess.Popen([sys.executable, "-m", "pipecast.cli", "pack", tmp_path / "ck", out,
                             "--layers-per-block", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        fcntl.fcntl(pack.stderr.fileno(), fcntl.F_SETPIPE_SZ, 4096)  # before the child writes its first line
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".out.partial-*")):
            assert pack.poll() is None and time.monotonic() < deadline, "the pack never started its folder"
            time.sleep(0.02)
        pack.send_signal(signum)
        _, err = pack.communicate(timeout=60)
    finally:
        pack.kill()
        pack.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no package, no partial folder
    assert pack.returncode == 128 + signum  # as a shell reports a death by that signal
    assert err.decode().endswith("terminated\n")

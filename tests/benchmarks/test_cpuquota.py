"""Per-worker CPU quotas of the emulated cluster: a process moved under its own CFS quota, or a clear reason why not."""

import subprocess
import sys

import pytest

from benchmarks.cpuquota import PERIOD_US, open_quotas


def test_no_quota_asked_is_inactive_and_says_so():
    quotas = open_quotas(None)
    assert not quotas.active and quotas.description == "no CPU quota per worker (not asked)"
    quotas.limit(1)  # nothing happens
    quotas.close()


def test_a_limited_process_sits_in_a_group_of_its_own_with_the_quota():
    quotas = open_quotas(0.25)
    if not quotas.active:
        pytest.skip(quotas.description)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        quotas.limit(child.pid)
        [group] = quotas._groups
        assert str(child.pid) in (group / "cgroup.procs").read_text().split()
        quota_file = group / "cpu.max" if (group / "cpu.max").exists() else group / "cpu.cfs_quota_us"
        assert quota_file.read_text().split()[0] == str(int(0.25 * PERIOD_US))
        assert group.name in open(f"/proc/{child.pid}/cgroup").read()
    finally:
        child.kill()
        child.wait()
        quotas.close()
    assert not group.exists()

"""Per-worker CPU quotas of the emulated cluster: a process moved under its own CFS quota, or a clear reason why not."""

import subprocess
import sys

import pytest
from click.testing import CliRunner

from benchmarks.command import bench_group
from benchmarks.cpuquota import MIN_CORES, PERIOD_US, CpuQuotaError, CpuQuotas, open_quotas


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


def test_a_quota_below_the_kernels_smallest_is_refused_before_any_process_starts():
    # The kernel refuses a CFS quota under 1 ms (EINVAL): 0.01 CPU at a 100 ms period.
    assert MIN_CORES == 0.01
    with pytest.raises(CpuQuotaError, match=r"^a CPU quota of 0\.005 CPU is below the smallest the kernel takes: "
                                            r"0\.01 CPU \(1000 us per 100000 us\)$"):
        open_quotas(0.005)


def test_a_group_that_cannot_be_made_is_an_error_naming_the_quota(tmp_path):
    quotas = CpuQuotas(tmp_path / "gone", 0.5)
    with pytest.raises(CpuQuotaError, match=r"^cannot put process 123 under a CPU quota of 50000 us per 100000 us "
                                            r"\(0\.5 CPU\) in .*/gone/pipecast-\w+: No such file or directory$"):
        quotas.limit(123)


@pytest.mark.parametrize("command", ["surge", "pipelines"])
def test_worker_cpus_below_the_kernels_smallest_quota_are_refused(command, tmp_path):
    result = CliRunner().invoke(bench_group, [command, "--worker-cpus", "0.005", "--package", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert ("Invalid value for '--worker-cpus': 0.005 is below the smallest CPU quota the kernel takes, 0.01 CPU "
            "(1000 us per 100000 us period); 0: no quota") in result.output


@pytest.mark.parametrize("command, workers", [("surge", "--workers"), ("pipelines", "--receivers")])
def test_a_default_quota_below_the_kernels_smallest_is_refused(command, workers, monkeypatch, tmp_path):
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    result = CliRunner().invoke(bench_group, [command, workers, "101", "--package", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert (f"Invalid value for '--worker-cpus': the default, 1 cores / {workers} 101 = 0.00990099 CPU per worker, "
            "is below the smallest CPU quota the kernel takes (0.01 CPU): give --worker-cpus 0 (no quota) or fewer "
            "workers") in result.output

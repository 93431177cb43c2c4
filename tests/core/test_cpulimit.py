"""The CPU quota a process runs under, read from cgroup files (v1 and v2) laid out in a temporary folder."""

from pipecast.core.cpulimit import cpu_limit


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_v1_cfs_quota_is_read_from_the_processs_own_cpu_group(tmp_path):
    cgroup = write(tmp_path / "self", "12:memory:/x\n4:cpu,cpuacct:/pipecast-abc\n0::/\n")
    write(tmp_path / "fs/cpu,cpuacct/pipecast-abc/cpu.cfs_quota_us", "25000\n")
    write(tmp_path / "fs/cpu,cpuacct/pipecast-abc/cpu.cfs_period_us", "100000\n")
    assert cpu_limit(cgroup, tmp_path / "fs") == 0.25
    write(tmp_path / "fs/cpu,cpuacct/pipecast-abc/cpu.cfs_quota_us", "-1\n")  # unlimited
    assert cpu_limit(cgroup, tmp_path / "fs") is None


def test_a_v2_cpu_max_is_read_and_max_means_unlimited(tmp_path):
    cgroup = write(tmp_path / "self", "0::/kubepods/pod1\n")
    write(tmp_path / "fs/kubepods/pod1/cpu.max", "150000 100000\n")
    assert cpu_limit(cgroup, tmp_path / "fs") == 1.5
    write(tmp_path / "fs/kubepods/pod1/cpu.max", "max 100000\n")
    assert cpu_limit(cgroup, tmp_path / "fs") is None


def test_no_cgroup_information_means_unknown(tmp_path):
    assert cpu_limit(tmp_path / "missing", tmp_path) is None
    assert cpu_limit(write(tmp_path / "self", "1:cpu:/\n"), tmp_path / "fs") is None  # no files: unknown

"""What a node says about itself when it registers (:mod:`pipecast.agent.host`): its reachable address and
its accelerator, probed with ``nvidia-smi``; and the memory it may take, read from fake /proc and cgroup files."""

import socket

from control_plane.messages import AcceleratorInfo
from pipecast.agent.host import HostMemory, advertised_address, detect_accelerator, host_memory

MIB = 1 << 20
MEMINFO = "MemTotal:       24000000 kB\nMemFree:        20000000 kB\nMemAvailable:   22000000 kB\n"


def test_a_wildcard_listen_address_is_advertised_by_host_name():
    assert advertised_address("10.0.0.5:7070") == "10.0.0.5:7070"
    assert advertised_address("0.0.0.0:7070") == f"{socket.gethostname()}:7070"
    assert advertised_address("[::1]:7070") == "[::1]:7070"


def test_a_cuda_node_registers_its_gpus_from_nvidia_smi(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA H200, 143771'\necho 'NVIDIA H200, 143771'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert detect_accelerator("cuda:0") == AcceleratorInfo("cuda", "NVIDIA H200", 2, 143771 << 20)
    assert detect_accelerator("cpu") == AcceleratorInfo("cpu")
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert detect_accelerator("cuda") == AcceleratorInfo("cuda")


def test_a_cuda_node_registers_the_gpu_its_device_names(tmp_path, monkeypatch):
    """Found in review: ``cuda:1`` registered the host's first GPU, whatever the second was."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA A100-SXM4-40GB, 40960'\necho 'NVIDIA H100 80GB HBM3, 81559'\n"
                    "echo 'NVIDIA L4, 23034'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert detect_accelerator("cuda:1") == AcceleratorInfo("cuda", "NVIDIA H100 80GB HBM3", 3, 81559 << 20)
    assert detect_accelerator("cuda").name == "NVIDIA A100-SXM4-40GB"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,1")  # torch's cuda:0 is the host's third GPU
    assert detect_accelerator("cuda:0").name == "NVIDIA L4"
    assert detect_accelerator("cuda:1").name == "NVIDIA H100 80GB HBM3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5a1c")  # a UUID: not told, the first
    assert detect_accelerator("cuda:0").name == "NVIDIA A100-SXM4-40GB"


def test_memory_is_the_least_of_meminfo_and_every_memory_cgroup_over_this_process():
    """Found in review: a --reserve was checked against --memory only, and in a 600 MiB cgroup the agent said
    "listening" and was then OOM-killed without a word. A cgroup v2 limit of an ancestor limits too."""
    files = {"/proc/meminfo": MEMINFO, "/proc/self/cgroup": "0::/pods/agent\n",
             "/sys/fs/cgroup/pods/agent/memory.max": "max\n", "/sys/fs/cgroup/pods/agent/memory.current": "5\n",
             "/sys/fs/cgroup/pods/memory.max": f"{600 * MIB}\n", "/sys/fs/cgroup/pods/memory.current": f"{50 * MIB}\n"}
    assert host_memory(files.get) == HostMemory(
        550 * MIB, "/sys/fs/cgroup/pods/memory.max less memory.current (less inactive_file)", 600 * MIB,
        "/sys/fs/cgroup/pods/memory.max")
    # page cache the kernel would reclaim first is no use (a worker in the pod read its model's files)
    cached = {**files, "/sys/fs/cgroup/pods/memory.current": f"{590 * MIB}\n",
              "/sys/fs/cgroup/pods/memory.stat": f"anon {40 * MIB}\nfile {550 * MIB}\ninactive_file {540 * MIB}\n"}
    assert host_memory(cached.get).available == 550 * MIB


def test_a_cgroup_v1_limit_counts_and_no_limit_is_none():
    v1 = {"/proc/meminfo": MEMINFO, "/proc/self/cgroup": "9:pids:/\n4:memory:/job/c55\n0::/\n",
          "/sys/fs/cgroup/memory/job/c55/memory.limit_in_bytes": f"{4096 * MIB}\n",
          "/sys/fs/cgroup/memory/job/c55/memory.usage_in_bytes": f"{1024 * MIB}\n"}
    assert host_memory(v1.get) == HostMemory(3072 * MIB, "/sys/fs/cgroup/memory/job/c55/memory.limit_in_bytes less "
                                             "memory.usage_in_bytes (less total_inactive_file)", 4096 * MIB,
                                             "/sys/fs/cgroup/memory/job/c55/memory.limit_in_bytes")
    # v1's "no limit" (LONG_MAX in pages), and a container whose cgroup path is the host's: the mount's own folder
    unlimited = {**v1, "/sys/fs/cgroup/memory/job/c55/memory.limit_in_bytes": "9223372036854771712\n"}
    assert host_memory(unlimited.get) == HostMemory(22000000 << 10, "MemAvailable in /proc/meminfo",
                                                    24000000 << 10, "MemTotal in /proc/meminfo")
    mounted = {"/proc/self/cgroup": "0::/kubepods/pod1\n", "/sys/fs/cgroup/memory.max": f"{MIB}",
               "/sys/fs/cgroup/memory.current": f"{2 * MIB}"}
    assert host_memory(mounted.get) == HostMemory(0, "/sys/fs/cgroup/memory.max less memory.current (less "
                                                  "inactive_file)", MIB,
                                                  "/sys/fs/cgroup/memory.max")
    assert host_memory({}.get) == HostMemory()  # nothing readable: unknown

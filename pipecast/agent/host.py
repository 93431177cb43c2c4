"""What this node is, as it registers: its accelerator (probed without torch) and its reachable address; and the
memory this process may take (the host's and its memory cgroup's), which the agent checks its settings against."""

import logging
import os
import shutil
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

from control_plane.messages import AcceleratorInfo
from pipecast.agent.transport.base import split_address

log = logging.getLogger(__name__)

NVIDIA_SMI_TIMEOUT_S = 5.0
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
CGROUP_ROOT = "/sys/fs/cgroup"
#: A cgroup limit this large is none: cgroup v1 says "no limit" as LONG_MAX rounded down to a page.
_NO_LIMIT = 1 << 60


def detect_accelerator(device: str) -> AcceleratorInfo:
    """What this node computes on, for the registration: ``device`` is the engine's setting ("cpu",
    "cuda", "cuda:1"); CUDA devices are described by ``nvidia-smi`` (no torch import)."""
    kind = device.split(":", 1)[0]
    if kind != "cuda":
        return AcceleratorInfo(kind=kind)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        log.warning("device %s but no nvidia-smi: registering the accelerator without its name and memory", device)
        return AcceleratorInfo(kind=kind)
    try:
        out = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True, timeout=NVIDIA_SMI_TIMEOUT_S).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("nvidia-smi failed (%s): registering the accelerator without its name and memory", exc)
        return AcceleratorInfo(kind=kind)
    gpus = [line.rsplit(",", 1) for line in out.splitlines() if "," in line]
    if not gpus:
        return AcceleratorInfo(kind=kind)
    name, mib = gpus[_physical_index(device, len(gpus))]
    return AcceleratorInfo(kind=kind, name=name.strip(), count=len(gpus),
                           memory_bytes=int(mib.strip()) << 20 if mib.strip().isdigit() else 0)


def _physical_index(device: str, count: int) -> int:
    """Which of ``nvidia-smi``'s ``count`` GPUs (all the host's, in its order) the engine's ``device`` is: its index
    (``cuda`` is 0, the agent's current device), mapped through ``CUDA_VISIBLE_DEVICES`` where that lists indices;
    the first where it cannot tell (UUIDs, an index past the list)."""
    _, _, index = device.partition(":")
    position = int(index) if index.isdigit() else 0
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible:
        if position >= len(visible) or not visible[position].isdigit():
            return 0
        position = int(visible[position])
    return position if position < count else 0


def advertised_address(listen_address: str) -> str:
    """Where other nodes reach a listener bound to ``listen_address``: a wildcard host is replaced by
    this host's name."""
    host, port = split_address(listen_address)
    if host in WILDCARD_HOSTS:
        host = socket.gethostname()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class HostMemory:
    """The memory this process may take: ``available`` now and its ``limit`` (bytes; None: unknown), each the
    smallest of the host's and its memory cgroups', with the file it was read from (``available_from``,
    ``limit_from``)."""

    available: int | None = None
    available_from: str = ""
    limit: int | None = None
    limit_from: str = ""


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _int(text: str | None) -> int | None:
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:  # cgroup v2's "max": no limit
        return None


def _cgroup_files(cgroups: str) -> list[tuple[str, str, str]]:
    """(folder, limit file, usage file) of this process's memory cgroup and each of its ancestors (each limits
    it), from ``/proc/self/cgroup``: cgroup v2 (``0::PATH``) and v1 (``N:...memory...:PATH``). The mount's own
    folder comes last: in a container without a cgroup namespace PATH is the host's, not under the mount."""
    found = []
    for line in cgroups.splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "" and path.startswith("/"):
            base, files = CGROUP_ROOT, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base, files = f"{CGROUP_ROOT}/memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        found += [("/".join([base, *parts[:n]]), *files) for n in range(len(parts), -1, -1)]
    return found


def _stat(text: str | None, key: str) -> int:
    """The value of ``key`` in a cgroup's ``memory.stat`` text, 0 where it is not there."""
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return _int(value) or 0
    return 0


def host_memory(read: Callable[[str], str | None] = _read_text) -> HostMemory:
    """What memory this process may take: MemAvailable and MemTotal of ``/proc/meminfo``, and every memory cgroup
    limit over it (cgroup v2 ``memory.max`` less ``memory.current``, v1 ``memory.limit_in_bytes`` less
    ``memory.usage_in_bytes``, each usage less its reclaimable page cache, ``inactive_file``) where readable.
    ``read`` gives a file's text, None where it cannot be read (tests give it files of their own)."""
    available: list[tuple[int, str]] = []
    limits: list[tuple[int, str]] = []
    for line in (read("/proc/meminfo") or "").splitlines():
        key, _, value = line.partition(":")
        kib = _int(value.strip().removesuffix("kB"))
        if kib is not None and key in ("MemAvailable", "MemTotal"):
            (available if key == "MemAvailable" else limits).append((kib << 10, f"{key} in /proc/meminfo"))
    for folder, limit_file, usage_file in _cgroup_files(read("/proc/self/cgroup") or ""):
        limit = _int(read(f"{folder}/{limit_file}"))
        if limit is None or limit >= _NO_LIMIT:
            continue
        limits.append((limit, f"{folder}/{limit_file}"))
        used = _int(read(f"{folder}/{usage_file}"))
        if used is not None:
            # less the page cache the kernel reclaims before it kills anything (as kubelet's working set counts):
            # a cgroup whose processes read files is no fuller for it
            inactive = "inactive_file" if limit_file == "memory.max" else "total_inactive_file"
            used -= min(_stat(read(f"{folder}/memory.stat"), inactive), used)
            available.append((max(limit - used, 0),
                              f"{folder}/{limit_file} less {usage_file} (less {inactive})"))
    least_available, least_limit = min(available, default=(None, "")), min(limits, default=(None, ""))
    return HostMemory(*least_available, *least_limit)

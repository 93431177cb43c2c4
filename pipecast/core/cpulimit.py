"""The CPU quota this process runs under (a container's CPU limit: a cgroup CFS quota), if any.

A compute estimate made from one burst of work holds for sustained work only without a quota: under one,
a short burst runs at full speed while a sustained stream of work is throttled to the quota.
"""

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cpu_limit(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> float | None:
    """CPUs this process may use by its cgroup's CFS quota (v1 ``cpu`` controller or v2 ``cpu.max``), None
    when unlimited or unknown."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if "cpu" in controllers.split(","):  # v1: the cpu controller's own hierarchy
            for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct"):
                limit = _v1(mount / relative)
                if limit is not None:
                    return limit
        elif controllers == "":  # v2: one hierarchy, cpu.max
            for mount in (root, root / "unified"):
                limit = _v2(mount / relative / "cpu.max")
                if limit is not None:
                    return limit
    return None


def _v1(group: Path) -> float | None:
    try:
        quota = int((group / "cpu.cfs_quota_us").read_text())
        period = int((group / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v2(cpu_max: Path) -> float | None:
    try:
        quota, period = cpu_max.read_text().split()
        return int(quota) / int(period) if quota != "max" and int(period) > 0 else None
    except (OSError, ValueError):
        return None

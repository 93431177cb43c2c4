"""A fixed CPU share per serving worker, so that each emulated GPU node has a capacity of its own.

Every host of the emulated cluster runs on this one machine: without a quota, one warm worker computes
with every core and N workers share them, so adding replicas adds no capacity and a pool of one looks as
strong as a pool of eight. With a quota each worker gets ``cores`` CPUs (a CFS quota: cgroup v1 ``cpu``
controller, or cgroup v2 ``cpu.max``), as each node of a GPU cluster has its own accelerator.

Where neither cgroup hierarchy can be written (not root, no ``cpu`` controller), :func:`open_quotas`
returns a :class:`CpuQuotas` that does nothing and says why in :attr:`CpuQuotas.description`.
"""

import logging
import os
import uuid
from pathlib import Path

from pipecast.core.errors import PipecastError

log = logging.getLogger(__name__)

PERIOD_US = 100_000
#: The smallest CFS quota the kernel takes (a smaller one is refused with EINVAL), and so the fewest CPUs a
#: worker can be given at PERIOD_US.
MIN_QUOTA_US = 1_000
MIN_CORES = MIN_QUOTA_US / PERIOD_US


class CpuQuotaError(PipecastError):
    """A CPU quota the kernel cannot take, or a process that cannot be put under one."""
V1_ROOT = Path("/sys/fs/cgroup/cpu")
V2_ROOT = Path("/sys/fs/cgroup/unified")


class CpuQuotas:
    """One cgroup per limited process, each with a quota of ``cores`` CPUs; :meth:`close` removes them."""

    def __init__(self, root: Path | None, cores: float, reason: str = "") -> None:
        self.root, self.cores = root, cores
        self._groups: list[Path] = []
        self.description = (f"{cores:g} CPU per worker (CFS quota, {root})" if root is not None
                            else f"no CPU quota per worker ({reason})")

    @property
    def active(self) -> bool:
        return self.root is not None

    def limit(self, pid: int) -> None:
        """Move process ``pid`` (and the threads and children it starts after) under a quota of its own;
        CpuQuotaError, naming the quota, where the cgroup cannot be made or written."""
        if self.root is None:
            return
        group = self.root / f"pipecast-{uuid.uuid4().hex[:10]}"
        quota = int(self.cores * PERIOD_US)
        try:
            group.mkdir()
            self._groups.append(group)
            if (group / "cpu.max").exists():  # cgroup v2
                (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            else:
                (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (group / "cpu.cfs_quota_us").write_text(str(quota))
            (group / "cgroup.procs").write_text(str(pid))
        except OSError as exc:
            raise CpuQuotaError(f"cannot put process {pid} under a CPU quota of {quota} us per {PERIOD_US} us "
                                f"({self.cores:g} CPU) in {group}: {exc.strerror or exc}") from exc

    def close(self) -> None:
        """Remove the groups (their processes must have exited; a group still in use is left, logged)."""
        for group in self._groups:
            try:
                group.rmdir()
            except OSError as exc:
                log.warning("cannot remove cgroup %s: %s", group, exc)
        self._groups.clear()


def _writable(root: Path) -> str:
    """Why ``root`` cannot hold per-process CPU quotas ("" when it can)."""
    if not root.is_dir():
        return f"{root} does not exist"
    probe = root / f"pipecast-probe-{os.getpid()}"
    try:
        probe.mkdir()
    except OSError as exc:
        return f"cannot create a cgroup under {root}: {exc.strerror or exc}"
    try:
        has_quota = (probe / "cpu.max").exists() or (probe / "cpu.cfs_quota_us").exists()
    finally:
        probe.rmdir()
    return "" if has_quota else f"{root} has no cpu controller"


def open_quotas(cores: float | None) -> CpuQuotas:
    """Quotas of ``cores`` CPUs per limited process (None: none asked), on the first writable hierarchy;
    CpuQuotaError for fewer cores than the kernel's smallest quota (MIN_CORES), before any process starts."""
    if cores is None:
        return CpuQuotas(None, 0.0, "not asked")
    if cores < MIN_CORES:
        raise CpuQuotaError(f"a CPU quota of {cores:g} CPU is below the smallest the kernel takes: {MIN_CORES:g} "
                            f"CPU ({MIN_QUOTA_US} us per {PERIOD_US} us)")
    reasons = []
    for root in (V1_ROOT, V2_ROOT):
        reason = _writable(root)
        if not reason:
            return CpuQuotas(root, cores)
        reasons.append(reason)
    log.warning("CPU quotas unavailable: %s", "; ".join(reasons))
    return CpuQuotas(None, cores, "; ".join(reasons))

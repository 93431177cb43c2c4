"""``pipecast bench chaos``: the reliability suite. Each scenario runs real processes (control plane,
agents, serving worker, router) on loopback with the cluster's master token, injects faults, and is
judged on what a user would see:

- survived: its goal held (a transfer completed around the fault, an agent kept serving, a hostile request
  got a 400) and no process died that was not killed on purpose;
- corrupt blocks served: after the scenario, every block any live agent reports verified is read through
  its local API and re-hashed (BLAKE3) against the manifest; must be 0;
- hangs: every operation runs under a deadline; a missed one is a hang; must be 0;
- peak RSS / fds / threads of every agent process, sampled, against the bounds
  (:mod:`benchmarks.chaos_harness`).

A scenario passes when all four hold. ``--short`` runs each with smaller counts (the whole run is under
3 minutes on 2 cores). The scenarios themselves are in :mod:`benchmarks.chaos_scenarios`.
"""

import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from benchmarks.chaos_harness import Bounds, ChaosError, Harness, ScenarioResult
from benchmarks.chaos_net import BackgroundLoop
from benchmarks.chaos_package import model_package, random_package
from benchmarks.chaos_scenarios import (
    FULL,
    SHORT,
    Context,
    cache_crash_restart,
    cache_enospc,
    control_plane_restart,
    corrupt_relay,
    forged_manifest,
    hostile_json,
    impersonation,
    nested_manifest,
    relay_killed,
    resource_abuse,
    scale_cycles,
    symlinked_checkpoint,
    unauthenticated_manifest,
)
from benchmarks.runinfo import versions
from pipecast.core.progress import NO_PROGRESS, Progress
from pipecast.v1.manifest_pb2 import Manifest

log = logging.getLogger(__name__)

Scenario = Callable[[Harness, Context], bool]
#: /dev/shm entries of other programs, which come and go while the suite runs: a PostgreSQL server beside it (the
#: test suite's own, or any) makes a dynamic shared-memory segment whenever a query needs one. The suite's own
#: processes share memory through memfd and UCX's names, never these.
OTHERS_SHM = ("PostgreSQL.",)

# name -> the scenario, in the order they run (the cheap and independent ones first).
SCENARIOS: dict[str, Scenario] = {
    "relay-killed": relay_killed,
    "control-plane-restart": control_plane_restart,
    "corrupt-relay": corrupt_relay,
    "cache-enospc": cache_enospc,
    "cache-crash-restart": cache_crash_restart,
    "resource-abuse": resource_abuse,
    "scale-cycles": scale_cycles,
    "nested-manifest": nested_manifest,
    "forged-manifest": forged_manifest,
    "unauth-manifest": unauthenticated_manifest,
    "impersonation": impersonation,
    "symlinked-checkpoint": symlinked_checkpoint,
    "hostile-json": hostile_json,
}


def parse_only(text: str | None) -> tuple[str, ...]:
    """``"a,b"`` to the scenario names ``("a", "b")`` in the suite's order; all of them for None."""
    if not text:
        return tuple(SCENARIOS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        raise ChaosError(f"--only: unknown scenario(s) {', '.join(unknown) or text!r}; "
                         f"known: {', '.join(SCENARIOS)}")
    return tuple(n for n in SCENARIOS if n in names)


@dataclass
class ChaosReport:
    """Every scenario's result, with what was left behind after all of them."""

    results: list[ScenarioResult]
    short: bool
    started_at: str
    leftovers: dict[str, list[str]] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def to_json(self) -> dict:
        return {"scenarios": [r.to_json() for r in self.results], "short": self.short, "passed": self.passed,
                "bounds": vars(Bounds()), "leftovers": self.leftovers,
                "versions": versions("blake3", "grpcio", "aiohttp", "psutil"), "cpu_cores": os.cpu_count(),
                "started_at": self.started_at}


def format_report(report: ChaosReport) -> str:
    """The table: one line per scenario, its faults and details below it."""
    header = (f"{'scenario':<22} {'faults':>6} {'survived':>8} {'corrupt/rehashed':>16} {'hangs':>5} "
              f"{'peak RSS MiB/bound':>18} {'fds/bound':>10} {'thr/bound':>9} {'secs':>6} {'passed':>6}")
    lines = [f"pipecast bench chaos{' --short' if report.short else ''}: {len(report.results)} scenario(s)", header]
    for r in report.results:
        b = r.bounds
        lines.append(f"{r.name:<22} {len(r.faults):>6} {'yes' if r.survived else 'NO':>8} "
                     f"{f'{r.corrupt_served}/{r.blocks_rehashed}':>16} "
                     f"{r.hangs:>5} {f'{r.peak_rss_bytes >> 20}/{b.rss_bytes >> 20}':>18} "
                     f"{f'{r.peak_fds}/{b.fds}':>10} {f'{r.peak_threads}/{b.threads}':>9} {r.seconds:>6.1f} "
                     f"{'PASS' if r.passed else 'FAIL':>6}")
    lines.append("")
    for r in report.results:
        lines.append(f"{r.name}: faults: {'; '.join(r.faults) or '-'}")
        if r.detail:
            lines.append(f"{' ' * len(r.name)}  detail: {'; '.join(r.detail)}")
    left = {k: v for k, v in report.leftovers.items() if v}
    lines.append(f"left behind: {left}" if left else "left behind: nothing (processes, mounts, /dev/shm)")
    failed = [r.name for r in report.results if not r.passed]
    lines.append(f"FAILED: {', '.join(failed)}" if failed else "all scenarios passed")
    return "\n".join(lines)


def _leftovers(workdir: Path, shm_before: set[str]) -> dict[str, list[str]]:
    """Processes still running from ``workdir``, mounts under it, and /dev/shm entries that appeared."""
    ours = {os.getpid(), *(p.pid for p in psutil.Process().parents())}  # this run itself names workdir too
    procs = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.info["pid"] not in ours and any(str(workdir) in arg for arg in proc.info["cmdline"] or ()):
            procs.append(f"{proc.info['pid']}: {' '.join(proc.info['cmdline'])[:120]}")
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
              if str(workdir) in line.split()[1]]
    shm = sorted(name for name in _shm_names() - shm_before if not name.startswith(OTHERS_SHM))
    return {"processes": procs, "mounts": mounts, "shm": shm}


def _shm_names() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir()} if Path("/dev/shm").is_dir() else set()


def run(names: Sequence[str], short: bool, workdir: Path, progress: Progress = NO_PROGRESS) -> ChaosReport:
    """Run the scenarios ``names`` (see :data:`SCENARIOS`) in ``workdir``, one after another."""
    workdir = Path(workdir).resolve()
    started_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    sizes = SHORT if short else FULL
    shm_before = _shm_names()
    package = workdir / "package"
    manifest = random_package(package, sizes.layers, sizes.layer_bytes, sizes.chunk_bytes)
    models: list[tuple[Path, Manifest]] = []

    def servable() -> tuple[Path, Manifest]:
        if not models:
            path = workdir / "model"
            models.append((path, model_package(path)))
        return models[0]

    token = secrets.token_hex(16)  # the cluster's master token, as a deployment would set it
    results = []
    progress.start(len(names), "chaos", unit="scenario")
    for name in names:
        progress(f"chaos: {name} ...")
        loop = BackgroundLoop()
        ctx = Context(sizes, package, manifest, loop, servable, {manifest.package_id: manifest})
        harness = Harness(name, workdir / name, token)
        try:
            goal = False
            try:
                goal = SCENARIOS[name](harness, ctx)
            except Exception as exc:  # noqa: BLE001 - one scenario's crash is its result, not the suite's end
                log.exception("chaos scenario %s stopped", name)
                harness.check(False, f"scenario stopped: {type(exc).__name__}: {exc}")
            harness.finish(ctx.manifests, goal)
        finally:
            result = harness.close()
            loop.close()
        results.append(result)
        progress.advance()
        progress(f"chaos: {name}: {'PASS' if result.passed else 'FAIL'} in {result.seconds:.1f} s"
                 f"{'' if result.passed else ' (' + '; '.join(result.detail)[:300] + ')'}")
    return ChaosReport(results, short, started_at, _leftovers(workdir, shm_before))

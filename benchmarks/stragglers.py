"""``pipecast bench stragglers``: a scale-up that one slow receiver does not hold back.

One emulated cluster (DESIGN 5): a control plane, a store agent seeding the package, N receivers each with
an agent, and a driver, every link at B but the link of the receiver at ``slow_position`` (1-based, in the
scale-up's order), which runs at ``slow_factor`` x B while its agent, like every other, declares B
(``--link-mbit``): a node below its spec; with ``slow_direction`` "up" only its uplink does (an egress cap: it
receives at B and relays slowly). The driver publishes the package, waits until every receiver is
registered, scales the package up onto the N receivers in order (the control plane's default plan from one
store: a chain, so the slow receiver relays to every receiver after it) and records when each holds the
whole package, and which receivers the control plane demoted as stragglers. Modes, one run each:

- ``handled``: the control plane's default straggler handling: it finds the slow receiver from the agents'
  progress reports, moves its children to faster parents and makes it a leaf (in the chain, with the relay
  feeding it, until past the tail one of the two is found the slow one).
- ``unhandled``: ``--straggler-factor 0``, what a user gets without it: every receiver behind the slow one
  receives at its rate.
- ``none``: no slow receiver (a cluster of its own, every link at B), the reference; the receiver at
  ``slow_position`` is reported apart all the same, so that the others are the same set in every mode.

The figure is the slowest of the other receivers against the floor S/B (the issue's target: within
:data:`TARGET_RATIO` x); the slow receiver cannot beat its own floor S/(f B). With ``kill_position`` the
orchestrator also kills (SIGKILL) that receiver's agent ``kill_after_s`` after the scale-up: the control
plane must repair the plan around it too, and it is not required to complete.

The module is pure logic (configuration, results, report) above :func:`run`; run as ``python -m
benchmarks.stragglers SPEC`` it is the driver, on its own host.
"""

import asyncio
import json
import logging
import os
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.checkout import module_argv
from benchmarks.cluster import EmulatedCluster, RequestedMode
from benchmarks.cpu import CpuSampler, CpuUsage
from benchmarks.distribution import check_over_floor, floor_seconds, worker_names
from benchmarks.processes import RunProcesses, cli, endpoint, publish_when_up
from benchmarks.runinfo import RunsReport, versions
from packager.manifest import read_manifest
from pipecast.core.errors import PipecastError
from pipecast.core.progress import NO_PROGRESS, Progress
from pipecast.core.units import format_bytes

logger = logging.getLogger(__name__)

HANDLED, UNHANDLED, NONE = "handled", "unhandled", "none"
#: Which of the slow receiver's link directions run at its factor: both, or its uplink only.
SLOW_DIRECTIONS = ("both", "up")
MODES = (HANDLED, UNHANDLED, NONE)
DEFAULT_MODES = (HANDLED, UNHANDLED)
STORE, CONTROL, DRIVER = "store", "cp", "driver"
#: The issue's target: every receiver but the slow one within this multiple of S/B.
TARGET_RATIO = 1.25
START_TIMEOUT_S = 180.0  # the store verifies the package, N agents start and register, on 2 cores
# A transfer may take this multiple of the slow receiver's floor, plus the slack, before it is declared stuck.
RUN_DEADLINE_FACTOR = 4.0
RUN_DEADLINE_SLACK_S = 60.0
DRIVER_EXIT_S = 30.0  # for the driver to write its results once its own deadline passed
POLL_S = 0.05
PLAN_POLL_EVERY = 4  # polls of availability per poll of the plans (demotions follow 0.1 s progress reports)


class StragglersBenchError(PipecastError):
    """The stragglers benchmark was misconfigured (the caller's fault) or a run failed (a process's)."""


class StragglersTimeout(StragglersBenchError):
    """The receivers did not register, or the package did not reach them, in time."""


def parse_modes(text: str) -> tuple[str, ...]:
    """``"handled,unhandled"`` -> ("handled", "unhandled"): distinct modes among :data:`MODES`."""
    names = tuple(part.strip() for part in text.split(","))
    if not all(names) or any(n not in MODES for n in names) or len(set(names)) != len(names):
        raise StragglersBenchError(f"--modes: expected distinct modes among {', '.join(MODES)}, got {text!r}")
    return names


@dataclass(frozen=True)
class StragglersConfig:
    """What one ``bench stragglers`` measures."""

    package: Path
    workers: int = 8
    link_mbit: float = 400.0
    slow_position: int = 3  # 1-based, in the scale-up's order
    slow_factor: float = 0.25
    slow_direction: str = "both"
    modes: tuple[str, ...] = DEFAULT_MODES
    kill_position: int = 0  # 0: nobody is killed
    kill_after_s: float = 1.5
    repeat: int = 1
    mode: RequestedMode = "auto"

    def __post_init__(self) -> None:
        others = self.workers - 1 - (self.kill_position > 0)
        if self.workers < 2 or others < 1:
            raise StragglersBenchError(f"--workers: {self.workers} leaves no receiver besides the slow "
                                       f"{'and the killed ' if self.kill_position else ''}one")
        if not 1 <= self.slow_position <= self.workers:
            raise StragglersBenchError(f"--slow-position must be within 1..{self.workers}, got {self.slow_position}")
        if not 0 < self.slow_factor < 1:
            raise StragglersBenchError(f"--slow-factor must be within (0, 1), got {self.slow_factor}")
        if self.slow_direction not in SLOW_DIRECTIONS:
            raise StragglersBenchError(f"--slow-direction must be one of {', '.join(SLOW_DIRECTIONS)}, got "
                                       f"{self.slow_direction!r}")
        if not 0 <= self.kill_position <= self.workers:
            raise StragglersBenchError(f"--kill-position must be within 0..{self.workers}, got {self.kill_position}")
        if self.kill_position == self.slow_position:
            raise StragglersBenchError(f"--kill-position {self.kill_position} is the slow receiver's position: "
                                       "kill another one")
        if self.kill_after_s < 0:
            raise StragglersBenchError(f"--kill-after must be >= 0 s, got {self.kill_after_s}")
        if self.link_mbit <= 0:
            raise StragglersBenchError(f"--link-mbit must be > 0, got {self.link_mbit}")
        if not self.modes or any(m not in MODES for m in self.modes) or len(set(self.modes)) != len(self.modes):
            raise StragglersBenchError(f"modes must be distinct, among {', '.join(MODES)}, got {self.modes}")
        if self.repeat < 1:
            raise StragglersBenchError(f"--repeat must be >= 1, got {self.repeat}")

    @property
    def slow_node(self) -> str:
        return worker_names(self.workers)[self.slow_position - 1]

    @property
    def killed_node(self) -> str | None:
        return worker_names(self.workers)[self.kill_position - 1] if self.kill_position else None

    @property
    def receive_factor(self) -> float:
        """The slow receiver's downlink as a share of the link: slowed only out, it receives at B."""
        return self.slow_factor if self.slow_direction == "both" else 1.0

    def deadline_s(self, package_bytes: int) -> float:
        """How long a run's transfer may take before it is declared stuck."""
        slow = self.link_mbit * self.slow_factor
        return RUN_DEADLINE_FACTOR * floor_seconds(package_bytes, slow, slow) + RUN_DEADLINE_SLACK_S


@dataclass(frozen=True)
class RunResult:
    """One run: when every receiver held the package, after the scale-up, beside the floors."""

    mode: str
    repeat: int  # 1-based
    workers: int
    link_mbit: float
    slow_position: int
    slow_factor: float  # 1 in mode none: that receiver is not slowed
    kill_position: int
    floor_seconds: float  # S/B
    slow_floor_seconds: float  # S at the slow receiver's rate
    others_max_seconds: float | None  # the last of the others (not slow, not killed); None: one never completed
    others_ratio_to_floor: float | None
    slow_seconds: float | None
    complete: dict[str, float]  # receiver -> seconds after the scale-up, those that completed
    demoted: list[str]
    plan_strategy: str
    cpu_mean_percent: float
    cpu_saturated: bool
    error: str = ""  # the driver's, for a run whose transfer did not finish (its figures are partial)

    @property
    def slow_node(self) -> str:
        return worker_names(self.workers)[self.slow_position - 1]

    @property
    def expected_demoted(self) -> list[str]:
        """What handling demotes: the slow receiver and, in a chain where a relay feeds it, that relay (nothing tells
        a slow child from a slow uplink there: both leave the middle, ``chain_pairs``)."""
        relay = worker_names(self.workers)[self.slow_position - 2] if (
            self.plan_strategy == "chain" and self.slow_position > 1) else None
        return sorted({self.slow_node, relay} - {None})


def summarize(config: StragglersConfig, mode: str, repeat: int, package_bytes: int, observed: dict,
              cpu: CpuUsage) -> RunResult:
    """The result of one run from what the driver ``observed`` (its results file: ``complete``, ``demoted``,
    ``plan_strategy`` and, for a failed run, ``error``)."""
    complete = dict(observed["complete"])
    others = [w for w in worker_names(config.workers) if w not in (config.slow_node, config.killed_node)]
    floor = floor_seconds(package_bytes, config.link_mbit, config.link_mbit)
    others_max = max(complete[w] for w in others) if all(w in complete for w in others) else None
    if others_max is not None:
        check_over_floor(others_max, floor, f"{mode} run {repeat}")
    factor = 1.0 if mode == NONE else config.slow_factor
    slow_mbit = config.link_mbit * (1.0 if mode == NONE else config.receive_factor)  # what it receives at
    return RunResult(mode=mode, repeat=repeat, workers=config.workers, link_mbit=config.link_mbit,
                     slow_position=config.slow_position, slow_factor=factor, kill_position=config.kill_position,
                     floor_seconds=floor, slow_floor_seconds=floor_seconds(package_bytes, slow_mbit, slow_mbit),
                     others_max_seconds=others_max,
                     others_ratio_to_floor=None if others_max is None else others_max / floor,
                     slow_seconds=complete.get(config.slow_node), complete=complete,
                     demoted=sorted(observed["demoted"]), plan_strategy=observed["plan_strategy"],
                     cpu_mean_percent=cpu.mean_percent, cpu_saturated=cpu.saturated(),
                     error=observed.get("error", ""))


class StragglersReport(RunsReport[RunResult]):
    result_type = RunResult

    def verdicts(self) -> list[str]:
        return verdicts(self.results, uplink=self.meta.get("slow_direction") == "up")


def _median_ratio(runs: Sequence[RunResult]) -> float | None:
    """The median of the runs' others / S/B; None if the others did not all complete in some run."""
    ratios = [r.others_ratio_to_floor for r in runs]
    return None if not ratios or None in ratios else statistics.median(ratios)


def verdicts(results: Sequence[RunResult], uplink: bool = False) -> list[str]:
    """The issue's target met or not (the median over repeats; never met where a run failed: its driver gave up,
    a receiver late), each mode's figure beside it, and whether each mode demoted what it should: the slow
    receiver when handled (in a chain with the relay feeding it: :attr:`RunResult.expected_demoted`), nobody
    otherwise; with a slow ``uplink`` only, the slow relay among others (in a chain nothing tells it from its child
    first)."""
    by_mode = {m: [r for r in results if r.mode == m] for m in MODES if any(r.mode == m for r in results)}
    if not by_mode:
        return []
    parts = []
    for mode, runs in by_mode.items():
        ratio = _median_ratio(runs)
        errors = sum(bool(r.error) for r in runs)
        failed = f", {errors} of {len(runs)} run(s) failed" if errors else ""
        if mode == HANDLED:
            met = ratio is not None and ratio <= TARGET_RATIO and not errors
            got = "not every other receiver completed" if ratio is None else \
                f"every other receiver within {ratio:.2f}x S/B"
            parts.append(f"handled: {got}{failed} (target <= {TARGET_RATIO:g}x: {'met' if met else 'NOT met'})")
        else:
            label = "none (no slow receiver)" if mode == NONE else mode
            got = "not every other receiver completed" if ratio is None else f"{ratio:.2f}x"
            parts.append(f"{label}: {got}{failed}")
    lines = ["; ".join(parts)]
    for mode, runs in by_mode.items():
        slow = runs[0].slow_node
        for r in runs:
            expected = r.expected_demoted if mode == HANDLED else []
            names = ", ".join(r.demoted) or "nothing"
            if uplink and expected:
                judged = "the slow relay among them" if slow in r.demoted else f"expected {slow} among them"
            else:
                judged = "as expected" if r.demoted == expected else \
                    f"expected {', '.join(expected)}" if expected else "expected nothing"
            run = f" (run {r.repeat})" if len(runs) > 1 else ""
            lines.append(f"{mode}{run}: demoted {names} ({judged})")
    return lines


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_report(report: StragglersReport) -> str:
    """The report: one line per run, then the verdicts."""
    m = report.meta
    kill = f"; {m['killed_node']} killed {m['kill_after_s']:g} s after the scale-up" if m["killed_node"] else ""
    lines = [f"stragglers: {m['model_name']} ({format_bytes(m['package_bytes'])}, {m['blocks']} blocks), "
             f"{m['workers']} receivers at {m['link_mbit']:g} Mbit/s ({m['mode']}), floor S/B "
             f"{m['floor_seconds']:.2f} s; {m['slow_node']} (position {m['slow_position']}) at "
             f"{m['slow_factor']:g} x the link{' (its uplink only)' if m.get('slow_direction') == 'up' else ''}, "
             f"its floor {m['slow_floor_seconds']:.2f} s{kill}",
             f"{'mode':<9} {'run':>3} {'plan':<9} {'others s':>8} {'/ S/B':>6} {'slow s':>7} {'/ its':>6} "
             f"{'demoted':<12} {'CPU':>5}"]
    for r in report.results:
        ratio = "-" if r.others_ratio_to_floor is None else f"{r.others_ratio_to_floor:.2f}"
        slow_ratio = "-" if r.slow_seconds is None else f"{r.slow_seconds / r.slow_floor_seconds:.2f}"
        cpu = f"{r.cpu_mean_percent:.0f}%{'!' if r.cpu_saturated else ''}"
        lines.append(f"{r.mode:<9} {r.repeat:>3} {r.plan_strategy:<9} {_seconds(r.others_max_seconds):>8} "
                     f"{ratio:>6} {_seconds(r.slow_seconds):>7} {slow_ratio:>6} {','.join(r.demoted) or '-':<12} "
                     f"{cpu:>5}" + (f"  error: {r.error}" if r.error else ""))
    lines += [f"verdict: {line}" for line in report.verdicts()]
    lines.append("others: the last receiver but the slow (and the killed) one to hold the package, seconds after "
                 "the scale-up; slow: the slow receiver, and / its: against its own floor (in mode none it is "
                 "not slowed)")
    lines.append("CPU: mean of the machine's cores during the transfer; '!' marks a saturated run (the CPU, not "
                 "the plan, may bound its figures)")
    return "\n".join(lines)


# -- the driver (runs on its own host) -----------------------------------------------------------------


@dataclass(frozen=True)
class DriverSpec:
    control_plane: str
    package: str
    store_address: str
    receivers: list[str]  # in the scale-up's order
    killed: str | None  # not required to complete
    deadline_s: float  # for the transfer, from the scale-up
    events: str
    results: str


@dataclass
class Observed:
    """What the driver saw of the transfer; partial if it failed."""

    complete: dict[str, float] = field(default_factory=dict)
    demoted: set[str] = field(default_factory=set)
    plan_strategy: str = ""

    def to_json(self) -> dict:
        return {"complete": self.complete, "demoted": sorted(self.demoted), "plan_strategy": self.plan_strategy}


async def _drive(spec: DriverSpec, seen: Observed) -> None:
    from control_plane.client import ControlPlaneClient
    from pipecast.agent.events import EventLog

    events = EventLog(Path(spec.events), DRIVER)
    manifest = read_manifest(Path(spec.package))
    package_id = manifest.package_id
    deadline = time.monotonic() + START_TIMEOUT_S
    async with ControlPlaneClient(spec.control_plane) as cp:
        await publish_when_up(cp, manifest, STORE, spec.store_address, deadline, POLL_S)
        events.emit("published", package=package_id)
        while missing := set(spec.receivers) - {w.worker.peer.node_id for w in await cp.list_workers() if w.alive}:
            if time.monotonic() > deadline:
                raise StragglersTimeout(f"not registered within {START_TIMEOUT_S:g} s: {', '.join(sorted(missing))}")
            await asyncio.sleep(0.2)
        t0 = time.monotonic()
        reply = await cp.scale_up(package_id, node_ids=spec.receivers)
        seen.plan_strategy = reply.strategy
        events.emit("scaled_up", strategy=reply.strategy)
        await _watch(cp, package_id, len(manifest.blocks), spec, t0, seen)
    events.emit("done")


async def _watch(cp, package_id: str, blocks: int, spec: DriverSpec, t0: float, seen: Observed) -> None:
    """Until every receiver but the killed one holds every block: when each did, and who was demoted."""
    required = set(spec.receivers) - {spec.killed}
    polls = 0
    while True:
        view = await cp.availability(package_id)
        now = time.monotonic() - t0
        for node in set(spec.receivers) - set(seen.complete):
            if len(view.by_worker.get(node, ())) == blocks:
                seen.complete[node] = now
        if polls % PLAN_POLL_EVERY == 0 or required <= set(seen.complete):
            # a plan is gone once every receiver holds the package: poll it while it runs
            for plan in await cp.list_plans(package_id):
                seen.demoted.update(plan.demoted)
        if required <= set(seen.complete):
            return
        if now > spec.deadline_s:
            missing = ", ".join(sorted(required - set(seen.complete)))
            raise StragglersTimeout(f"{missing} did not hold the package within {spec.deadline_s:.0f} s")
        polls += 1
        await asyncio.sleep(POLL_S)


def _driver_main(spec_path: str) -> int:
    spec = DriverSpec(**json.loads(Path(spec_path).read_text()))
    seen = Observed()
    try:
        asyncio.run(_drive(spec, seen))
    except Exception as exc:  # the orchestrator reads why, and what was seen, from the results file
        error = f"{type(exc).__name__}: {exc}"
        logger.error("%s", error)  # in the driver's log too, for a failure before the transfer
        Path(spec.results).write_text(json.dumps({**seen.to_json(), "error": error}))
        return 1
    Path(spec.results).write_text(json.dumps(seen.to_json()))
    return 0


# -- the orchestrator ----------------------------------------------------------------------------------


def _await_driver(run: RunProcesses, watched: Sequence[str], deadline: float, kill: str | None,
                  kill_at: float) -> None:
    """Until the driver exits: kill (SIGKILL) ``kill``'s agent at ``kill_at``; raise for a ``watched``
    process that died, or at ``deadline`` (time.time)."""
    alive = list(watched)
    while run.procs[DRIVER].poll() is None:
        if kill is not None and time.time() >= kill_at:
            os.killpg(run.procs[kill].pid, signal.SIGKILL)
            alive.remove(kill)
            kill = None
        run.check_alive(alive)
        if time.time() >= deadline:
            raise StragglersTimeout(f"the driver had not finished by its deadline; last lines of "
                                    f"{run.log_path(DRIVER)}:\n{run.log_tail(DRIVER)}")
        time.sleep(POLL_S)


def run_once(cluster: EmulatedCluster, folder: Path, config: StragglersConfig, manifest, mode: str,
             repeat: int) -> RunResult:
    """One run (module docstring) in ``mode`` of ``config.package`` (its ``manifest``); logs, events and the
    driver's results stay under ``folder``."""
    receivers = worker_names(config.workers)
    total = sum(b.bytes for b in manifest.blocks)
    control, store = endpoint(cluster, CONTROL, "control"), endpoint(cluster, STORE, "agent")
    run = RunProcesses(cluster, folder, StragglersBenchError)
    spec = DriverSpec(control, str(config.package), store, receivers, config.killed_node, config.deadline_s(total),
                      str(run.events_path(DRIVER)), str(folder / "results.json"))
    (folder / "spec.json").write_text(json.dumps(asdict(spec)))
    try:
        host, port = control.rsplit(":", 1)
        handling = ["--straggler-factor", "0"] if mode == UNHANDLED else []
        run.spawn(CONTROL, CONTROL, cli("control-plane", "--host", host, "--port", port, "--db",
                                         folder / "control.sqlite3", *handling))
        agent = ("agent", "--transport", "tcp")
        # the store needs no control plane: the driver publishes the package with the store's address
        run.spawn(STORE, STORE, cli(*agent, "--node-id", STORE, "--listen", store, "--seed", config.package,
                                     "--events", run.events_path(STORE)))
        start_deadline = time.time() + START_TIMEOUT_S
        run.wait_event([STORE], "listening", start_deadline, "the store verifying the package")
        for w in receivers:
            run.spawn(w, w, cli(*agent, "--node-id", w, "--listen", endpoint(cluster, w, "agent"), "--control-plane",
                                control, "--link-mbit", config.link_mbit, "--events", run.events_path(w)))
        run.spawn(DRIVER, DRIVER, module_argv("benchmarks.stragglers", folder / "spec.json"))
        run.wait_event([DRIVER], "scaled_up", start_deadline, "every receiver registered and the scale-up",
                       late=StragglersTimeout)
        kill_at = time.time() + config.kill_after_s
        with CpuSampler() as cpu:
            _await_driver(run, [CONTROL, STORE, *receivers], time.time() + spec.deadline_s + DRIVER_EXIT_S,
                          config.killed_node, kill_at)
    finally:
        run.stop(last=[CONTROL])
    results = folder / "results.json"
    if not results.exists():
        raise StragglersBenchError(f"the driver wrote no results; last lines of {run.log_path(DRIVER)}:\n"
                                   f"{run.log_tail(DRIVER)}")
    return summarize(config, mode, repeat, total, json.loads(results.read_text()), cpu.usage())


def run(config: StragglersConfig, workdir: Path, progress: Progress = NO_PROGRESS) -> StragglersReport:
    """Every mode ``config.repeat`` times, interleaved; logs and events under ``workdir``."""
    manifest = read_manifest(config.package)
    total = sum(b.bytes for b in manifest.blocks)
    floor = floor_seconds(total, config.link_mbit, config.link_mbit)
    report = StragglersReport(meta={
        "benchmark": "stragglers", "versions": versions(), "cpu_cores": os.cpu_count(),
        "load_average_at_start": os.getloadavg()[0], "model_name": manifest.model_name,
        "package_id": manifest.package_id, "package_bytes": total, "blocks": len(manifest.blocks),
        "workers": config.workers, "link_mbit": config.link_mbit, "slow_position": config.slow_position,
        "slow_node": config.slow_node, "slow_factor": config.slow_factor, "slow_direction": config.slow_direction,
        "killed_node": config.killed_node, "kill_after_s": config.kill_after_s, "floor_seconds": floor,
        "slow_floor_seconds": floor / config.receive_factor,
        "target_ratio": TARGET_RATIO,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    hosts = [STORE, CONTROL, DRIVER, *worker_names(config.workers)]
    # mode none runs in a cluster of its own: the slow link is the cluster's, set when it is built
    clusters = [(modes, rates) for modes, rates in (
        ([m for m in config.modes if m != NONE], {config.slow_node: config.link_mbit * config.slow_factor}),
        ([m for m in config.modes if m == NONE], {})) if modes]
    progress.start(len(config.modes) * config.repeat, "runs", unit="run")
    for modes, rates in clusters:
        both = config.slow_direction == "both"
        with EmulatedCluster(hosts, config.link_mbit, mode=config.mode, host_mbit=rates if both else None,
                             host_egress_mbit=None if both else rates) as cluster:
            report.meta["mode"] = cluster.mode
            progress(cluster.describe())
            for repeat in range(1, config.repeat + 1):
                for mode in modes:
                    result = run_once(cluster, Path(workdir) / f"{mode}-{repeat}", config, manifest, mode, repeat)
                    report.results.append(result)
                    progress.advance()
                    progress(f"[{mode} #{repeat}] plan {result.plan_strategy or '?'}: the others held the package "
                             f"at {_seconds(result.others_max_seconds)} s, {config.slow_node} at "
                             f"{_seconds(result.slow_seconds)} s; demoted {', '.join(result.demoted) or 'nothing'}"
                             + (f"; error: {result.error}" if result.error else ""))
    return report


if __name__ == "__main__":
    sys.exit(_driver_main(sys.argv[1]))

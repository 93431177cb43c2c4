"""``pipecast bench tenants``: one tenant bursts at 10x its rate; does the other tenant's p99 hold?

Real processes on loopback: ``--workers`` serving workers (``pipecast serve``, one torch thread each) of a
small model package, and two routers in front of the same workers: one with per-tenant limits
(``--tenant-limit a=RATE:BURST --tenant-limit b=RATE:BURST``), one without. The load generator runs in this
process: open loop (each request at its scheduled time, whatever the others do), evenly spaced requests,
each naming its tenant in ``x-pipecast-tenant`` and with a deadline; a request's latency runs from its
scheduled time to its whole (non-streamed) answer.

Before the phases a short calibration through the unlimited router measures one request alone and the
workers' capacity (closed loop, every worker's batch full). Unless given, the rates follow from that
capacity: b sends :data:`B_SHARE` of it, a is limited to :data:`A_SHARE` (so the workers have headroom for
both) and bursts at ``burst_factor`` times that, beyond the capacity.

Three phases, in this order, with the same processes:

1. ``b-alone``: b at its rate through the limited router;
2. ``burst-limited``: b at its rate while a sends ``burst_factor`` times its rate, through the limited
   router (a's excess is refused with 429 and ``Retry-After``);
3. ``burst-unlimited``: the same load through the router without limits: what the limit prevents.

In the burst phases b is a steady tenant when a's burst comes: a starts :data:`BURST_DELAY_S` after b and
b goes on that much longer, so that b sends throughout a's burst. (A burst that lands in the same
millisecond as b's very first request is dispatched before b exists for the router; no dispatch order can
then keep a's first requests from b's.)

The figure is b's p99 in phase 2 over its p99 in phase 1, against the target :data:`TARGET_RATIO`.
Percentiles are over a tenant's admitted requests (answered, or failed and counted at the deadline);
429s are counted apart, and any of b's in phase 2 fails the target (refusing b would hold its p99). The
module is pure logic (configuration, rates, figures, report) above :func:`run`, which does the I/O.
"""

import asyncio
import json
import math
import os
import shutil
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from benchmarks.cpu import CpuSampler, CpuUsage
from benchmarks.processes import Processes, cli, free_port
from benchmarks.runinfo import versions
from benchmarks.surge.report import percentile
from packager.errors import PackageError
from packager.manifest import read_manifest
from pipecast.core.errors import PipecastError
from pipecast.core.progress import NO_PROGRESS, Progress
from pipecast.router.admission import TENANT_HEADER

HOST = "127.0.0.1"
BURSTING, STEADY = "a", "b"
ALONE, LIMITED, UNLIMITED = "b-alone", "burst-limited", "burst-unlimited"
PHASES = (ALONE, LIMITED, UNLIMITED)
#: The issue's target: b's p99 while a bursts (with the limits) at most this many times its p99 alone.
TARGET_RATIO = 1.2
#: Default rates as shares of the measured capacity: a's admitted rate plus b's leave the workers headroom
#: (40% busy), a's burst at 10x (200%) does not.
A_SHARE = 0.2
B_SHARE = 0.2
#: b's own limit, over its rate: b is a limited tenant too, but its steady load never finds its bucket empty.
B_LIMIT_HEADROOM = 2.0
#: One second of a tenant's rate as its burst: a bucket that absorbs jitter, not a burst of 10x.
BURST_SECONDS = 1.0
# The default package: a random tiny Llama whose requests cost tens of milliseconds on one thread, so
# that the rates stay low enough for the load generator and the routers on a 2-core machine.
MODEL = {"num_hidden_layers": 4, "hidden_size": 512, "intermediate_size": 1408, "num_attention_heads": 8,
         "num_key_value_heads": 4, "max_position_embeddings": 256}
PROMPT = "The tenants of a shared cluster send their requests. " * 2  # byte-level tokenizer: 106 tokens
MAX_TOKENS = 8
WORKER_MAX_BATCH = 8
WORKER_THREADS = 1  # one per worker: more lets other load stall torch's thread pool for whole seconds
CALIBRATION_SERIAL = 6  # requests one after another; the first is a warm-up
CALIBRATION_S = 4.0  # of closed-loop load, every worker's batch full
START_TIMEOUT_S = 120.0  # workers import torch and load the model on a busy machine
POLL_S = 0.2
PAUSE_S = 2.0  # between phases, once the previous phase's requests have ended
#: In the burst phases, a's burst starts this long after b's steady stream (module docstring).
BURST_DELAY_S = 1.0
ROUTERS = {True: "router-limited", False: "router-unlimited"}  # process names, by "has limits"


class TenantsBenchError(PipecastError):
    """The tenants benchmark was misconfigured (the caller's fault) or a process failed (named)."""


# -- configuration (pure) ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TenantsConfig:
    """What one ``pipecast bench tenants`` measures; a rate left None follows from the calibration."""

    package: Path
    workers: int = 2
    duration_s: float = 20.0
    rate_a: float | None = None
    rate_b: float | None = None
    burst_factor: float = 10.0
    deadline_s: float = 10.0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise TenantsBenchError(f"--workers must be >= 1, got {self.workers}")
        for name, value in (("--duration", self.duration_s), ("--rate-a", self.rate_a), ("--rate-b", self.rate_b),
                            ("--deadline", self.deadline_s)):
            if value is not None and value <= 0:
                raise TenantsBenchError(f"{name} must be > 0, got {value:g}")
        if self.burst_factor <= 1:
            raise TenantsBenchError(f"--burst-factor must be > 1 (a burst above a's rate), got {self.burst_factor:g}")


@dataclass(frozen=True)
class Rates:
    """Each tenant's rate (requests/s), a's while bursting, and the routers' limits."""

    a: float
    b: float
    burst_factor: float

    @property
    def a_burst(self) -> float:
        return self.a * self.burst_factor

    def limits(self) -> dict[str, tuple[float, int]]:
        """Tenant -> (rate, burst) of the limited router: a at its rate, b with headroom over its own."""
        return {BURSTING: (self.a, _burst(self.a)),
                STEADY: (self.b * B_LIMIT_HEADROOM, _burst(self.b * B_LIMIT_HEADROOM))}

    def limit_args(self) -> list[str]:
        """The limits as ``pipecast router`` options."""
        return [arg for tenant, (rate, burst) in self.limits().items()
                for arg in ("--tenant-limit", f"{tenant}={rate:g}:{burst}")]


def _burst(rate: float) -> int:
    return max(1, math.ceil(rate * BURST_SECONDS))


def choose_rates(config: TenantsConfig, capacity_per_s: float) -> Rates:
    """The configured rates, or :data:`A_SHARE` and :data:`B_SHARE` of the measured capacity (3 significant
    digits, so the command line that repeats a run is short)."""
    def share(value: float | None, fraction: float) -> float:
        return value if value is not None else float(f"{fraction * capacity_per_s:.3g}")

    return Rates(a=share(config.rate_a, A_SHARE), b=share(config.rate_b, B_SHARE), burst_factor=config.burst_factor)


def schedule(rate_per_s: float, duration_s: float) -> list[float]:
    """Evenly spaced send times (seconds from the phase's start) of ``rate_per_s`` over ``duration_s``."""
    return [i / rate_per_s for i in range(max(1, math.floor(rate_per_s * duration_s)))]


# -- figures (pure) ------------------------------------------------------------------------------------


STATUSES = ("ok", "rejected", "failed")
#: Slowest requests of each tenant and phase kept in the figures.
SLOWEST = 5


@dataclass(frozen=True)
class RequestRecord:
    """One request: its tenant, when it was due (seconds from the phase's start), how it ended, its latency
    from that time (None unless answered), and for a 429 its ``Retry-After`` (None: absent) and error code."""

    tenant: str
    due_s: float
    status: str
    latency_s: float | None = None
    retry_after: str | None = None
    error: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {', '.join(STATUSES)}")


@dataclass(frozen=True)
class TenantResult:
    """One tenant in one phase (field names are the JSON keys)."""

    phase: str
    tenant: str
    rate_per_s: float
    sent: int
    answered: int
    rejected: int  # 429
    failed: int  # another status, an error, or past the deadline
    p50_s: float | None
    p95_s: float | None
    p99_s: float | None
    #: 429s without a whole-seconds Retry-After (the router promises one on each).
    retry_after_missing: int
    #: 429s by the router's error code (rate_limited: the tenant's bucket; queue_full: the shared queue).
    rejected_by: Mapping[str, int]


def summarize(phase: str, tenant: str, rate_per_s: float, records: Sequence[RequestRecord],
              deadline_s: float) -> TenantResult:
    """``tenant``'s figures in ``phase``: percentiles over its admitted requests, a failed one at ``deadline_s``."""
    mine = [r for r in records if r.tenant == tenant]
    admitted = [r.latency_s if r.status == "ok" else deadline_s for r in mine if r.status != "rejected"]
    rejected = [r for r in mine if r.status == "rejected"]
    by: dict[str, int] = {}
    for r in rejected:
        by[r.error or "unknown"] = by.get(r.error or "unknown", 0) + 1
    p50, p95, p99 = (percentile(admitted, q) for q in (50, 95, 99))
    return TenantResult(phase=phase, tenant=tenant, rate_per_s=rate_per_s, sent=len(mine),
                        answered=sum(r.status == "ok" for r in mine), rejected=len(rejected),
                        failed=sum(r.status == "failed" for r in mine), p50_s=p50, p95_s=p95, p99_s=p99,
                        retry_after_missing=sum(not (r.retry_after or "").isdigit() for r in rejected),
                        rejected_by=by)


def slowest(tenant: str, records: Sequence[RequestRecord], deadline_s: float) -> tuple[tuple[float, float], ...]:
    """``tenant``'s :data:`SLOWEST` slowest admitted requests as (due_s, latency_s), slowest first (a failed one
    at ``deadline_s``): whether a p99 comes from one moment of the phase (a burst's start) or from all of it."""
    timed = sorted(((r.latency_s if r.status == "ok" else deadline_s, r.due_s) for r in records
                    if r.tenant == tenant and r.status != "rejected"), reverse=True)
    return tuple((due, latency) for latency, due in timed[:SLOWEST])


def p99_ratio(results: Sequence[TenantResult], phase: str) -> float | None:
    """b's p99 in ``phase`` over its p99 alone (None when either is missing)."""
    p99 = {r.phase: r.p99_s for r in results if r.tenant == STEADY}
    alone, other = p99.get(ALONE), p99.get(phase)
    return None if not alone or other is None else other / alone


@dataclass(frozen=True)
class ProcessCpu:
    """Where a phase's CPU went, in percent of one core over the phase: the phase's router, the workers
    together, and this process (the load generator). On a machine where they share the cores, refusing a
    burst costs the router and the load generator CPU that the workers then lack."""

    router: float
    workers: float
    load_generator: float


@dataclass(frozen=True)
class TenantsReport:
    """Everything one run measured: its setting (``meta``), each tenant in each phase, each phase's CPU
    (the whole machine's, and by process)."""

    meta: dict
    results: tuple[TenantResult, ...]
    cpu: Mapping[str, CpuUsage]
    process_cpu: Mapping[str, ProcessCpu]
    #: Phase -> b's slowest requests (:func:`slowest`).
    slowest: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        """b's p99 while a bursts under the limits over its p99 alone: the issue's figure."""
        return p99_ratio(self.results, LIMITED)

    @property
    def b_refused(self) -> int:
        """b's requests refused (429) while a bursts under the limits: in no percentile, so any fails the target."""
        return sum(r.rejected for r in self.results if (r.phase, r.tenant) == (LIMITED, STEADY))

    @property
    def met(self) -> bool:
        """The issue's target: :attr:`ratio` within :data:`TARGET_RATIO`, none of b's requests refused meanwhile."""
        return self.ratio is not None and self.ratio <= TARGET_RATIO and not self.b_refused

    def to_json(self) -> dict:
        return {"meta": self.meta, "results": [asdict(r) for r in self.results],
                "cpu_mean_percent": {phase: usage.mean_percent for phase, usage in self.cpu.items()},
                "process_cpu_percent": {phase: asdict(usage) for phase, usage in self.process_cpu.items()},
                "slowest_b": {phase: [{"due_s": due, "latency_s": latency} for due, latency in requests]
                              for phase, requests in self.slowest.items()},
                "ratio": self.ratio, "ratio_unlimited": p99_ratio(self.results, UNLIMITED),
                "target_ratio": TARGET_RATIO, "met": self.met}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def verdict(report: TenantsReport) -> str:
    """One line: b's p99 with a bursting, with and without the limits, against b alone and the target."""
    by = {(r.phase, r.tenant): r for r in report.results}
    alone, limited, unlimited = (by[(phase, STEADY)] for phase in PHASES)
    ratio, free = report.ratio, p99_ratio(report.results, UNLIMITED)
    if ratio is None:  # which p99 is missing says why: b refused throughout the burst is a miss, not "no data"
        if alone.p99_s is not None and report.b_refused:
            return (f"verdict: b had no request answered while a bursts {report.meta['burst_factor']:g}x under the "
                    f"limits ({limited.failed} failed, {limited.rejected} refused): NOT met")
        return f"verdict: no p99 for b {'alone' if alone.p99_s is None else 'while a bursts'}: no ratio"
    met = "met" if report.met else "NOT met: b refused while a bursts, in no percentile" if report.b_refused \
        else "NOT met"
    # On a machine busy with other work, a phase's latencies measure the CPU's share it got, not the limits.
    busy = [phase for phase, usage in report.cpu.items() if usage.saturated()]
    return (f"verdict: b's p99 {_ms(limited.p99_s)} ms while a bursts {report.meta['burst_factor']:g}x under the "
            f"limits ({limited.failed} of b's requests failed, {limited.rejected} refused), {_ms(alone.p99_s)} ms "
            f"alone: {ratio:.2f}x (target <= {TARGET_RATIO:g}x: {met}); without "
            f"limits {_ms(unlimited.p99_s)} ms ({'-' if free is None else f'{free:.2f}x'}), "
            f"{unlimited.failed} of b's requests failed, {unlimited.rejected} refused"
            + (f"; CPU saturated in {', '.join(busy)}: latencies there measure the machine's contention"
               if busy else "; CPU not saturated"))


def format_report(report: TenantsReport) -> str:
    """The calibration, the rates chosen, a table of each tenant in each phase, and the verdict."""
    meta = report.meta
    a, b, burst = meta["rate_a"], meta["rate_b"], meta["rate_a"] * meta["burst_factor"]
    capacity = meta["capacity_per_s"]
    lines = [f"pipecast bench tenants: {meta['workers']} worker(s) ({WORKER_THREADS} torch thread each, max batch "
             f"{WORKER_MAX_BATCH}) serving {meta['package']}, behind a router with limits and one without",
             f"calibration: one request alone {_ms(meta['single_request_s'])} ms ({len(PROMPT)}-token prompt, "
             f"{MAX_TOKENS} tokens out); capacity {capacity:.1f} req/s (closed loop, {CALIBRATION_S:g} s)",
             f"rates: b {b:g}/s, a {a:g}/s bursting to {burst:g}/s ({meta['burst_factor']:g}x): a+b admitted "
             f"{(a + b) / capacity:.0%} of capacity, a's burst + b {(burst + b) / capacity:.0%}"
             f"{'' if meta['rates_chosen'] else ' (rates given)'}",
             f"limits: {' '.join(meta['limits'])}; {meta['duration_s']:g} s per phase, open loop, deadline "
             f"{meta['deadline_s']:g} s (a failed request counts at it); latency from the scheduled send to the "
             f"whole answer; load average {meta['load_average_at_start']:.1f} at start on {meta['cpu_cores']} cores",
             "",
             f"{'phase':<16} {'tenant':<6} {'rate/s':>7} {'sent':>5} {'answered':>8} {'429':>5} {'failed':>6} "
             f"{'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7} {'no R-A':>6} {'CPU':>5}"]
    for r in report.results:
        lines.append(f"{r.phase:<16} {r.tenant:<6} {r.rate_per_s:>7.3g} {r.sent:>5} {r.answered:>8} {r.rejected:>5} "
                     f"{r.failed:>6} {_ms(r.p50_s):>7} {_ms(r.p95_s):>7} {_ms(r.p99_s):>7} "
                     f"{r.retry_after_missing:>6} {report.cpu[r.phase].mean_percent:>4.0f}%")
    lines.append("429: refused (" + "; ".join(f"{r.phase} {r.tenant}: " + ", ".join(
        f"{n} {kind}" for kind, n in sorted(r.rejected_by.items())) for r in report.results if r.rejected_by)
                 + "); no R-A: 429s without Retry-After; CPU: the whole machine during the phase"
                 if any(r.rejected for r in report.results) else
                 "no request was refused; CPU: the whole machine during the phase")
    lines.append("CPU by process, % of one core (router / workers / load generator): " + "; ".join(
        f"{phase} {usage.router:.0f} / {usage.workers:.0f} / {usage.load_generator:.0f}"
        for phase, usage in report.process_cpu.items()))
    if report.slowest:
        lines.append(f"{STEADY}'s {SLOWEST} slowest, ms (due at s into the phase): " + "; ".join(
            f"{phase} " + ", ".join(f"{latency * 1000:.0f} ({due:.1f})" for due, latency in requests)
            for phase, requests in report.slowest.items()))
    lines.append(verdict(report))
    return "\n".join(lines)


# -- the package ---------------------------------------------------------------------------------------


def tenants_package(cache: Path) -> Path:
    """The default package (:data:`MODEL`, a byte-level tokenizer), built into ``cache`` on first use."""
    out = Path(cache) / "packages" / "tenants-tiny-llama-h{hidden_size}-l{num_hidden_layers}".format(**MODEL)
    try:
        read_manifest(out)
        return out
    except PackageError:
        pass
    # A random tiny transformers model packed by the real packager (nothing downloaded).
    from benchmarks.tiny_checkpoints import make_checkpoint, write_byte_tokenizer
    from packager.pack import pack

    checkpoint = out.parent / f"{out.name}-checkpoint"
    for stale in (out, checkpoint):  # a build that was interrupted
        shutil.rmtree(stale, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    make_checkpoint("llama", checkpoint, **MODEL)
    write_byte_tokenizer(checkpoint)
    pack(checkpoint, out, model_name="tiny-llama")
    shutil.rmtree(checkpoint)  # the package is what is served
    return out


# -- the load (I/O) ------------------------------------------------------------------------------------


def _body(model: str) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}


async def _send(http, url: str, tenant: str | None, body: dict, due: float, origin: float,
                deadline_s: float) -> RequestRecord:
    """POST ``body`` at ``due`` (time.monotonic) as ``tenant`` (None: no tenant header) and wait for its answer."""
    import aiohttp

    await asyncio.sleep(max(due - time.monotonic(), 0.0))
    headers = {TENANT_HEADER: tenant} if tenant else {}
    record = dict(tenant=tenant or "", due_s=due - origin)
    try:
        async with asyncio.timeout(deadline_s):
            async with http.post(f"{url}/v1/completions", json=body, headers=headers) as answer:
                payload = await answer.read()
                if answer.status == 429:
                    return RequestRecord(**record, status="rejected", retry_after=answer.headers.get("Retry-After"),
                                         error=_error_code(payload))
                if answer.status != 200:
                    return RequestRecord(**record, status="failed", error=f"HTTP {answer.status}")
    except TimeoutError:
        return RequestRecord(**record, status="failed", error=f"no answer within {deadline_s:g} s")
    except aiohttp.ClientError as exc:
        return RequestRecord(**record, status="failed", error=f"{type(exc).__name__}: {exc}")
    return RequestRecord(**record, status="ok", latency_s=time.monotonic() - due)


def _error_code(payload: bytes) -> str:
    try:
        return str(json.loads(payload)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "unknown"


def phase_schedule(loads: Mapping[str, float], duration_s: float) -> dict[str, list[float]]:
    """Each tenant's send times in a phase: alone, b for ``duration_s``; with a's burst, a for ``duration_s``
    from :data:`BURST_DELAY_S` on and b from 0 until a's burst ends."""
    delay = BURST_DELAY_S if BURSTING in loads else 0.0
    return {tenant: [delay + t for t in schedule(rate, duration_s)] if tenant == BURSTING
            else schedule(rate, duration_s + delay) for tenant, rate in loads.items()}


async def _phase(url: str, model: str, loads: Mapping[str, float], duration_s: float,
                 deadline_s: float) -> list[RequestRecord]:
    """Each tenant of ``loads`` at its rate (:func:`phase_schedule`), open loop; returns once every request
    ended."""
    import aiohttp

    origin = time.monotonic() + 0.1  # every task is created before the first is due
    # A session per tenant, unbounded: a shared or capped connection pool would queue b's requests behind
    # a's in this process, where no router could keep them apart.
    sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) for _ in loads]
    try:
        times = phase_schedule(loads, duration_s)
        tasks = [asyncio.create_task(_send(http, url, tenant, _body(model), origin + at, origin, deadline_s))
                 for http, tenant in zip(sessions, loads) for at in times[tenant]]
        return list(await asyncio.gather(*tasks))
    finally:
        for http in sessions:
            await http.close()


async def _calibrate(url: str, model: str, concurrency: int, deadline_s: float) -> tuple[float, float]:
    """One request's latency alone (median after a warm-up) and the capacity in requests/s (closed loop
    with ``concurrency`` requests always in flight for :data:`CALIBRATION_S`)."""
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        alone = []
        for _ in range(CALIBRATION_SERIAL):
            record = await _send(http, url, None, _body(model), time.monotonic(), 0.0, deadline_s)
            if record.status != "ok":
                raise TenantsBenchError(f"calibration: a request failed: {record.error or record.status}")
            alone.append(record.latency_s)
        end = time.monotonic() + CALIBRATION_S
        answered = 0

        async def loop() -> None:
            nonlocal answered
            while time.monotonic() < end:
                record = await _send(http, url, None, _body(model), time.monotonic(), 0.0, deadline_s)
                answered += record.status == "ok"

        started = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        elapsed = time.monotonic() - started
    if not answered:
        raise TenantsBenchError(f"calibration: no request was answered in {elapsed:.1f} s")
    return statistics.median(alone[1:]), answered / elapsed


# -- the processes (I/O) -------------------------------------------------------------------------------


def _get_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as answer:
            return json.loads(answer.read())
    except (urllib.error.URLError, TimeoutError, ConnectionError, ValueError):
        return None


def _cpu_seconds(process: psutil.Process) -> float:
    """User and system CPU seconds ``process`` used so far."""
    times = process.cpu_times()
    return times.user + times.system


def _wait_until(procs: Processes, name: str, what: str, ready: Callable[[], bool]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready():
        procs.check_alive([name])
        if time.monotonic() >= deadline:
            raise TenantsBenchError(f"{name}: {what} not within {START_TIMEOUT_S:g} s; last lines of "
                                    f"{procs.log_path(name)}:\n{procs.log_tail(name)}")
        time.sleep(POLL_S)


def _start_worker(procs: Processes, name: str, package: Path) -> str:
    port = free_port(HOST)
    procs.launch(name, cli("serve", package, "--host", HOST, "--port", port, "--max-batch", WORKER_MAX_BATCH,
                           verbose=False),
                 env={"OMP_NUM_THREADS": str(WORKER_THREADS), "MKL_NUM_THREADS": str(WORKER_THREADS)})
    return f"http://{HOST}:{port}"


def _start_router(procs: Processes, name: str, workers: Sequence[str], limit_args: Sequence[str]) -> str:
    port = free_port(HOST)
    procs.launch(name, cli("router", "--host", HOST, "--port", port, *(a for w in workers for a in ("--worker", w)),
                           *limit_args, verbose=False))
    url = f"http://{HOST}:{port}"
    _wait_until(procs, name, f"{len(workers)} workers serving",
                lambda: (_get_json(f"{url}/health") or {}).get("serving") == len(workers))
    return url


def run(config: TenantsConfig, workdir: Path, progress: Progress = NO_PROGRESS) -> TenantsReport:
    """Start the workers and routers, calibrate, measure the three phases (module docstring)."""
    procs = Processes(Path(workdir), TenantsBenchError)
    meta = {"benchmark": "tenants", "versions": versions("aiohttp", "torch"), "cpu_cores": os.cpu_count(),
            "load_average_at_start": os.getloadavg()[0], "package": str(config.package), "workers": config.workers,
            "duration_s": config.duration_s, "burst_factor": config.burst_factor, "deadline_s": config.deadline_s,
            "prompt_tokens": len(PROMPT), "max_tokens": MAX_TOKENS, "worker_max_batch": WORKER_MAX_BATCH,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    names = [f"worker-{i + 1}" for i in range(config.workers)]
    try:
        workers = [_start_worker(procs, name, config.package) for name in names]
        for name, url in zip(names, workers):
            _wait_until(procs, name, "health 'ready'",
                        lambda url=url: (_get_json(f"{url}/health") or {}).get("status") == "ready")
        model = _get_json(f"{workers[0]}/v1/models")["data"][0]["id"]
        progress(f"{config.workers} worker(s) ready; calibrating through the router without limits")
        free = _start_router(procs, ROUTERS[False], workers, [])
        single_s, capacity = asyncio.run(_calibrate(free, model, config.workers * WORKER_MAX_BATCH,
                                                    config.deadline_s))
        rates = choose_rates(config, capacity)
        meta.update(single_request_s=single_s, capacity_per_s=capacity, rate_a=rates.a, rate_b=rates.b,
                    rates_chosen=config.rate_a is None or config.rate_b is None, limits=rates.limit_args()[1::2])
        progress(f"one request {single_s * 1000:.0f} ms, capacity {capacity:.1f} req/s: b {rates.b:g}/s, a "
                 f"{rates.a:g}/s bursting to {rates.a_burst:g}/s")
        limited = _start_router(procs, ROUTERS[True], workers, rates.limit_args())
        phases = {ALONE: (True, {STEADY: rates.b}),
                  LIMITED: (True, {STEADY: rates.b, BURSTING: rates.a_burst}),
                  UNLIMITED: (False, {STEADY: rates.b, BURSTING: rates.a_burst})}
        results: list[TenantResult] = []
        cpu: dict[str, CpuUsage] = {}
        process_cpu: dict[str, ProcessCpu] = {}
        slow: dict[str, tuple[tuple[float, float], ...]] = {}
        progress.start(len(phases), "phases", unit="phase")
        for phase, (limits, loads) in phases.items():
            progress(f"phase {phase}: " + ", ".join(f"{t} at {r:g}/s" for t, r in loads.items())
                     + f" for {config.duration_s:g} s")
            # The phase's router, the workers, and this process: the load generator.
            measured = [*(psutil.Process(procs.procs[name].pid) for name in (ROUTERS[limits], *names)),
                        psutil.Process()]
            before, started = [_cpu_seconds(p) for p in measured], time.monotonic()
            with CpuSampler() as sampler:
                records = asyncio.run(_phase(limited if limits else free, model, loads, config.duration_s,
                                             config.deadline_s))
            elapsed = time.monotonic() - started
            used = [100 * (_cpu_seconds(p) - b) / elapsed for p, b in zip(measured, before)]
            cpu[phase] = sampler.usage()
            process_cpu[phase] = ProcessCpu(router=used[0], workers=sum(used[1:-1]), load_generator=used[-1])
            results += [summarize(phase, tenant, rate, records, config.deadline_s) for tenant, rate in loads.items()]
            slow[phase] = slowest(STEADY, records, config.deadline_s)
            progress.advance()
            procs.check_alive(list(procs.procs))
            time.sleep(PAUSE_S)
    finally:
        procs.stop()
    return TenantsReport(meta=meta, results=tuple(results), cpu=cpu, process_cpu=process_cpu, slowest=slow)

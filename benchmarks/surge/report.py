"""The surge benchmark's figures (pure): per-request results in, percentiles, cost, ratios and reports out.

Every time is in seconds from the surge's start (the first request of the replay), so a warm worker's
provisioning is negative. Definitions, also printed with the report:

- TTFT: from the request's scheduled arrival (not its actual send: a late load generator must not hide
  queueing) to the first token received; percentiles over the answered requests only, linear interpolation
  (the report says how many of how many: ``first100_answered`` of ``first100_requests``, ``answered`` of
  ``requests``). ``first100`` is over the first ``first_n`` requests of the replay (100 unless set). A
  strategy with a failed or refused request passes no ratio target and is never W* nor "as good": its
  percentiles leave those out.
- A request is answered (HTTP 200 and a complete stream), rejected (HTTP 429) or failed (anything else:
  another status, a stream error, no answer in time).
- all ready: when the last cold worker scaled up could serve at full speed (health ``ready``); None if one
  never did, or none was scaled up (a warm worker was ready before the surge).
- Cost: worker-seconds, each worker from its provisioning (the scale-up decision, its agent's assignment
  where none is known, or ``pre_surge_s`` before the surge for a warm worker) while it holds a replica, up
  to the cost horizon: the run's end (the last answer, or the last worker ready if later) plus
  ``cost_tail_s`` (the daemon's keep-alive and scale-down cooldown and a margin), the same rule for every
  strategy, fixed pools included, so the replicas a daemon keeps after its last surge are billed as a fixed
  pool's idle time is (before this, the cost ended at the run's end); cost per 1k output tokens =
  worker-seconds / (output tokens / 1000).
- Ready ratio: for each interval a cold worker held a replica, (its last block verified in it - the interval's
  start, its scale-up decision as for the cost) / the floor S/B; ``ready_ratio_to_floor_max`` is the run's
  largest.
- Ratios compare strategies within one repeat (the same machine state), then take the median over the
  repeats: ``a/b`` of a metric is a's value over b's (for TTFT, how many times lower b is). A pipecast
  variant with W warm workers is judged against unicast with W (n/a where none ran); pipelines against
  plain unicast, as their target is set, each side's warm workers named.
"""

import csv
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from benchmarks.surge.strategies import BASELINE, FIXED, ORACLE_SUFFIX, PIPECAST, PIPECAST_PIPELINES, WARM_POOL
from pipecast.router.discovery import PIPELINE_KEY_PREFIX
from pipecast.router.signals import percentile as sorted_percentile

STATUSES = ("ok", "rejected", "failed")
FIRST_N = 100
# The bar: pipecast's p99 TTFT over the first requests at least this many times lower than unicast's.
TARGET_FIRST_P99_RATIO = 5.0
# Where a variant has its own bar: with pipelines, against unicast from a store of 8 links' egress (where
# every cold worker pulls its own copy at its full link rate, so plain multicast has no edge) ...
TARGET_FIRST_P99_RATIO_OF = {PIPECAST_PIPELINES: 2.0}
# ... judged only where the store has that much (issue 14: 3200 Mbit/s at 400 Mbit/s links).
TARGET_STORE_LINKS_OF = {PIPECAST_PIPELINES: 8}
# Every worker a daemon-scaled pipecast adds holds the model within this many times S/B of its scale-up.
TARGET_READY_TO_FLOOR = 1.15
# The long run's bar: pipecast with the daemon at least this much cheaper than W*, the smallest fixed warm pool
# whose overall p99 TTFT is as good (FaaScale reports 31.3%).
TARGET_SAVING_VS_W_STAR = 0.30
# The daemon's bar: its first-requests p99 TTFT at most this many times the oracle's.
TARGET_DAEMON_TO_ORACLE = 1.3
# A warm pool "matches" pipecast when its first-requests p99 TTFT is at most this much above pipecast's.
MATCH_TOLERANCE = 1.10
# The variants whose target is set against plain unicast whatever the warm workers (issue 14: pipelines, one warm
# source by default, "at least 2x lower than unicast"): judged against it, each side's warm count named.
AGAINST_PLAIN_BASELINE = frozenset({PIPECAST_PIPELINES})
# Metrics compared between strategies (RunMetrics field names).
RATIO_METRICS = ("first100_ttft_p50_seconds", "first100_ttft_p99_seconds", "ttft_p99_seconds", "all_ready_seconds",
                 "worker_seconds")
CSV_COLUMNS = ("strategy", "repeat", "index", "arrival_s", "sent_s", "status", "http_status", "worker", "ttft_s",
               "latency_s", "queue_s", "prompt_tokens", "max_tokens", "output_tokens", "error")


@dataclass(frozen=True)
class RequestResult:
    """What happened to one request (times from the surge's start; ``ttft_s`` from its scheduled arrival)."""

    index: int
    arrival_s: float  # scheduled
    sent_s: float  # actually sent
    prompt_tokens: int
    max_tokens: int
    status: str  # one of STATUSES
    http_status: int | None = None
    worker: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None  # to the last token
    queue_s: float | None = None  # waited in the router (its x-pipecast-queue-seconds)
    output_tokens: int = 0
    error: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"request {self.index}: status {self.status!r} is not one of {', '.join(STATUSES)}")

    @property
    def finished_s(self) -> float:
        """When its answer ended (or it was refused or failed)."""
        return self.arrival_s + (self.latency_s or 0.0)


@dataclass(frozen=True)
class WorkerTimeline:
    """One worker's life in a run: provisioning, each block's arrival, when it could serve."""

    name: str
    warm: bool
    provisioned_s: float | None  # None: never scaled up
    blocks_total: int
    block_times: tuple[float, ...] = ()  # each received block verified, sorted (a warm worker received none)
    partial_s: float | None = None  # health first said "partial" (serving while loading)
    ready_s: float | None = None  # health first said "ready"
    #: When it held a replica: (start, end) pairs, end None for "to the run's end"; None: from provisioning on.
    billed: tuple[tuple[float, float | None], ...] | None = None

    def billed_seconds(self, end_s: float) -> float:
        """Its cost up to ``end_s``: each billed interval, or provisioning to ``end_s``."""
        if self.billed is None:
            return 0.0 if self.provisioned_s is None else max(end_s - self.provisioned_s, 0.0)
        return sum(max((end_s if stop is None else min(stop, end_s)) - start, 0.0) for start, stop in self.billed)

    @property
    def serving_s(self) -> float | None:
        """When it could first take a request: partial or ready, whichever came first."""
        times = [t for t in (self.partial_s, self.ready_s) if t is not None]
        return min(times) if times else None


@dataclass(frozen=True)
class RunRecord:
    """One strategy's run in one repeat: every request, every worker, and the machine's CPU."""

    strategy: str
    repeat: int
    requests: tuple[RequestResult, ...]
    workers: tuple[WorkerTimeline, ...]
    cpu_mean_percent: float
    cpu_p95_percent: float
    cpu_saturated: bool
    notes: Mapping[str, object] = field(default_factory=dict)  # e.g. the control plane's plan and sources
    #: Every strategy's workers are billed this long past the run's end (:attr:`cost_horizon_s`).
    cost_tail_s: float = 0.0
    #: S/B over one link, for the ready ratio; None: unknown (no ratio).
    floor_s: float | None = None

    @property
    def end_s(self) -> float:
        """The run's end: the last answer, or the last worker ready if later."""
        ends = [r.finished_s for r in self.requests] + [w.ready_s for w in self.workers if w.ready_s is not None]
        return max(ends, default=0.0)

    @property
    def cost_horizon_s(self) -> float:
        """Where billing ends: :attr:`end_s` + :attr:`cost_tail_s`. A daemon keeps replicas for its keep-alive
        after the last request; billed to the same horizon, a fixed pool pays the same stretch idle."""
        return self.end_s + self.cost_tail_s


@dataclass(frozen=True)
class RunMetrics:
    """The figures of one run (field names are the JSON keys)."""

    requests: int
    answered: int
    rejected: int
    failed: int
    first100_ttft_p50_seconds: float | None
    first100_ttft_p95_seconds: float | None
    first100_ttft_p99_seconds: float | None
    ttft_p50_seconds: float | None
    ttft_p95_seconds: float | None
    ttft_p99_seconds: float | None
    first_serving_seconds: float | None  # the first cold worker took requests (partial or ready)
    all_ready_seconds: float | None
    output_tokens: int
    tokens_per_s: float
    duration_seconds: float
    worker_seconds: float
    cost_per_1k_output_tokens: float | None  # worker-seconds
    send_lag_p99_seconds: float | None  # how late the load generator sent (should be ~0)
    cpu_mean_percent: float
    cpu_saturated: bool
    # Answered by a cross-node pipeline (the router's ``pipeline:`` units), and the first of their first tokens.
    pipelined_requests: int = 0
    first_pipelined_token_seconds: float | None = None
    # The percentiles' population: of the first ``first_n`` requests, how many were answered.
    first100_answered: int = 0
    first100_requests: int = 0
    cost_horizon_seconds: float = 0.0  # where the worker-seconds stop (RunRecord.cost_horizon_s)
    # The slowest load of a cold worker, as a multiple of S/B (None: no floor, none loaded, or one never did).
    ready_ratio_to_floor_max: float | None = None


# Numeric figures, medians over repeats in the JSON (the saturation flag is "any run" instead).
METRIC_NAMES = tuple(f.name for f in fields(RunMetrics) if f.name != "cpu_saturated")


# -- statistics ----------------------------------------------------------------------------------------


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by linear interpolation between closest ranks; None when empty."""
    ordered = sorted(values)
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    return sorted_percentile(ordered, q) if ordered else None


def median_or_none(values: Sequence[float | None]) -> float | None:
    """The median, or None when any value is None (a run where the figure does not exist)."""
    if not values or any(v is None for v in values):
        return None
    return statistics.median(values)


def worker_seconds(workers: Sequence[WorkerTimeline], end_s: float) -> float:
    """Each worker's billed time up to ``end_s`` (:meth:`WorkerTimeline.billed_seconds`), summed."""
    return sum(w.billed_seconds(end_s) for w in workers)


def ready_ratios(worker: WorkerTimeline, floor_s: float) -> list[float | None]:
    """For each interval a cold worker held a replica: (its ``blocks_total``-th block verified in it - the
    interval's start) / ``floor_s``; None for an interval held to the end without every block (it never held
    the model). An interval released before it held every block is left out (it was never meant to serve)."""
    if worker.warm or worker.provisioned_s is None:
        return []
    out: list[float | None] = []
    for start, stop in worker.billed or ((worker.provisioned_s, None),):
        times = sorted(t for t in worker.block_times if t >= start and (stop is None or t <= stop))
        if len(times) >= worker.blocks_total:
            out.append((times[worker.blocks_total - 1] - start) / floor_s)
        elif stop is None:
            out.append(None)
    return out


def unfinished_ratios(worker: WorkerTimeline, floor_s: float) -> list[float]:
    """For each interval a cold worker was released in before it held every block: its length / ``floor_s``, a
    lower bound of what its load would have taken."""
    if worker.warm or worker.provisioned_s is None:
        return []
    return [(stop - start) / floor_s for start, stop in worker.billed if stop is not None
            and sum(1 for t in worker.block_times if start <= t <= stop) < worker.blocks_total]


def ready_ratio_max(run: RunRecord) -> float | None:
    """The largest :func:`ready_ratios` of the run's workers; None without a floor, without a cold worker
    loaded, or when one never held the model."""
    if not run.floor_s:
        return None
    ratios_ = [r for w in run.workers for r in ready_ratios(w, run.floor_s)]
    return None if not ratios_ or None in ratios_ else max(ratios_)


def run_metrics(run: RunRecord, first_n: int = FIRST_N) -> RunMetrics:
    """The figures of one run (see the module docstring for the definitions)."""
    ordered = sorted(run.requests, key=lambda r: (r.arrival_s, r.index))
    answered = [r for r in ordered if r.status == "ok"]
    first = [r.ttft_s for r in ordered[:first_n] if r.status == "ok"]
    every = [r.ttft_s for r in answered]
    cold = [w for w in run.workers if not w.warm]
    serving = [w.serving_s for w in cold if w.serving_s is not None]
    # Scaled up: a warm worker was ready before the surge, one never scaled up was never expected.
    ready = [w.ready_s for w in cold if w.provisioned_s is not None]
    end = run.end_s
    tokens = sum(r.output_tokens for r in answered)
    cost = worker_seconds(run.workers, run.cost_horizon_s)
    pipelined = [r.arrival_s + r.ttft_s for r in answered if (r.worker or "").startswith(PIPELINE_KEY_PREFIX)]
    return RunMetrics(
        requests=len(ordered), answered=len(answered),
        rejected=sum(r.status == "rejected" for r in ordered), failed=sum(r.status == "failed" for r in ordered),
        first100_ttft_p50_seconds=percentile(first, 50), first100_ttft_p95_seconds=percentile(first, 95),
        first100_ttft_p99_seconds=percentile(first, 99),
        ttft_p50_seconds=percentile(every, 50), ttft_p95_seconds=percentile(every, 95),
        ttft_p99_seconds=percentile(every, 99),
        first_serving_seconds=min(serving) if serving else None,
        all_ready_seconds=None if not ready or None in ready else max(ready),
        output_tokens=tokens, tokens_per_s=tokens / end if end > 0 else 0.0, duration_seconds=end,
        worker_seconds=cost, cost_per_1k_output_tokens=cost / (tokens / 1000) if tokens else None,
        send_lag_p99_seconds=percentile([r.sent_s - r.arrival_s for r in ordered], 99),
        cpu_mean_percent=run.cpu_mean_percent, cpu_saturated=run.cpu_saturated,
        pipelined_requests=len(pipelined), first_pipelined_token_seconds=min(pipelined, default=None),
        first100_answered=len(first), first100_requests=len(ordered[:first_n]),
        cost_horizon_seconds=run.cost_horizon_s, ready_ratio_to_floor_max=ready_ratio_max(run))


# -- strategies and ratios -----------------------------------------------------------------------------


@dataclass(frozen=True)
class StrategySummary:
    """A strategy over its repeats: each figure's median (the saturation flag: any run)."""

    strategy: str
    description: str
    warm_workers: int
    first_n: int  # the "first100" figures cover this many requests
    runs: tuple[RunRecord, ...]
    metrics: tuple[RunMetrics, ...]

    def median(self, name: str) -> float | None:
        """Median over the repeats of the RunMetrics field ``name``."""
        return median_or_none([getattr(m, name) for m in self.metrics])

    def failed(self) -> int:
        """Failed requests over every repeat (their TTFT is in no percentile)."""
        return sum(m.failed for m in self.metrics)

    def rejected(self) -> int:
        """Refused (429) requests over every repeat (their TTFT is in no percentile either)."""
        return sum(m.rejected for m in self.metrics)

    def left_out(self) -> str:
        """Its failed and refused requests over every repeat ("2 failed, 60 refused"); "" for none. Refusing
        requests speeds up the answered ones, so a strategy with any passes no target and is never W*."""
        return ", ".join(f"{n} {what}" for n, what in ((self.failed(), "failed"), (self.rejected(), "refused")) if n)

    def population(self) -> str:
        """Which requests its TTFT percentiles cover: the answered ones, of how many (every repeat)."""
        def total(name: str) -> int:
            return sum(getattr(m, name) for m in self.metrics)

        return (f"answered requests only: first-{self.first_n} {total('first100_answered')} of "
                f"{total('first100_requests')}, all {total('answered')} of {total('requests')} "
                f"({self.rejected()} rejected, {self.failed()} failed left out)")

    def to_json(self) -> dict:
        out: dict = {"description": self.description, "warm_workers": self.warm_workers, "runs": len(self.runs),
                     "first_n": self.first_n}
        for name in METRIC_NAMES:
            out[name] = self.median(name)
        out["cpu_saturated"] = any(m.cpu_saturated for m in self.metrics)
        out["ttft_percentiles_over"] = self.population()
        scaled_by = self.runs[0].notes.get("scaled_by", "oracle") if self.runs else "oracle"
        out["scaled_by"], out["oracle"] = scaled_by, scaled_by == "oracle"
        # The first repeat's decisions (every repeat's are in its notes).
        out["scale_events"] = [{k: e[k] for k in ("t", "action", "count", "node_ids", "reason", "desired", "actual")}
                               for e in (self.runs[0].notes.get("scale_events", []) if self.runs else [])]
        out["repeats"] = [{"repeat": run.repeat, **asdict(m), "notes": dict(run.notes),
                           "workers": [asdict(w) for w in run.workers]}
                          for run, m in zip(self.runs, self.metrics)]
        return out


def summarize(strategy: str, description: str, warm_workers: int, runs: Sequence[RunRecord],
              first_n: int = FIRST_N) -> StrategySummary:
    """The summary of ``runs`` of one strategy, in repeat order."""
    ordered = tuple(sorted(runs, key=lambda r: r.repeat))
    return StrategySummary(strategy, description, warm_workers, first_n, ordered,
                           tuple(run_metrics(r, first_n) for r in ordered))


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def ratios(summaries: Sequence[StrategySummary]) -> dict[str, dict[str, float | None]]:
    """For every ordered pair ``a/b`` of strategies: the median over repeats of a's metric over b's,
    each ratio taken within one repeat."""
    out = {}
    for a in summaries:
        for b in summaries:
            if a is b:
                continue
            by_repeat_a = {run.repeat: m for run, m in zip(a.runs, a.metrics)}
            by_repeat_b = {run.repeat: m for run, m in zip(b.runs, b.metrics)}
            shared = sorted(set(by_repeat_a) & set(by_repeat_b))
            out[f"{a.strategy}/{b.strategy}"] = {
                metric: median_or_none([ratio(getattr(by_repeat_a[k], metric), getattr(by_repeat_b[k], metric))
                                        for k in shared])
                for metric in RATIO_METRICS}
    return out


def verdicts(summaries: Sequence[StrategySummary], pair_ratios: Mapping[str, Mapping[str, float | None]],
             conditions: Mapping[str, object] | None = None) -> list[str]:
    """The issue's targets, each met or not, for every pipecast variant (``pipecast``, ``pipecast-*``, either
    with a warm count ``:W``), and what saturated the machine. ``conditions`` are the run's settings (the
    report's meta: ``link_mbit``, ``store_mbit``): a target set for some settings is judged only under them."""
    first_n = summaries[0].first_n if summaries else FIRST_N
    variants = [s for s in summaries if _base(s.strategy).partition("-")[0] == PIPECAST]
    by_name = {s.strategy: s for s in summaries}
    lines = []
    for pipecast in variants:
        lines += _baseline_verdict(pipecast, by_name, pair_ratios, conditions or {}, first_n)
        reference, ref_cost = pipecast.median("first100_ttft_p99_seconds"), pipecast.median("worker_seconds")
        for s in summaries:
            if not s.strategy.startswith(WARM_POOL):
                continue
            p99, cost = s.median("first100_ttft_p99_seconds"), s.median("worker_seconds")
            if p99 is None or reference is None or cost is None or ref_cost is None:
                lines.append(f"{s.strategy}: not comparable with {pipecast.strategy} (a run answered no request)")
                continue
            # A pool whose p99 leaves failed or refused requests out is not "as good".
            matches = p99 <= reference * MATCH_TOLERANCE and not s.left_out()
            failed = f", {s.left_out()} left out of its p99" if s.left_out() else ""
            lines.append(f"{s.strategy} ({s.warm_workers} warm): first-{first_n} p99 {p99:.2f} s{failed} vs "
                         f"{pipecast.strategy} {reference:.2f} s ({'as good or better' if matches else 'worse'}: "
                         f"tolerance {MATCH_TOLERANCE - 1:.0%}); {cost:.0f} vs {ref_cost:.0f} worker-seconds "
                         f"({cost / ref_cost:.2f}x: {'costs more' if cost > ref_cost else 'costs no more'})")
            if pipecast.strategy.partition(":")[0] == PIPECAST_PIPELINES and s.warm_workers == \
                    pipecast.warm_workers + 1:
                met = _judged(reference <= p99 and ref_cost < cost, pipecast)
                lines.append(f"{pipecast.strategy} ({pipecast.warm_workers} warm) against {s.strategy}: first-"
                             f"{first_n} p99 at or below it with fewer worker-seconds ({met})")
        if pipecast.runs and pipecast.runs[0].notes.get("scaled_by") == "daemon":
            lines += _ready_verdict(pipecast)
    # Each daemon-scaled strategy against its oracle with the same warm count (pipecast:2, pipecast-oracle:2).
    pairs = [(s.strategy, f"{base}{ORACLE_SUFFIX}{s.strategy[len(base):]}") for base in (PIPECAST, BASELINE)
             for s in summaries if _base(s.strategy) == base]
    for daemon, oracle in pairs:
        value = pair_ratios.get(f"{daemon}/{oracle}", {}).get("first100_ttft_p99_seconds")
        if daemon in by_name and oracle in by_name:
            shown = "n/a" if value is None else f"{value:.2f}x"
            met = _judged(value is not None and value <= TARGET_DAEMON_TO_ORACLE, by_name[daemon])
            lines.append(f"first-{first_n} p99 TTFT, {daemon} (scaled by the daemon) / {oracle} = {shown} "
                         f"(target <= {TARGET_DAEMON_TO_ORACLE:g}x: {met})")
    lines += _long_run_verdicts(by_name, pair_ratios)
    failing = [f"{s.strategy} {s.left_out()} of {sum(m.requests for m in s.metrics)}" for s in summaries
               if s.left_out()]
    lines.append(f"failed or refused requests, in no percentile: {'; '.join(failing)} (target 0: NOT met)" if failing
                 else "failed or refused requests: none in any run (target 0: met)")
    saturated = [s.strategy for s in summaries if any(m.cpu_saturated for m in s.metrics)]
    lines.append(f"CPU-bound run(s), compute saturated this machine: {', '.join(saturated)}" if saturated
                 else "CPU not saturated in any run")
    return lines


def _judged(met: bool, *judged: StrategySummary) -> str:
    """A target's outcome: NOT met, whatever the figures, where a judged strategy had failed or refused
    requests (its percentiles leave them out, so its figures look better than its service was); else met or NOT
    met."""
    failed = [f"{s.strategy} had {s.left_out()} request(s), left out of its percentiles" for s in judged
              if s.left_out()]
    return f"NOT met: {'; '.join(failed)}" if failed else "met" if met else "NOT met"


def _baseline_verdict(pipecast: StrategySummary, by_name: Mapping[str, StrategySummary],
                      pair_ratios: Mapping[str, Mapping[str, float | None]], conditions: Mapping[str, object],
                      first_n: int) -> list[str]:
    """``pipecast``'s first-requests p99 against unicast scaled the same way (:func:`_baseline_of`): an
    ``-oracle`` variant against ``unicast-oracle`` (n/a when that was not run), a daemon-scaled one against
    ``unicast`` (the daemon's)."""
    family = _family(pipecast)
    oracle = _base(pipecast.strategy).endswith(ORACLE_SUFFIX)
    name = BASELINE + ORACLE_SUFFIX if oracle else BASELINE
    baseline, why = _baseline_of(pipecast, by_name, name)
    if baseline is None:
        why = why or (f"{name} not run" if oracle else "")
        return [f"first-{first_n} p99 TTFT, {name} / {pipecast.strategy} = n/a ({why})"] if why else []
    label = f"first-{first_n} p99 TTFT, {_pair(baseline, pipecast)}"
    value = pair_ratios.get(f"{baseline.strategy}/{pipecast.strategy}", {}).get("first100_ttft_p99_seconds")
    shown = "n/a" if value is None else f"{value:.1f}x"
    target = TARGET_FIRST_P99_RATIO_OF.get(family, TARGET_FIRST_P99_RATIO)
    links = TARGET_STORE_LINKS_OF.get(family)
    if links is not None:
        link, store = conditions.get("link_mbit"), conditions.get("store_mbit")
        if not isinstance(link, (int, float)) or not isinstance(store, (int, float)) or store < links * link:
            needed = f"{links * link:g} Mbit/s" if isinstance(link, (int, float)) else f"{links} links' worth"
            this = f"{store:g} Mbit/s" if isinstance(store, (int, float)) else "not given"
            return [f"{label} = {shown} (target >= {target:g}x with the store at {needed}; this run's store "
                    f"{this}: n/a)"]
    return [f"{label} = {shown} (target >= {target:g}x: {_judged(value is not None and value >= target, pipecast)})"]


def _baseline_of(pipecast: StrategySummary, by_name: Mapping[str, StrategySummary],
                 baseline: str) -> tuple[StrategySummary | None, str]:
    """The ``baseline`` run (``unicast`` or ``unicast-oracle``, any warm count ``:W``) ``pipecast`` is judged
    against: the one with as many warm workers (a warm worker answers the first requests at once, however the
    cold ones load), or plain ``baseline`` for a variant whose target is set against it
    (:data:`AGAINST_PLAIN_BASELINE`); else None and why ("" where no ``baseline`` was run)."""
    if _family(pipecast) in AGAINST_PLAIN_BASELINE:
        return by_name.get(baseline), ""
    runs = [s for name, s in by_name.items() if _base(name) == baseline]
    same = next((s for s in runs if s.warm_workers == pipecast.warm_workers), None)
    if same is not None or not runs:
        return same, ""
    return None, (f"no {baseline} with {pipecast.warm_workers} warm was run, only "
                  + ", ".join(f"{s.strategy} with {s.warm_workers}" for s in runs))


def _pair(baseline: StrategySummary, pipecast: StrategySummary) -> str:
    """``baseline / pipecast``, with each one's warm workers where they differ."""
    if baseline.warm_workers == pipecast.warm_workers:
        return f"{baseline.strategy} / {pipecast.strategy}"
    return (f"{baseline.strategy} ({baseline.warm_workers} warm) / {pipecast.strategy} ({pipecast.warm_workers} "
            f"warm)")


def _ready_verdict(pipecast: StrategySummary) -> list[str]:
    """Every cold worker of a daemon-scaled pipecast holding the model within TARGET_READY_TO_FLOOR x S/B of its
    scale-up, over every repeat (nothing without a floor)."""
    runs = [run for run in pipecast.runs if run.floor_s]
    if not runs:
        return []
    loads = [r for run in runs for w in run.workers for r in ready_ratios(w, run.floor_s)]
    label = f"{pipecast.strategy}: every worker scaled up holding the model within {TARGET_READY_TO_FLOOR:g}x S/B"
    # Released before it held the model, a load is no figure; one released after the target had passed is a miss.
    late = max((r for run in runs for w in run.workers for r in unfinished_ratios(w, run.floor_s)), default=0.0)
    if late > TARGET_READY_TO_FLOOR:
        return [f"{label}: NOT met (a worker was released {late:.2f}x S/B after its scale-up without the model)"]
    if not loads:
        return [f"{label}: n/a (no worker scaled up held the model before its release)"]
    if None in loads:
        return [f"{label}: NOT met (a worker scaled up never held the whole model)"]
    worst = max(loads)
    return [f"{label} of its scale-up: the slowest {worst:.2f}x, of {len(loads)} load(s) in {len(runs)} repeat(s) "
            f"({'met' if worst <= TARGET_READY_TO_FLOOR else 'NOT met'})"]


def _base(strategy: str) -> str:
    """A strategy's registered name, without its warm count (``pipecast:2`` is ``pipecast``)."""
    return strategy.partition(":")[0]


def _family(summary: StrategySummary) -> str:
    """A strategy's registered name without its warm count nor ``-oracle`` (``pipecast-oracle:2`` is ``pipecast``)."""
    return _base(summary.strategy).removesuffix(ORACLE_SUFFIX)


def oscillations(events: Sequence[Mapping], cooldown_s: float) -> int:
    """Scale-ups that came within ``cooldown_s`` of a release: the thrash a policy must not do."""
    releases = [e["t"] for e in events if e["action"] == "release"]
    return sum(any(0 <= e["t"] - t < cooldown_s for t in releases) for e in events if e["action"] == "scale_up")


def _long_run_verdicts(by_name: Mapping[str, StrategySummary],
                       pair_ratios: Mapping[str, Mapping[str, float | None]]) -> list[str]:
    """The long run's targets: the daemon's thrash, W* (the smallest fixed pool as good as pipecast) and its
    cost, and pipecast's p99 against the daemon with unicast loading; for each ``pipecast`` measured (any warm
    count)."""
    lines = []
    for s in by_name.values():
        if s.runs and s.runs[0].notes.get("scaled_by") == "daemon":
            cooldown = s.runs[0].notes.get("policy", {}).get("scale_down_cooldown_s", 0.0)
            count = sum(oscillations(run.notes.get("scale_events", []), cooldown) for run in s.runs)
            lines.append(f"{s.strategy}: {count} scale-up(s) within the {cooldown:g} s cooldown of a release "
                         f"(target 0: {'met' if count == 0 else 'NOT met'})")
    for pipecast in (s for name, s in by_name.items() if _base(name) == PIPECAST):
        lines += _w_star_verdicts(pipecast, by_name, pair_ratios)
    return lines


def _w_star_verdicts(pipecast: StrategySummary, by_name: Mapping[str, StrategySummary],
                     pair_ratios: Mapping[str, Mapping[str, float | None]]) -> list[str]:
    """W* and its cost against ``pipecast`` (``pipecast`` or ``pipecast:W``), and its p99 against unicast's
    with the daemon and as many warm workers (:func:`_baseline_of`)."""
    lines, label = [], pipecast.strategy
    p99, cost = pipecast.median("ttft_p99_seconds"), pipecast.median("worker_seconds")
    fixed = sorted((s for name, s in by_name.items() if name.startswith(f"{FIXED}:")), key=lambda s: s.warm_workers)
    # A pool that failed or refused requests has a p99 over the ones it answered: it is no W*, however low that p99.
    failing = [s for s in fixed if s.left_out()]
    if failing and p99 is not None and cost:
        lines.append("W* leaves out " + "; ".join(f"{s.strategy} ({s.left_out()} request(s), in no percentile)"
                                                  for s in failing))
    fixed = [s for s in fixed if not s.left_out()]
    if fixed and p99 is not None and cost:
        w_star = next((s for s in fixed if (s.median("ttft_p99_seconds") or math.inf) <= p99), None)
        if w_star is None:
            lines.append(f"W*: no fixed pool measured ({', '.join(s.strategy for s in fixed)}) reached {label}'s "
                         f"overall p99 TTFT {p99:.2f} s")
        else:
            # Within each repeat, then the median (module docstring): a median over a median judged a saving the
            # repeats did not show (100/200/300 against 400/250/310: 35% where the JSON's ratio says 20%).
            share = pair_ratios.get(f"{label}/{w_star.strategy}", {}).get("worker_seconds")
            saving = 0.0 if share is None else 1 - share
            met = "n/a: no repeat of both with a cost" if share is None else \
                _judged(saving >= TARGET_SAVING_VS_W_STAR, pipecast)
            lines.append(f"W* = {w_star.warm_workers} ({w_star.strategy}: overall p99 "
                         f"{w_star.median('ttft_p99_seconds'):.2f} s <= {label}'s {p99:.2f} s); {label} uses "
                         f"{abs(saving):.0%} {'fewer' if saving >= 0 else 'more'} worker-seconds (medians {cost:.0f} "
                         f"vs {w_star.median('worker_seconds'):.0f}; "
                         f"target >= {TARGET_SAVING_VS_W_STAR:.0%}: {met})")
    baseline, why = _baseline_of(pipecast, by_name, BASELINE)
    if why:
        lines.append(f"overall p99 TTFT, {BASELINE} (daemon) / {label} (daemon) = n/a ({why})")
    elif baseline is not None and baseline.runs[0].notes.get("scaled_by") == "daemon":
        value = pair_ratios.get(f"{baseline.strategy}/{label}", {}).get("ttft_p99_seconds")
        if value is not None:
            lines.append(f"overall p99 TTFT, {baseline.strategy} (daemon) / {label} (daemon) = {value:.1f}x (target >= "
                         f"{TARGET_FIRST_P99_RATIO:g}x: {_judged(value >= TARGET_FIRST_P99_RATIO, pipecast)})")
    return lines


# -- output --------------------------------------------------------------------------------------------


def to_json(meta: Mapping[str, object], summaries: Sequence[StrategySummary]) -> dict:
    """The ``--json`` object: meta, ``strategies`` keyed by name, pairwise ``ratios`` and ``verdicts``."""
    pair_ratios = ratios(summaries)
    return {"meta": dict(meta), "strategies": {s.strategy: s.to_json() for s in summaries}, "ratios": pair_ratios,
            "verdicts": verdicts(summaries, pair_ratios, meta)}


def request_rows(summaries: Sequence[StrategySummary]) -> list[dict]:
    """One CSV row per request of every run."""
    rows = []
    for s in summaries:
        for run in s.runs:
            for r in sorted(run.requests, key=lambda r: r.index):
                row = asdict(r)
                rows.append({"strategy": s.strategy, "repeat": run.repeat,
                             **{c: row[c] for c in CSV_COLUMNS if c in row}})
    return rows


def write_requests_csv(path: Path, summaries: Sequence[StrategySummary]) -> Path:
    """Write every request (arrival, worker, TTFT, tokens, ...) as CSV at ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(request_rows(summaries))
    return path


def _s(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_report(meta: Mapping[str, object], summaries: Sequence[StrategySummary]) -> str:
    """The text report: conditions, a table of medians per strategy, ratios and verdicts."""
    pair_ratios = ratios(summaries)
    lines = [str(line) for line in meta.get("headline", ())]
    lines += [f"RETRIED: {r['strategy']} repeat {r['repeat']} failed once: {str(r['error']).splitlines()[0]}"
              for r in meta.get("retried_runs", ())]
    first = f"first{summaries[0].first_n if summaries else FIRST_N} TTFT s p50/p95/p99"
    width = max([14, *(len(s.strategy) for s in summaries)])  # pipecast-pipelines-oracle:1 keeps its columns
    lines += ["", f"{'strategy':<{width}} {'warm':>4} {first:>28} {'all TTFT s p50/p99':>19} "
                  f"{'ready s':>8} {'ans/req':>9} {'429':>4} {'fail':>4} {'tok/s':>6} {'worker-s':>9} "
                  f"{'w-s/1k tok':>10} {'load/SB':>7} {'CPU':>5}"]
    for s in summaries:
        m = s.median
        first = f"{_s(m('first100_ttft_p50_seconds'))}/{_s(m('first100_ttft_p95_seconds'))}/" \
                f"{_s(m('first100_ttft_p99_seconds'))}"
        every = f"{_s(m('ttft_p50_seconds'))}/{_s(m('ttft_p99_seconds'))}"
        # Counts over every repeat: a median of two repeats' 1 and 0 failed requests printed 0.
        answered = f"{sum(x.answered for x in s.metrics)}/{sum(x.requests for x in s.metrics)}"
        flag = " CPU-bound" if any(x.cpu_saturated for x in s.metrics) else ""
        lines.append(f"{s.strategy:<{width}} {s.warm_workers:>4} {first:>28} {every:>19} "
                     f"{_s(m('all_ready_seconds')):>8} {answered:>9} {s.rejected():>4} {s.failed():>4} "
                     f"{_s(m('tokens_per_s'), 1):>6} {_s(m('worker_seconds'), 0):>9} "
                     f"{_s(m('cost_per_1k_output_tokens'), 1):>10} {_s(m('ready_ratio_to_floor_max')):>7} "
                     f"{_s(m('cpu_mean_percent'), 0):>4}%{flag}")
    lines.append("ans/req, 429 and fail: over every repeat, the other figures medians of the repeats; "
                 "TTFT percentiles over the answered requests only (ans/req); worker-s up to each run's cost horizon "
                 "(its end + the daemon's keep-alive and scale-down cooldown, every strategy alike); load/SB: the "
                 "slowest cold worker's scale-up to its last block, over S/B")
    lines += [f"{s.strategy}: TTFT percentiles over {s.population()}" for s in summaries
              if any(m.answered < m.requests for m in s.metrics)]
    for s in summaries:
        events = [e for e in (s.runs[0].notes.get("scale_events", []) if s.runs else [])
                  if e["action"] in ("scale_up", "release")]
        if events:
            shown = "; ".join(f"{'+' if e['action'] == 'scale_up' else '-'}{e['count']} at {e['t']:.1f} s"
                              for e in events)
            lines.append(f"{s.strategy} scale events (repeat {s.runs[0].repeat}): {shown}")
    for s in summaries:
        if any(m.pipelined_requests for m in s.metrics):
            shown = "; ".join(f"{m.pipelined_requests} of {m.answered}" + (
                f", the first token at {m.first_pipelined_token_seconds:.1f} s" if m.pipelined_requests else "")
                for m in s.metrics)
            lines.append(f"{s.strategy} requests answered by pipelines across nodes (per repeat): {shown}")
    lines += ["", "ratios (median over repeats of per-repeat ratios; TTFT a/b = how many times lower b is):"]
    for pair, values in pair_ratios.items():
        if not pair.startswith(f"{BASELINE}/") and f"/{PIPECAST}" not in pair:
            continue  # the pairs that answer the questions; all pairs are in the JSON
        lines.append(f"  {pair:<26} first-n p50 {_s(values['first100_ttft_p50_seconds'], 1)}x, "
                     f"p99 {_s(values['first100_ttft_p99_seconds'], 1)}x; "
                     f"all p99 {_s(values['ttft_p99_seconds'], 1)}x; all ready {_s(values['all_ready_seconds'], 1)}x; "
                     f"worker-s {_s(values['worker_seconds'], 2)}x")
    lines += ["", *(f"verdict: {line}" for line in verdicts(summaries, pair_ratios, meta))]
    return "\n".join(lines)

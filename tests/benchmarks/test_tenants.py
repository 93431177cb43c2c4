"""``pipecast bench tenants``: rates, limits, per-phase figures, the ratio, the report, the CLI's refusals and
a short real run."""

import json

import pytest
from click.testing import CliRunner

from benchmarks.command import bench_group
from benchmarks.cpu import CpuUsage
from benchmarks.tenants import (
    ALONE,
    LIMITED,
    PHASES,
    UNLIMITED,
    ProcessCpu,
    Rates,
    RequestRecord,
    TenantResult,
    TenantsBenchError,
    TenantsConfig,
    TenantsReport,
    choose_rates,
    format_report,
    p99_ratio,
    phase_schedule,
    schedule,
    summarize,
    verdict,
)
from tests.support.packages import tiny_package

RESULT_FIELDS = {"phase", "tenant", "rate_per_s", "sent", "answered", "rejected", "failed", "p50_s", "p95_s", "p99_s",
                 "retry_after_missing", "rejected_by"}
QUIET = CpuUsage(mean_percent=40.0, p95_percent=60.0, samples=8, cores=2)
BUSY = CpuUsage(mean_percent=97.0, p95_percent=100.0, samples=8, cores=2)


@pytest.mark.parametrize("field, value, message", [
    ("workers", 0, "--workers must be >= 1, got 0"),
    ("duration_s", 0.0, "--duration must be > 0, got 0"),
    ("rate_b", -1.0, "--rate-b must be > 0, got -1"),
    ("burst_factor", 1.0, "--burst-factor must be > 1 (a burst above a's rate), got 1"),
])
def test_a_config_refuses_what_cannot_be_measured(tmp_path, field, value, message):
    with pytest.raises(TenantsBenchError) as info:
        TenantsConfig(package=tmp_path, **{field: value})
    assert str(info.value) == message


def test_rates_follow_the_capacity_unless_given(tmp_path):
    chosen = choose_rates(TenantsConfig(package=tmp_path), capacity_per_s=7.123)
    assert (chosen.a, chosen.b, chosen.a_burst) == (1.42, 1.42, pytest.approx(14.2))
    given = choose_rates(TenantsConfig(package=tmp_path, rate_a=3.0, burst_factor=5.0), capacity_per_s=10.0)
    assert (given.a, given.b, given.a_burst) == (3.0, 2.0, 15.0)


def test_a_is_limited_to_its_rate_and_b_has_headroom_over_its_own():
    rates = Rates(a=1.42, b=2.0, burst_factor=10.0)
    assert rates.limits() == {"a": (1.42, 2), "b": (4.0, 4)}
    assert rates.limit_args() == ["--tenant-limit", "a=1.42:2", "--tenant-limit", "b=4:4"]
    assert Rates(a=0.2, b=0.1, burst_factor=10.0).limits() == {"a": (0.2, 1), "b": (0.2, 1)}  # a burst >= 1


def test_a_schedule_is_evenly_spaced_over_the_phase():
    assert schedule(2.0, 3.0) == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert schedule(0.1, 3.0) == [0.0]  # a phase shorter than one interval still sends one


def test_in_a_burst_phase_a_starts_after_b_and_b_sends_throughout_its_burst():
    assert phase_schedule({"b": 2.0}, 2.0) == {"b": [0.0, 0.5, 1.0, 1.5]}
    times = phase_schedule({"b": 2.0, "a": 4.0}, 1.0)
    assert times["a"] == [1.0, 1.25, 1.5, 1.75]  # BURST_DELAY_S later
    assert times["b"] == [0.0, 0.5, 1.0, 1.5]  # until a's burst ends


def _records() -> list[RequestRecord]:
    return [*(RequestRecord("b", i * 0.5, "ok", latency_s=0.1 * (i + 1)) for i in range(9)),
            RequestRecord("b", 4.5, "failed", error="no answer within 10 s"),
            RequestRecord("a", 0.0, "ok", latency_s=0.2),
            RequestRecord("a", 0.1, "rejected", retry_after="1", error="rate_limited"),
            RequestRecord("a", 0.2, "rejected", retry_after=None, error="queue_full"),
            RequestRecord("a", 0.3, "rejected", retry_after="1", error="rate_limited")]


def test_percentiles_cover_admitted_requests_a_failed_one_at_the_deadline():
    b = summarize(LIMITED, "b", 2.0, _records(), deadline_s=10.0)
    assert (b.sent, b.answered, b.rejected, b.failed) == (10, 9, 0, 1)
    assert b.p50_s == pytest.approx(0.55)
    assert b.p99_s == pytest.approx(0.9 + 0.91 * (10.0 - 0.9))  # between 0.9 s and the deadline
    a = summarize(LIMITED, "a", 20.0, _records(), deadline_s=10.0)
    # 429s are counted apart: their quick answers must not flatter the percentiles.
    assert (a.sent, a.answered, a.rejected, a.failed, a.p99_s) == (4, 1, 3, 0, 0.2)
    assert a.rejected_by == {"rate_limited": 2, "queue_full": 1}
    assert a.retry_after_missing == 1


def test_a_tenant_with_no_admitted_request_has_no_percentiles():
    result = summarize(LIMITED, "a", 20.0, [RequestRecord("a", 0.0, "rejected", retry_after="1")], 10.0)
    assert (result.p50_s, result.p99_s, result.rejected) == (None, None, 1)


def _result(phase: str, tenant: str, p99: float | None, rejected: int = 0, failed: int = 0) -> TenantResult:
    return TenantResult(phase, tenant, 2.0 if tenant == "b" else 20.0, sent=40 + rejected + failed, answered=40,
                        rejected=rejected, failed=failed, p50_s=None if p99 is None else p99 / 2,
                        p95_s=None if p99 is None else p99 * 0.9, p99_s=p99, retry_after_missing=0,
                        rejected_by={"rate_limited": rejected} if rejected else {})


def _report(limited_p99: float, cpu: CpuUsage = QUIET) -> TenantsReport:
    meta = {"workers": 2, "package": "pkg", "single_request_s": 0.08, "capacity_per_s": 10.0, "rate_a": 2.0,
            "rate_b": 2.0, "burst_factor": 10.0, "rates_chosen": True, "limits": ["a=2:2", "b=4:4"],
            "duration_s": 20.0, "deadline_s": 10.0, "load_average_at_start": 1.5, "cpu_cores": 2}
    results = (_result(ALONE, "b", 0.1), _result(LIMITED, "b", limited_p99), _result(LIMITED, "a", 0.3, rejected=360),
               _result(UNLIMITED, "b", 10.0, failed=30), _result(UNLIMITED, "a", 10.0, failed=300))
    process_cpu = {ALONE: ProcessCpu(2.0, 30.0, 3.0), LIMITED: ProcessCpu(25.4, 40.0, 30.0),
                   UNLIMITED: ProcessCpu(30.0, 190.0, 35.0)}
    return TenantsReport(meta=meta, results=results, cpu={ALONE: QUIET, LIMITED: cpu, UNLIMITED: QUIET},
                         process_cpu=process_cpu)


def test_the_ratio_is_b_p99_under_the_burst_over_b_alone():
    report = _report(limited_p99=0.115)
    assert report.ratio == pytest.approx(1.15)
    assert p99_ratio(report.results, UNLIMITED) == pytest.approx(100.0)
    assert p99_ratio([_result(ALONE, "b", None), _result(LIMITED, "b", 0.1)], LIMITED) is None
    data = report.to_json()
    assert data["met"] is True and data["target_ratio"] == 1.2
    assert data["process_cpu_percent"][LIMITED] == {"router": 25.4, "workers": 40.0, "load_generator": 30.0}
    assert [(r["phase"], r["tenant"]) for r in data["results"]] == [
        (ALONE, "b"), (LIMITED, "b"), (LIMITED, "a"), (UNLIMITED, "b"), (UNLIMITED, "a")]
    assert all(set(r) == RESULT_FIELDS for r in data["results"])
    json.dumps(data)  # serializable as is
    assert _report(limited_p99=0.2).to_json()["met"] is False


def test_the_report_shows_rates_each_tenant_in_each_phase_and_a_verdict():
    text = format_report(_report(limited_p99=0.2, cpu=BUSY))
    assert "capacity 10.0 req/s" in text
    assert "b 2/s, a 2/s bursting to 20/s (10x): a+b admitted 40% of capacity, a's burst + b 220%" in text
    rows = [line.split() for line in text.splitlines() if line.startswith("burst-limited ")]
    assert rows[1] == ["burst-limited", "a", "20", "400", "40", "360", "0", "150", "270", "300", "0", "97%"]
    assert "429: refused (burst-limited a: 360 rate_limited)" in text
    assert ("CPU by process, % of one core (router / workers / load generator): b-alone 2 / 30 / 3; "
            "burst-limited 25 / 40 / 30; burst-unlimited 30 / 190 / 35") in text
    assert text.splitlines()[-1] == (
        "verdict: b's p99 200 ms while a bursts 10x under the limits (0 of b's requests failed, 0 refused), 100 ms "
        "alone: 2.00x (target <= 1.2x: NOT met); without limits 10000 ms (100.00x), 30 of b's requests failed, 0 "
        "refused; CPU saturated in burst-limited: latencies there measure the machine's contention")


@pytest.mark.parametrize("args, message", [
    (["--burst-factor", "1"], "--burst-factor"),
    (["--workers", "0"], "--workers"),
    (["--rate-a", "0"], "--rate-a"),
])
def test_the_command_refuses_bad_options(args, message):
    result = CliRunner().invoke(bench_group, ["tenants", *args])
    assert result.exit_code == 2 and message in result.output


def test_a_short_run_measures_every_phase(tmp_path):
    """Real workers and routers (about 30 s on a busy 2-core machine): the limits refuse a's excess."""
    package = tiny_package(tmp_path / "pkg", tokenizer=True).path
    json_path = tmp_path / "out.json"
    result = CliRunner().invoke(bench_group, [
        "tenants", "--package", str(package), "--workers", "1", "--duration", "2", "--rate-b", "2", "--rate-a", "2",
        "--json", str(json_path), "--workdir", str(tmp_path / "work")])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    assert "verdict: b's p99 " in result.output
    data = json.loads(json_path.read_text())
    results = {(r["phase"], r["tenant"]): r for r in data["results"]}
    assert set(results) == {(ALONE, "b"), *((phase, tenant) for phase in PHASES[1:] for tenant in "ab")}
    assert results[(ALONE, "b")]["answered"] == 4
    limited = results[(LIMITED, "a")]
    assert limited["sent"] == 40 and limited["rejected"] >= 30 and limited["retry_after_missing"] == 0
    assert limited["rejected_by"].keys() == {"rate_limited"}
    assert results[(UNLIMITED, "a")]["rejected"] == 0  # no limit: every request goes to the workers
    assert set(data["process_cpu_percent"]) == set(PHASES)
    assert data["ratio"] == pytest.approx(results[(LIMITED, "b")]["p99_s"] / results[(ALONE, "b")]["p99_s"])


def test_a_refusal_of_b_while_a_bursts_fails_the_target_and_the_verdict_counts_it():
    """Finding: b's 429s under a's burst were in no percentile: half of b refused and its p99 "met" the target."""
    results = (_result(ALONE, "b", 0.1), _result(LIMITED, "b", 0.1, rejected=40, failed=2),
               _result(LIMITED, "a", 0.3, rejected=360), _result(UNLIMITED, "b", 0.5))
    report = TenantsReport(meta={"burst_factor": 10.0}, results=results, cpu={phase: QUIET for phase in PHASES},
                           process_cpu={})
    assert report.ratio == pytest.approx(1.0) and report.to_json()["met"] is False
    assert verdict(report) == (
        "verdict: b's p99 100 ms while a bursts 10x under the limits (2 of b's requests failed, 40 refused), 100 ms "
        "alone: 1.00x (target <= 1.2x: NOT met: b refused while a bursts, in no percentile); without limits 500 ms "
        "(5.00x), 0 of b's requests failed, 0 refused; CPU not saturated")
    assert "under the limits (0 of b's requests failed, 0 refused), " in verdict(_report(limited_p99=0.115))
    assert "(target <= 1.2x: met)" in verdict(_report(limited_p99=0.115))


def test_b_refused_throughout_the_burst_is_a_miss_not_a_missing_alone():
    """Found in review: every b request refused while a bursts read "no p99 for b alone: no ratio" (b alone had
    one), neither met nor NOT met."""
    records = {ALONE: [RequestRecord("b", i * 0.5, "ok", 0.1) for i in range(40)],
               LIMITED: [RequestRecord("b", i * 0.5, "rejected", None, "1", "rate_limited") for i in range(40)],
               UNLIMITED: [RequestRecord("b", i * 0.5, "ok", 0.5) for i in range(40)]}
    results = tuple(summarize(phase, "b", 2.0, records[phase], 10.0) for phase in PHASES)
    report = TenantsReport(meta={"burst_factor": 10}, results=results, cpu={phase: QUIET for phase in PHASES},
                           process_cpu={})
    assert verdict(report) == "verdict: b had no request answered while a bursts 10x under the limits (0 failed, " \
                              "40 refused): NOT met"

"""``pipecast bench share``: the phases' figures, the report, the CLI's refusals and (slow) a short real run."""

import asyncio
import json
import time
from pathlib import Path

import pytest
from aiohttp import web
from click.testing import CliRunner

from benchmarks.command import bench_group
from benchmarks.cpu import CpuUsage
from benchmarks.share import (
    FULL,
    IDLE,
    SHARED,
    PhaseResult,
    RequestRecord,
    ShareBenchError,
    ShareConfig,
    ShareReport,
    floor_seconds,
    format_report,
    load,
    multicast_window,
    request_records,
    summarize_phase,
)
from pipecast.agent.events import EventLog
from tests.support.packages import tiny_package

MIB = 1 << 20
RESULT_FIELDS = {"phase", "share", "requests", "failed", "p50_seconds", "p95_seconds", "p99_seconds",
                 "multicast_seconds", "floor_seconds", "ratio_to_floor", "cpu_mean_percent", "cpu_saturated"}
QUIET = CpuUsage(mean_percent=20.0, p95_percent=30.0, samples=8, cores=2)
BUSY = CpuUsage(mean_percent=95.0, p95_percent=100.0, samples=8, cores=2)


def test_floor_is_the_package_at_the_share_of_the_link():
    assert floor_seconds(50 * 10**6, 400, 1.0) == pytest.approx(1.0)
    assert floor_seconds(50 * 10**6, 400, 0.8) == pytest.approx(1.25)


def test_a_phase_counts_the_requests_sent_in_its_window_and_failures_at_the_deadline():
    records = [RequestRecord(sent=t, seconds=0.001 * t) for t in range(1, 101)]  # 1..100 ms, sent at t = 1..100
    records += [RequestRecord(sent=50.5, seconds=None), RequestRecord(sent=0.5, seconds=None)]
    result = summarize_phase(FULL, 1.0, records, (1.0, 101.0), deadline_s=2.0, cpu=QUIET,
                             multicast_seconds=4.0, floor=3.5)
    assert (result.requests, result.failed) == (101, 1)  # the failure at 0.5 is outside the window
    assert result.p50_seconds == pytest.approx(0.051)
    assert result.p99_seconds == pytest.approx(0.100)  # the failure counts as 2 s, above every latency
    assert result.p95_seconds < result.p99_seconds
    assert result.ratio_to_floor == pytest.approx(4.0 / 3.5)
    assert RESULT_FIELDS == result.to_json().keys()


def test_percentiles_interpolate_between_ranks():
    records = [RequestRecord(sent=0, seconds=s) for s in (0.1, 0.2, 0.3, 0.4)]
    result = summarize_phase(IDLE, None, records, (0, 1), deadline_s=1.0, cpu=QUIET)
    assert (result.p50_seconds, result.p99_seconds) == pytest.approx((0.25, 0.397))
    assert result.ratio_to_floor is None


def test_a_phase_without_requests_is_an_error():
    with pytest.raises(ShareBenchError, match=r"^phase idle: no request was sent in its 2.00 s window$"):
        summarize_phase(IDLE, None, [RequestRecord(sent=5, seconds=0.1)], (1, 3), deadline_s=1.0, cpu=QUIET)


def test_records_and_the_multicast_window_come_from_the_events():
    client = [{"event": "started"}, {"event": "request", "sent": 1.0, "seconds": 0.002},
              {"event": "request", "sent": 1.1, "seconds": None, "error": "TimeoutError"}]
    assert request_records(client) == [RequestRecord(1.0, 0.002), RequestRecord(1.1, None)]
    events = {"store": [{"event": "listening", "t": 1.0}, {"event": "peer_request", "t": 3.0},
                        {"event": "peer_request", "t": 2.5}],
              "w1": [{"event": "peer_request", "t": 2.6}, {"event": "block_verified", "t": 5.0}],
              "w2": [{"event": "block_verified", "t": 6.0}]}
    assert multicast_window(events) == (2.5, 6.0)
    with pytest.raises(ShareBenchError, match="^the agents' events hold no served request or no verified block"):
        multicast_window({"store": [{"event": "listening", "t": 1.0}]})


@pytest.mark.parametrize(("values", "message"), [
    ({"share": 1.0}, r"--share must be within \(0, 1\) \(share 1 is the phase it is compared with\), got 1"),
    ({"share": 0}, r"--share must be within \(0, 1\) .*got 0"),
    ({"rate_per_s": 0}, "--rate must be > 0, got 0"),
    ({"link_mbit": -1}, "--link-mbit must be > 0, got -1"),
])
def test_a_bad_configuration_is_refused(values, message):
    with pytest.raises(ShareBenchError, match=f"^{message}$"):
        ShareConfig(package=Path("pkg"), **values)


@pytest.mark.parametrize(("args", "message"), [
    (["--share", "1"], "Invalid value for '--share': 1.0 is not in the range 0<x<1."),
    (["--rate", "0"], "Invalid value for '--rate': 0.0 is not in the range x>0."),
    (["--link-queue", "red"], "Invalid value for '--link-queue': 'red' is not one of 'fifo', 'per-peer'."),
])
def test_the_command_refuses_bad_arguments(args, message):
    result = CliRunner().invoke(bench_group, ["share", *args])
    assert result.exit_code == 2 and message in result.output


def _phase(phase: str, share: float | None, p99: float, multicast: float | None,
           cpu: CpuUsage = QUIET) -> PhaseResult:
    floor = None if share is None else 3.0 / share
    return PhaseResult(phase, share, requests=100, failed=0, p50_seconds=p99 / 4, p95_seconds=p99 / 2, p99_seconds=p99,
                       cpu=cpu, multicast_seconds=multicast, floor_seconds=floor)


def test_the_report_shows_each_phase_beside_its_floor_and_a_verdict():
    meta = {"package_id": "ab" * 32, "package_bytes": 160 * MIB, "blocks": 8, "chunk_bytes": MIB, "link_mbit": 400.0,
            "link_queue": "fifo", "mode": "netns", "mode_reason": "asked for", "rate_per_s": 20.0, "deadline_s": 2.0}
    report = ShareReport(meta, (_phase(IDLE, None, 0.002, None), _phase(FULL, 1.0, 0.010, 3.3),
                                _phase(SHARED, 0.8, 0.004, 4.1)))
    text = format_report(report)
    assert "links 400 Mbit/s, one FIFO per link direction (a switch port's); emulated cluster in netns mode" in text
    rows = [line.split() for line in text.splitlines()]
    assert "multicast 1.00 100 0 2.5 5.0 10.0 3.30 3.00 1.10 20%".split() in rows
    assert "multicast+share 0.80 100 0 1.0 2.0 4.0 4.10 3.75 1.09 20%".split() in rows
    assert "idle - 100 0 0.5 1.0 2.0 - - - 20%".split() in rows
    assert text.endswith("verdict: serving p99 10.0 ms while multicasting at the whole link, 4.0 ms at share 0.8 "
                         "(0.40x), 2.0 ms on the idle link; the multicast took 1.24x as long with the share; "
                         "CPU not saturated")
    data = report.to_json()
    assert [r["phase"] for r in data["results"]] == [IDLE, FULL, SHARED]
    assert all(RESULT_FIELDS == r.keys() for r in data["results"])

    busy = ShareReport(meta, (report.results[0], _phase(FULL, 1.0, 0.010, 3.3, BUSY), report.results[2]))
    assert format_report(busy).endswith("; CPU-bound run: measures the CPU, not the links (multicast)")


@pytest.mark.slow
def test_a_short_run_measures_three_phases_and_writes_json(tmp_path):
    root = tmp_path / "pkg"
    tiny_package(root, layers=4, layer_bytes=4 * MIB, chunk_bytes=MIB)
    json_path = tmp_path / "out.json"
    result = CliRunner().invoke(bench_group, [
        "share", "--package", str(root), "--link-mbit", "200", "--rate", "40", "--idle-seconds", "2",
        "--json", str(json_path), "--workdir", str(tmp_path / "work")])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    assert "phase multicast+share: multicast " in result.output  # progress on stdout
    assert "verdict: serving p99 " in result.output
    data = json.loads(json_path.read_text())
    assert [(r["phase"], r["share"]) for r in data["results"]] == [(IDLE, None), (FULL, 1.0), (SHARED, 0.8)]
    for r in data["results"]:
        assert r["requests"] > 0 and 0 < r["p50_seconds"] <= r["p95_seconds"] <= r["p99_seconds"]
    full, shared = data["results"][1:]
    # The share slows the multicast to about its own floor, S/(0.8 x B): it is enforced.
    assert shared["floor_seconds"] == pytest.approx(full["floor_seconds"] / 0.8)
    assert shared["multicast_seconds"] > full["multicast_seconds"]


async def test_the_client_records_every_request_in_a_file_of_its_own_whatever_the_event_logs_rate(tmp_path):
    """Finding: the requests went through the client's EventLog, whose bucket (200/s) dropped them above that rate,
    the slow ones first (they end together after a stall)."""
    served = []

    async def answer(request: web.Request) -> web.Response:
        served.append(await request.read())
        return web.Response(body=b"x")

    app = web.Application()
    app.router.add_post("/", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    events = EventLog(tmp_path / "client.events.jsonl", "client", rate_per_s=1e-9, burst=2)  # 2 lines, then none
    try:
        host, port = runner.addresses[0][:2]
        with (tmp_path / "requests.jsonl").open("w", buffering=1) as requests:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(load(f"http://{host}:{port}/", 100.0, 2.0, events, requests), 0.5)
    finally:
        await runner.cleanup()
        events.close()
    records = request_records(json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines())
    assert len(served) >= 20 and len(records) >= len(served) - 3  # those under way at the end record nothing
    assert all(r.seconds is not None for r in records)


async def test_a_request_that_starts_late_counts_its_wait_from_its_scheduled_time(tmp_path):
    """Finding: a request's latency counted from when its task first ran, so a client starved of CPU hid the
    queueing (the surge and tenants benchmarks count from each request's scheduled arrival)."""

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"x")

    async def starve() -> None:
        await asyncio.sleep(0.05)
        time.sleep(0.5)  # the loop stalls: the requests due at 0.1 .. 0.5 s start at 0.55 s

    app = web.Application()
    app.router.add_post("/", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    events = EventLog(tmp_path / "client.events.jsonl", "client")
    try:
        host, port = runner.addresses[0][:2]
        with (tmp_path / "requests.jsonl").open("w", buffering=1) as requests:
            stall = asyncio.create_task(starve())
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(load(f"http://{host}:{port}/", 10.0, 5.0, events, requests), 1.0)
            await stall
    finally:
        await runner.cleanup()
        events.close()
    records = request_records(json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines())
    by_time = sorted(records, key=lambda r: r.sent)
    assert len(by_time) >= 6
    # Each is stamped with its place in the schedule, 0.1 s apart, not when it ran.
    assert [b.sent - a.sent for a, b in zip(by_time, by_time[1:])] == pytest.approx([0.1] * (len(by_time) - 1),
                                                                                     abs=1e-3)
    assert by_time[1].seconds >= 0.4  # due at 0.1 s, sent at 0.55 s

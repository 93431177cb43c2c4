"""``pipecast bench surge`` end to end, in its short form: 2 workers, a tiny served model, a few requests
replayed from a small trace, every strategy once, in an emulated cluster (netns where permitted, else
loopback).

It checks that the outputs are complete (every JSON field, one CSV row per request, the PNGs) and that
every request got an answer or a clear 429, and that nothing is left running; not how fast (speed is the
benchmark's to print, DESIGN 5). The full-size run is marked slow.
"""

import csv
import json
import os
import subprocess
import time
from pathlib import Path

import aiohttp
import psutil
import pytest
from aiohttp import web
from click.testing import CliRunner

from benchmarks.command import bench_group
from benchmarks.surge.loadgen import DriverSpec, WorkerEndpoint, send
from benchmarks.surge.report import CSV_COLUMNS, TARGET_FIRST_P99_RATIO
from benchmarks.surge.run import SurgeBenchError
from benchmarks.surge.trace import ScheduledRequest
from pipecast.router.app import QUEUE_HEADER, WORKER_HEADER
from tests.support.agent_fixtures import corrupt_copy
from tests.support.agent_processes import assert_auth_was_on
from tests.support.packages import tiny_package

STRATEGIES = ("unicast", "warm-pool:1", "pipecast-oracle", "pipecast")
FIELDS = {"first100_ttft_p50_seconds", "first100_ttft_p99_seconds", "ttft_p99_seconds", "all_ready_seconds",
          "worker_seconds", "requests", "rejected", "failed", "tokens_per_s", "cost_per_1k_output_tokens", "repeats",
          "cost_horizon_seconds", "first100_answered", "ready_ratio_to_floor_max", "ttft_percentiles_over"}
META = {"versions", "mode", "link_mbit", "store_mbit", "model_name", "package_id", "floor_seconds",
        "transfer_to_prefill_ratio", "cpu_cores", "pre_surge_seconds", "load", "headline", "cost_tail_seconds"}
# A small trace in the Azure format: 7 requests over 3 s of trace time, replayed twice as fast.
TRACE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:46.9951690,12,3
2023-11-16 18:15:47.2224670,879,55
2023-11-16 18:15:47.3910170,91,16
2023-11-16 18:15:48.0000000,30,1
2023-11-16 18:15:48.5000000,500,7
2023-11-16 18:15:49.6000000,64,9
"""
REQUESTS = 7


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    return tiny_package(tmp_path_factory.mktemp("surge") / "pkg", tokenizer=True).path


def leftovers(workdir: Path) -> list[psutil.Process]:
    """Processes still running whose command line names a file under ``workdir`` (this run's)."""
    return [p for p in psutil.process_iter(["cmdline"]) if any(str(workdir) in a for a in p.info["cmdline"] or ())]


def namespaces() -> set[str]:
    try:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    except OSError:  # no iproute2: loopback mode, nothing to leave behind
        return set()
    return {line.split()[0] for line in out.splitlines() if line.strip()}


# -- the driver's view of one request (a fake router) ---------------------------------------------------

WORKER_URL = "http://10.0.0.9:8000"
CHUNK = b'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}]}\n\n'
USAGE = b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\n'
ANSWERS = {
    "ok": (200, [CHUNK, CHUNK, USAGE, b"data: [DONE]\n\n"]),
    "busy": (429, [b'{"error": {"message": "queue full", "type": "queue_full"}}']),
    "broken": (200, [CHUNK, b'data: {"error": {"message": "worker died", "type": "worker_failed"}}\n\n']),
    "cut": (200, [CHUNK]),
    "silent": (200, []),
}


ANSWER = web.AppKey("answer", str)


async def fake_router(request: web.Request) -> web.StreamResponse:
    status, parts = ANSWERS[request.app[ANSWER]]
    body = await request.json()
    assert body["stream"] is True and len(body["prompt"]) == 3 and body["max_tokens"] == 2
    headers = {WORKER_HEADER: WORKER_URL, QUEUE_HEADER: "0.250000"}
    if status != 200:
        return web.Response(status=status, body=parts[0], headers=headers)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
    await response.prepare(request)
    for part in parts:
        await response.write(part)
    await response.write_eof()
    return response


@pytest.mark.parametrize("answer, status, error", [
    ("ok", "ok", ""), ("busy", "rejected", "queue full"), ("broken", "failed", "worker died"),
    ("cut", "failed", "the stream ended without [DONE]"), ("silent", "failed", "the stream ended before any token")])
async def test_each_request_ends_answered_rejected_or_failed_with_a_reason(answer, status, error, tmp_path):
    app = web.Application()
    app[ANSWER] = answer
    app.router.add_post("/v1/completions", fake_router)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        host, port = runner.addresses[0][:2]
        request = ScheduledRequest(0, 0.0, 3, 2, 3, 2)
        spec = DriverSpec(router_url=f"http://{host}:{port}", control_plane="", package="", store_node="",
                          store_address="", workers=(WorkerEndpoint("w1", WORKER_URL, False),), registered=(),
                          plan_strategy="", schedule=(request,), vocab_size=10, package_id="p", events="", results="",
                          request_timeout_s=5.0)
        async with aiohttp.ClientSession() as http:
            result = await send(http, spec, request, t0=time.time(), worker_names={WORKER_URL: "w1"})
    finally:
        await runner.cleanup()
    assert (result.status, result.error) == (status, error)
    assert result.worker == "w1" and result.queue_s == 0.25
    assert result.http_status == (429 if answer == "busy" else 200)
    if status == "ok":
        assert result.output_tokens == 2 and 0 < result.ttft_s <= result.latency_s


# -- the benchmark, end to end -------------------------------------------------------------------------


def test_short_surge_writes_complete_outputs_and_answers_every_request(package, tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE)
    out = tmp_path / "out"
    result = CliRunner().invoke(bench_group, [
        "surge", "--package", str(package), "--workers", "2", "--strategy", ",".join(STRATEGIES),
        "--trace", str(trace), "--window-start", "0", "--time-scale", "0.5", "--prompt-cap", "16", "--output-cap", "4",
        "--link-mbit", "100", "--repeat", "1", "--first-n", "5", "--no-calibrate",
        "--json", str(out / "surge.json"), "--csv", str(out / "requests.csv"), "--plots", str(out / "plots"),
        "--workdir", str(tmp_path / "work")])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    assert "[pipecast 1/1] done:" in result.stderr  # progress goes to stderr
    assert "verdict: first-5 p99 TTFT, unicast / pipecast = " in result.stdout

    data = json.loads((out / "surge.json").read_text())
    assert META <= data["meta"].keys()
    assert data["meta"]["transfer_to_prefill_ratio"] is None  # --no-calibrate
    # By default each cold worker's agent populated a reserve of the package's size before the surge.
    assert data["meta"]["agent_reserve_bytes"] == data["meta"]["package_bytes"]
    # ... and every process had the cluster's credentials: the router presented the serving key to the workers
    assert data["meta"]["auth"] is True and "credentials: on" in result.stdout
    assert_auth_was_on(tmp_path / "work")
    assert list(data["strategies"]) == list(STRATEGIES)
    for name, entry in data["strategies"].items():
        assert FIELDS <= entry.keys(), name
        assert entry["requests"] == REQUESTS and entry["failed"] == 0, name
        assert entry["all_ready_seconds"] is not None and entry["worker_seconds"] > 0, name
        workers = entry["repeats"][0]["workers"]
        assert [w["name"] for w in workers] == ["w1", "w2"]
        assert [w["warm"] for w in workers] == ([True, False] if name == "warm-pool:1" else [False, False])
        cold = [w for w in workers if not w["warm"] and w["provisioned_s"] is not None]
        assert cold and all(len(w["block_times"]) >= w["blocks_total"] for w in cold), name
        assert entry["oracle"] == (name in ("warm-pool:1", "pipecast-oracle")), name
        # Every strategy billed past its end alike; the oracle's scale-up listed as the daemon's are.
        assert entry["cost_horizon_seconds"] == pytest.approx(entry["duration_seconds"]
                                                              + data["meta"]["cost_tail_seconds"]), name
        if entry["oracle"]:
            assert [e["reason"].split(":")[0] for e in entry["scale_events"]] == ["oracle"], name
    assert data["strategies"]["pipecast-oracle"]["repeats"][0]["notes"]["scale_up"]["sources"] == ["store"]
    for name in ("unicast", "pipecast"):  # scaled by the daemon, from the router's signals alone
        entry = data["strategies"][name]
        assert entry["repeats"][0]["notes"]["scale_up"] is None
        ups = [e for e in entry["scale_events"] if e["action"] == "scale_up"]
        assert ups and ups[0]["t"] >= 0 and "queue" in ups[0]["reason"], entry["scale_events"]
        # The driver watched the idle pool after the last answer until the daemon released it.
        assert any(e["action"] == "release" for e in entry["scale_events"]), entry["scale_events"]
    assert set(data["ratios"]) >= {"unicast/pipecast", "warm-pool:1/pipecast"}

    with (out / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert len(rows) == REQUESTS * len(STRATEGIES)
    for row in rows:  # an answer, or a clear 429
        assert row["status"] == "ok" or (row["status"] == "rejected" and row["http_status"] == "429"
                                         and row["error"]), row
        if row["status"] == "ok":
            assert float(row["ttft_s"]) > 0 and row["worker"] in ("w1", "w2") and int(row["output_tokens"]) >= 1
    for png in ("ttft_cdf.png", "timeline.png"):
        assert (out / "plots" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert leftovers(tmp_path / "work") == []
    assert [n for n in namespaces() if n.startswith(f"pc{os.getpid()}x")] == []


def test_an_agent_reserve_that_is_no_size_is_refused_before_anything_runs(package, tmp_path):
    result = CliRunner().invoke(bench_group, ["surge", "--package", str(package), "--agent-reserve", "lots",
                                              "--workdir", str(tmp_path / "work")])
    assert result.exit_code == 2
    assert "Invalid value for '--agent-reserve'" in result.output
    assert "(a size such as 512MiB, package or 0)" in result.output
    assert not (tmp_path / "work").exists()


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_demo_model_surge_at_full_size_answers_every_request_and_judges_its_figures(tmp_path):
    """The issue's headline run at full size: the real demo model, 8 workers, 400 Mbit/s, the conversation
    trace, 3 interleaved repeats (~20 min). It asserts what holds on any machine: every request answered, every
    figure present, and the printed verdict judged from the run's own ratio. Whether the target is met is the
    benchmark's to print (README), not a test's: on a slower CPU the same code measures a lower ratio."""
    out = tmp_path / "surge.json"
    result = CliRunner().invoke(bench_group, [
        "surge", "--workers", "8", "--strategy", "unicast,pipecast", "--repeat", "3",
        "--json", str(out), "--workdir", str(tmp_path / "work")])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    data = json.loads(out.read_text())
    assert all(s["failed"] == s["rejected"] == 0 and s["requests"] > 0 and FIELDS <= set(s)
               for s in data["strategies"].values())
    ratio = data["ratios"]["unicast/pipecast"]["first100_ttft_p99_seconds"]
    met = "met" if ratio >= TARGET_FIRST_P99_RATIO else "NOT met"
    assert f"first-100 p99 TTFT, unicast / pipecast = {ratio:.1f}x (target >= {TARGET_FIRST_P99_RATIO:g}x: {met})" \
        in data["verdicts"]
    assert f"verdict: first-100 p99 TTFT, unicast / pipecast = {ratio:.1f}x" in result.output


def test_a_process_that_dies_fails_the_benchmark_with_its_log_and_leaves_nothing(package, tmp_path):
    broken = corrupt_copy(package, tmp_path / "broken")
    result = CliRunner().invoke(bench_group, [
        "surge", "--package", str(broken), "--workers", "1", "--strategy", "pipecast", "--synthetic",
        "burst:requests=1", "--repeat", "1", "--no-calibrate", "--workdir", str(tmp_path / "work")])
    assert isinstance(result.exception, SurgeBenchError), result.output
    message = str(result.exception)
    assert message.startswith("store failed during the run: exited with code 2")
    assert "last lines of" in message and "store.log" in message
    assert "[pipecast 1/1] FAILED, retrying once: store failed during the run" in result.stderr
    assert (tmp_path / "work" / "repeat1" / "pipecast-retry").is_dir()
    assert leftovers(tmp_path / "work") == []

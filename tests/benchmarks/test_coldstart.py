"""``pipecast bench coldstart``: its arithmetic, and short runs on the emulated cluster (a tiny model here,
the real demo model in the slow test)."""

import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner

import pipecast
from benchmarks.coldstart import (
    EXECUTE_WHILE_LOAD,
    LOAD_THEN_SERVE,
    ColdStartBenchError,
    ColdStartConfig,
    ColdStartReport,
    ComputeProfile,
    RunResult,
    StrategyResult,
    _wait_file,
    check_device,
    client_argv,
    format_report,
    make_prompts,
    parse_prompt_tokens,
    run,
    transfer_times,
)
from benchmarks.cpu import CpuUsage
from benchmarks.processes import Processes
from tests.support import REPO
from tests.support.agent_processes import assert_auth_was_on

RESULT_FIELDS = {"strategy", "prompt_tokens", "ttft_seconds", "floor_seconds", "transfer_seconds", "tokens",
                 "ratio_to_floor", "exposed_seconds", "compute_all_seconds", "compute_last_block_seconds",
                 "hidden_fraction", "transfer_floor_seconds", "identical_tokens_across_runs", "runs"}
CPU = CpuUsage(mean_percent=40.0, p95_percent=60.0, samples=10, cores=2)


def _run(ttft: float, transfer: float, tokens=(1, 2)) -> RunResult:
    return RunResult(ttft_seconds=ttft, transfer_seconds=transfer, first_block_seconds=0.5, tokens=tuple(tokens),
                     text="ab", serve_start_seconds=9.0, cpu=CPU)


def test_prompt_lengths_are_parsed_and_checked():
    assert parse_prompt_tokens("128,512,1024") == (128, 512, 1024)
    for bad in ("0", "8,8", "a"):
        with pytest.raises(ColdStartBenchError, match="--prompt-tokens must"):
            parse_prompt_tokens(bad)


def test_results_stand_beside_their_floors():
    compute = ComputeProfile(prompt_tokens=512, all_seconds=0.4, last_block_seconds=0.05)
    # 50 MB over 400 Mbit/s: S/B = 1 s.
    ewl = StrategyResult(EXECUTE_WHILE_LOAD, 512, 50_000_000, 400.0, compute,
                         (_run(1.10, 1.04), _run(1.12, 1.05), _run(1.30, 1.06)))
    lts = StrategyResult(LOAD_THEN_SERVE, 512, 50_000_000, 400.0, compute, (_run(1.50, 1.05),))
    assert ewl.ttft_seconds == 1.12 and ewl.transfer_seconds == 1.05
    assert ewl.floor_seconds == pytest.approx(1.05) and lts.floor_seconds == pytest.approx(1.40)
    assert ewl.exposed_seconds == pytest.approx(0.07)  # median of the runs' own waits, not of the medians
    assert ewl.hidden_fraction == pytest.approx(1 - 0.07 / 0.4)
    assert lts.hidden_fraction == 0.0
    report = ColdStartReport(meta={"model_name": "m", "package_id": "ab" * 32, "package_bytes": 50_000_000,
                                   "blocks": 8, "link_mbit": 400.0, "transfer_floor_seconds": 1.0,
                                   "cluster": "emulated cluster x", "repeat": 3, "max_tokens": 16, "threads": 1,
                                   "device": "cpu"},
                             results=(ewl, lts))
    text = format_report(report)
    assert "   512 execute-while-load    1.120    1.050    1.067       1.050    0.070" in text
    assert "greedy completion on cpu, 1 torch thread(s)" in text
    assert ("verdict 512 tokens: execute-while-load 1.12 s vs load-then-serve 1.50 s (+0.38 s saved, 1.34x); after "
            "the transfer it waited 0.070 s = 1.40x the last block's compute (target <= 1.1x: NOT met); 82% of the "
            "prefill hidden (baseline 0%); identical tokens: yes") in text
    data = report.to_json()["results"]
    assert set(data[0]) >= RESULT_FIELDS and data[0]["tokens"] == [1, 2]
    other = StrategyResult(LOAD_THEN_SERVE, 512, 50_000_000, 400.0, compute, (_run(1.5, 1.0, tokens=(1, 3)),))
    assert "identical tokens: NO" in format_report(ColdStartReport(report.meta, (ewl, other)))


def test_a_device_this_machine_lacks_is_refused_before_any_worker_starts(tiny_package, tmp_path):
    from benchmarks.command import bench_group

    pkg = tiny_package(seed=2, tokenizer=True).path
    assert check_device("cpu") == "cpu"
    with pytest.raises(ColdStartBenchError, match="--device tpu:0: not a torch device"):
        check_device("tpu:0")
    with pytest.raises(ColdStartBenchError, match="--device meta: only cpu and cuda devices are benchmarked"):
        check_device("meta")
    if not torch.cuda.is_available():
        result = CliRunner().invoke(bench_group, ["coldstart", "--package", str(pkg), "--device", "cuda",
                                                  "--workdir", str(tmp_path / "work")])
        assert result.exit_code == 2
        assert f"--device cuda: torch {torch.__version__} sees no CUDA device here" in result.output
        assert not (tmp_path / "work").exists()  # nothing started


def test_transfer_times_come_from_the_agents_events():
    events = [{"event": "listening", "t": 99.0}] + [
        {"event": "block_verified", "package": "p", "block": b, "t": 100.0 + b} for b in (1, 0, 2)]
    assert transfer_times(events, 98.5, "p", 3) == (1.5, 3.5)
    with pytest.raises(ColdStartBenchError, match=r"^the worker agent did not verify block\(s\) 3$"):
        transfer_times(events, 98.5, "p", 4)


@pytest.mark.timeout(120)
def test_a_short_run_on_a_tiny_model_writes_every_field_and_both_strategies_agree(tiny_package, tmp_path):
    pkg = tiny_package(seed=2, tokenizer=True, hidden_size=256, intermediate_size=512).path  # 7 MB
    config = ColdStartConfig(package=pkg, prompt_tokens=(24,), link_mbit=40.0, repeat=1, max_tokens=4)
    report = run(config, tmp_path / "work")
    data = json.loads(json.dumps(report.to_json()))
    meta = data["meta"]
    assert meta["benchmark"] == "coldstart" and meta["package_bytes"] > 5_000_000 and meta["link_mbit"] == 40.0
    assert meta["mode"] in ("netns", "loopback") and meta["repeat"] == 1
    results = {r["strategy"]: r for r in data["results"]}
    assert set(results) == {EXECUTE_WHILE_LOAD, LOAD_THEN_SERVE}
    prompt = make_prompts(pkg, [24])[24]
    with pipecast.load(pkg) as model:
        expected = model.generate(prompt, max_new_tokens=4, timeout=30)
    for r in results.values():
        assert set(r) >= RESULT_FIELDS and r["prompt_tokens"] == 24
        assert r["tokens"] == expected
        # the transfer cannot beat the link, nor the first token the transfer
        assert r["transfer_seconds"] >= 0.9 * meta["transfer_floor_seconds"]
        assert r["ttft_seconds"] > r["transfer_seconds"]
        assert math.isclose(r["floor_seconds"], meta["transfer_floor_seconds"] + (
            r["compute_last_block_seconds"] if r["strategy"] == EXECUTE_WHILE_LOAD else r["compute_all_seconds"]))
    assert "identical tokens: yes" in format_report(report)
    # with credentials, by default: the client presented the serving key the worker's agent gave it
    assert meta["auth"] is True and "credentials: on" in format_report(report)
    assert_auth_was_on(tmp_path / "work")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_demo_model_cold_starts_with_identical_tokens_both_ways(tmp_path):
    from benchmarks.command import bench_group
    from benchmarks.demo_model import demo_package
    from packager.errors import PackageError

    try:
        package = demo_package(REPO / ".cache" / "pipecast")
    except PackageError as exc:
        pytest.skip(f"the demo model is not available: {exc}")
    out = tmp_path / "coldstart.json"
    result = CliRunner().invoke(bench_group, ["coldstart", "--package", str(package), "--prompt-tokens", "512",
                                              "--repeat", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    results = json.loads(out.read_text())["results"]
    assert [r["strategy"] for r in results] == [EXECUTE_WHILE_LOAD, LOAD_THEN_SERVE]
    assert results[0]["tokens"] == results[1]["tokens"] and len(results[0]["tokens"]) >= 1
    assert "verdict 512 tokens" in result.output


def test_the_client_starts_from_any_folder(tmp_path):
    """Finding 1: run from another folder (`pipecast bench` adds the checkout to its own sys.path only), the
    client died of "No module named 'benchmarks'"."""
    argv = client_argv("http://127.0.0.1:1", "m", tmp_path / "ready", tmp_path / "t0", tmp_path / "prompt.json", 4,
                       10.0, tmp_path / "out.json")
    bare = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a shell outside the checkout has it
    done = subprocess.run([*argv, "--help"], cwd=tmp_path, env=bare, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m benchmarks.coldstart")


def test_a_process_that_dies_while_the_worker_starts_is_named_with_its_own_log(tmp_path):
    """Finding 1: a client that died said only "the worker did not start" with the (empty) worker's log."""
    run = Processes(tmp_path, ColdStartBenchError)
    try:
        run.launch("serve", ["sleep", "60"])
        run.launch("client", [sys.executable, "-c", "import sys; sys.exit(\"No module named 'benchmarks'\")"])
        with pytest.raises(ColdStartBenchError, match=r"(?s)^the worker did not start: client failed during the "
                                                      r"run: exited with code 1\n.*client\.log:\n.*No module named"):
            _wait_file(tmp_path / "serve.ready", run, time.monotonic() + 60, "the worker did not start", "serve")
    finally:
        run.stop()


def test_the_vllm_only_options_are_refused_with_the_pipecast_engine(tmp_path, monkeypatch):
    """Finding: `bench coldstart --workers 4` (default engine) ran one pipecast worker, --workers ignored."""
    from benchmarks.command import bench_group

    monkeypatch.setenv("PIPECAST_VLLM_VENV", str(tmp_path))  # set for every run: not the user's choice here
    result = CliRunner().invoke(bench_group, ["coldstart", "--package", str(tmp_path), "--workers", "4",
                                              "--checkpoint", str(tmp_path), "--workdir", str(tmp_path / "work")])
    assert result.exit_code == 2
    assert "--workers, --checkpoint: for --engine vllm only" in result.output
    assert not (tmp_path / "work").exists()  # nothing started

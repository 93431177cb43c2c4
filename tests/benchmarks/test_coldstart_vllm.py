"""``pipecast bench coldstart --engine vllm``: its floors, verdicts and checks (the runs themselves, real ``vllm
serve`` processes, are in tests/integration/vllm, collected by ``make test-vllm``)."""

import pytest
from click.testing import CliRunner

from benchmarks.coldstart import ColdStartBenchError
from benchmarks.coldstart_vllm import (
    LOCAL_DISK,
    PIPECAST,
    STORE_UNICAST,
    RunResult,
    StrategyResult,
    VllmColdStartConfig,
    VllmColdStartReport,
    WorkerResult,
    format_report,
    parse_workers,
    transfer_floor,
)
from benchmarks.command import bench_group
from benchmarks.cpu import CpuUsage

CPU = CpuUsage(mean_percent=80.0, p95_percent=100.0, samples=10, cores=2)
# 50 MB over 40 Mbit/s: S/B = 10 s.
META = {"model_name": "m", "package_id": "ab" * 32, "package_bytes": 50_000_000, "blocks": 8, "link_mbit": 40.0,
        "transfer_floor_seconds": 10.0, "cluster": "emulated cluster x", "repeat": 1, "prompt_tokens": 128,
        "workers": [1, 4], "cpu_cores": 2, "versions": {"vllm": "0.32.0+cpu"}}


def _run(*first_tokens: float, transfer: float | None = None, tokens=(1, 2)) -> RunResult:
    return RunResult(tuple(WorkerResult(f"w{i}", t - 0.1, t, transfer, tuple(tokens))
                           for i, t in enumerate(first_tokens, 1)), CPU)


def _report(*results: StrategyResult) -> VllmColdStartReport:
    return VllmColdStartReport(META, results)


def test_the_transfer_floor_is_s_over_b_multicast_and_n_times_that_through_the_store():
    assert transfer_floor(PIPECAST, 4, 50_000_000, 40.0) == pytest.approx(10.0)
    assert transfer_floor(STORE_UNICAST, 4, 50_000_000, 40.0) == pytest.approx(40.0)
    assert transfer_floor(LOCAL_DISK, 4, 50_000_000, 40.0) == 0.0


def test_a_strategy_is_as_fast_as_its_last_worker_and_stands_beside_its_floor():
    disk1 = StrategyResult(LOCAL_DISK, 1, (_run(6.0),))
    ours1 = StrategyResult(PIPECAST, 1, (_run(11.0, transfer=10.2),))
    store1 = StrategyResult(STORE_UNICAST, 1, (_run(11.2, transfer=10.3),))
    disk4 = StrategyResult(LOCAL_DISK, 4, (_run(12.0, 14.0, 13.0, 12.5),))
    ours4 = StrategyResult(PIPECAST, 4, (_run(15.0, 16.0, 15.5, 14.0, transfer=12.0),))
    store4 = StrategyResult(STORE_UNICAST, 4, (_run(38.0, 41.0, 39.0, 40.0, transfer=40.5),))
    report = _report(disk1, ours1, store1, disk4, ours4, store4)
    assert ours4.first_token_seconds == 16.0 and ours4.transfer_seconds == 12.0
    assert report.floor_seconds(ours1) == pytest.approx(10.0)  # S/B above vLLM's 6 s start-up
    assert report.floor_seconds(ours4) == pytest.approx(14.0)  # four vLLMs starting at once: 14 s above S/B
    assert report.floor_seconds(store4) == pytest.approx(40.0)
    text = format_report(report)
    assert "  4 pipecast              16.0     14.0     1.14     15.9        12.0   80%" in text
    assert ("verdict N = 1: pipecast 11.0 s = 1.10x max(vLLM start-up from local disk 6.0 s, S/B 10.0 s) (target "
            "<= 1.15x: met); 1.02x faster than every worker loading from the store (11.2 s); tokens identical to "
            "vLLM's default loader: yes") in text
    assert ("verdict N = 4: pipecast 16.0 s = 1.14x max(vLLM start-up from local disk 14.0 s, S/B 10.0 s); 2.56x "
            "faster than every worker loading from the store (41.0 s) (target >= 3x: NOT met); vLLM's start-up "
            "(14.0 s for 4 at once on 2 cores), not the transfer, bounds it; tokens identical to vLLM's default "
            "loader: yes") in text
    rows = {(r["strategy"], r["workers"]): r for r in report.to_json()["results"]}
    assert rows[PIPECAST, 4]["ratio_to_floor"] == pytest.approx(16.0 / 14.0)
    assert [w["first_token_seconds"] for w in rows[STORE_UNICAST, 4]["runs"][0]["workers"]] == [38.0, 41.0, 39.0, 40.0]


def test_a_worker_with_other_tokens_than_vllms_own_loader_is_reported():
    disk = StrategyResult(LOCAL_DISK, 1, (_run(6.0),))
    ours = StrategyResult(PIPECAST, 1, (_run(11.0, transfer=10.2, tokens=(1, 3)),))
    assert "tokens identical to vLLM's default loader: NO" in format_report(_report(disk, ours))


def test_misconfiguration_is_named(tmp_path):
    venv = tmp_path / "venv"
    with pytest.raises(ColdStartBenchError, match=rf"^no vLLM at {venv}/bin/vllm: build vLLM's environment with "
                                                  r"`make test-vllm`"):
        VllmColdStartConfig(package=tmp_path, checkpoint=tmp_path, vllm_venv=venv)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "vllm").write_text("")
    with pytest.raises(ColdStartBenchError, match=rf"^{tmp_path} is not a checkpoint folder \(no config.json\)$"):
        VllmColdStartConfig(package=tmp_path, checkpoint=tmp_path, vllm_venv=venv)
    with pytest.raises(ColdStartBenchError, match="--workers must"):
        parse_workers("0")


def test_the_command_takes_one_prompt_length_with_vllm(tmp_path):
    result = CliRunner().invoke(bench_group, ["coldstart", "--engine", "vllm", "--prompt-tokens", "128,512",
                                              "--package", str(tmp_path)])
    assert result.exit_code == 2 and "--engine vllm takes one prompt length" in result.output
    result = CliRunner().invoke(bench_group, ["coldstart", "--engine", "vllm", "--package", str(tmp_path),
                                              "--checkpoint", str(tmp_path), "--vllm-venv", str(tmp_path / "none")])
    assert result.exit_code == 2 and f"no vLLM at {tmp_path / 'none'}/bin/vllm" in result.output

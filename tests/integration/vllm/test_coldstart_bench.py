"""``pipecast bench coldstart --engine vllm`` end to end, short: two cold ``vllm serve`` workers of a small Llama
package per strategy (a chain through the first worker's agent, the store to each, vLLM's own loader from the
checkpoint), on the emulated cluster. Six vLLM start-ups, ~2 min on 2 cores."""

import json

import pytest

from benchmarks.coldstart_vllm import LOCAL_DISK, PIPECAST, STORE_UNICAST, VllmColdStartConfig, format_report, run
from tests.support.packages import tiny_package
from tests.support.vllm import vllm_venv

# A 17 MB package (4 layers of hidden 256, head size 64): S/B ~3.4 s, the store's link twice that for two
# workers; large enough that the shaped links' bursts (256 KiB a class) are a few percent of it.
LINK_MBIT = 40.0


@pytest.mark.timeout(900)
def test_two_cold_vllm_workers_per_strategy_give_vllms_own_tokens(tmp_path):
    package = tiny_package(tmp_path / "llama", "llama", tokenizer=True, hidden_size=256, intermediate_size=1024)
    config = VllmColdStartConfig(package=package.path, checkpoint=package.checkpoint, vllm_venv=vllm_venv(),
                                 workers=(2,), link_mbit=LINK_MBIT, prompt_tokens=24, max_tokens=4)
    report = run(config, tmp_path / "work")
    data = json.loads(json.dumps(report.to_json()))
    meta = data["meta"]
    assert meta["benchmark"] == "coldstart-vllm" and meta["workers"] == [2] and meta["versions"]["vllm"]
    results = {r["strategy"]: r for r in data["results"]}
    assert set(results) == {LOCAL_DISK, PIPECAST, STORE_UNICAST}
    tokens = {tuple(w["tokens"]) for r in results.values() for w in r["runs"][0]["workers"]}
    assert len(tokens) == 1 and len(next(iter(tokens))) == 4, tokens
    floor = meta["transfer_floor_seconds"]
    for strategy, transfer_floor in ((PIPECAST, floor), (STORE_UNICAST, 2 * floor)):
        r = results[strategy]
        assert r["transfer_seconds"] >= 0.9 * transfer_floor  # no transfer beats its link
        for w in r["runs"][0]["workers"]:
            assert w["first_token_seconds"] > max(w["ready_seconds"], w["transfer_seconds"])
    assert results[LOCAL_DISK]["transfer_seconds"] is None
    text = format_report(report)
    assert "verdict N = 2: pipecast" in text and "tokens identical to vLLM's default loader: yes" in text

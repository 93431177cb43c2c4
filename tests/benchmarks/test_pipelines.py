"""``pipecast bench pipelines``: its options, verdicts and report, and a short real run (two receivers, two
warm sources, a tiny model) in which a pipeline answers before any receiver holds the model."""

import json

import pytest
from click.testing import CliRunner

from benchmarks.command import bench_group
from benchmarks.pipelines import (
    PIPELINES,
    PIPELINES_FINISH,
    PIPELINES_MOVE,
    WHOLE,
    PipelinesBenchError,
    PipelinesReport,
    RunResult,
    format_report,
    parse_choice,
    parse_sources,
    save_plot,
    stages_of,
    verdicts,
)
from tests.support.agent_processes import assert_auth_was_on
from tests.support.packages import tiny_package


def result(k: int, strategy: str, ttft: float | None, tokens=(1, 2), stages: int = 0, after: float | None = None,
           moved: bool = False) -> RunResult:
    return RunResult(sources=k, source_kind="warm", strategy=strategy, ttft_seconds=ttft, floor_seconds=10.0,
                     ratio_to_floor=None if ttft is None else ttft / 10.0, pipeline_stages=stages,
                     served_by="pipeline:a+b" if stages else "http://w1:8000", tokens=list(tokens),
                     inter_token_seconds=0.05, last_token_seconds=None if ttft is None else ttft + 0.35,
                     after_dissolution_seconds=after, moved=moved,
                     plan_strategy="rotated", first_complete_seconds=10.5, all_complete_seconds=11.0,
                     cpu_mean_percent=40.0, cpu_saturated=False)


def test_options_are_checked_naming_the_option():
    assert parse_sources("1,2,4,8") == (1, 2, 4, 8)
    for bad in ("", "0", "2,2", "two"):
        with pytest.raises(PipelinesBenchError, match="--sources: expected distinct positive counts"):
            parse_sources(bad)
    assert parse_choice("warm, store", ("warm", "store"), "--source-kind") == ("warm", "store")
    with pytest.raises(PipelinesBenchError, match="--strategy: expected some of pipelines, whole-model, got 'x'"):
        parse_choice("x", (PIPELINES, WHOLE), "--strategy")
    assert stages_of("pipeline:w1+w5+w3") == 3 and stages_of("http://10.0.0.2:8000") == 0


def test_verdicts_compare_each_source_count_with_its_target_and_the_tokens_with_whole_model_ones(tmp_path):
    results = [result(2, PIPELINES, 5.5, stages=2, after=1.25, moved=True), result(2, WHOLE, 10.7),
               result(2, PIPELINES_FINISH, 5.6, stages=2, after=3.5), result(4, PIPELINES, 3.4, stages=4),
               result(2, PIPELINES_MOVE, 5.4, stages=2, after=1.3, moved=True),
               result(4, WHOLE, 10.6, tokens=(1, 3)), result(8, PIPELINES, None)]
    assert verdicts(results) == [
        "K=2 warm: first token 0.55 x S/B (target <= 0.6 x S/B: met)",
        "K=4 warm: first token 0.34 x S/B (target <= 0.35 x S/B: met)",
        "K=8 warm: first token no first token (target <= 0.3 x S/B: NOT met)",
        "tokens identical to whole-model generation: 3 of 4 runs",
        "K=2 warm: after its head held the whole model the request ran on 1.30 s when moved to the head (moved), "
        "3.50 s through the pipeline: moving is better; the head's own choice (auto): moving, 1.25 s (the better)"]
    meta = {"model_name": "m", "package_bytes": 1 << 20, "blocks": 4, "receivers": 8, "link_mbit": 100.0,
            "mode": "netns", "floor_seconds": 10.0, "prompt_tokens": 16, "worker_cpus": "no CPU quota"}
    text = format_report(PipelinesReport(meta, results))
    assert ("      2 warm  pipelines        rotated     5.50   0.55      2       50"
            "       10.50       11.00   5.85   1.25m" in text)
    assert "verdict: tokens identical to whole-model generation: 3 of 4 runs" in text

    again = PipelinesReport.from_json(json.loads(json.dumps(PipelinesReport(meta, results).to_json())))
    assert again.results == results and format_report(again) == text  # a run's JSON can be reported and drawn
    assert save_plot(again, tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(600)
def test_a_pipeline_of_two_receivers_answers_first_with_the_whole_models_tokens(tmp_path):
    package = tiny_package(tmp_path / "pkg", seed=9, layers=4, tokenizer=True, hidden_size=256,
                           intermediate_size=1024).path
    out = tmp_path / "pipelines.json"
    run = CliRunner().invoke(bench_group, [
        "pipelines", "--package", str(package), "--sources", "2", "--source-kind", "warm", "--receivers", "2",
        "--link-mbit", "16", "--worker-cpus", "0", "--json", str(out), "--workdir", str(tmp_path / "work")])
    assert run.exit_code == 0, f"{run.output}\n{run.exception!r}"
    data = json.loads(out.read_text())
    by = {r["strategy"]: r for r in data["results"]}
    piped, whole = by[PIPELINES], by[WHOLE]
    assert piped["pipeline_stages"] == 2 and whole["pipeline_stages"] == 0
    assert piped["tokens"] == whole["tokens"] and len(piped["tokens"]) == 8
    assert piped["last_token_seconds"] >= piped["ttft_seconds"] and whole["after_dissolution_seconds"] is None
    # the pipeline answers before any receiver holds the model; the whole model cannot beat its transfer
    assert piped["ttft_seconds"] < piped["first_complete_seconds"]
    assert whole["ttft_seconds"] >= 0.9 * whole["first_complete_seconds"]
    assert "verdict: tokens identical to whole-model generation: 1 of 1 runs" in run.output
    # ... with credentials, by default: stage calls carried the serving key (a worker refuses them without)
    assert data["meta"]["auth"] is True and "credentials: on" in run.output
    assert_auth_was_on(tmp_path / "work")


def test_a_run_retried_after_a_failure_is_recorded_in_the_report_and_printed(monkeypatch, tmp_path):
    # The run itself is faked: what matters is that the failure reaches the report, not only stderr.
    import contextlib
    from types import SimpleNamespace

    import benchmarks.pipelines as bench

    block = SimpleNamespace(bytes=1 << 20)
    monkeypatch.setattr(bench, "read_manifest", lambda _: SimpleNamespace(blocks=[block], model_name="m",
                                                                          package_id="p"))
    cluster = SimpleNamespace(mode="loopback")
    monkeypatch.setattr(bench, "EmulatedCluster", lambda *a, **k: contextlib.nullcontext(cluster))
    monkeypatch.setattr(bench, "open_quotas", lambda _: SimpleNamespace(description="no CPU quota", close=lambda: None))
    calls = []

    def run_once(cluster, folder, config, manifest, k, kind, strategy, sockets, quotas):
        calls.append(folder.name)
        if len(calls) == 1:
            raise PipelinesBenchError("store failed during the run: exited with code 2\nlast lines ...")
        return result(k, strategy, 5.0, stages=2)

    monkeypatch.setattr(bench, "run_once", run_once)
    config = bench.PipelinesConfig(package=tmp_path, sources=(2,), source_kinds=("warm",), strategies=(PIPELINES,),
                                   receivers=2)
    report = bench.run(config, tmp_path / "work")
    assert calls == [PIPELINES, f"{PIPELINES}-retry"]
    assert report.meta["retried_runs"] == [{"sources": 2, "source_kind": "warm", "strategy": PIPELINES,
                                            "error": "store failed during the run: exited with code 2\nlast lines ..."}]
    report.meta.update(link_mbit=400.0, floor_seconds=10.0, prompt_tokens=16)
    assert "RETRIED: K=2 warm pipelines failed once: store failed during the run: exited with code 2" in \
        format_report(report).splitlines()

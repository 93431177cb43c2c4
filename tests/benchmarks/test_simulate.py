"""`pipecast bench simulate`: the JSON contract, and no figure below the lower bound."""

import json

from click.testing import CliRunner

from benchmarks.command import bench_group


def test_simulated_figures_follow_the_contract_and_never_beat_the_lower_bound(tmp_path):
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(bench_group, ["simulate", "--nodes", "4,12", "--strategy", "chain,binomial,unicast",
                                       "--model-bytes", "8MiB", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [(r["nodes"], r["strategy"]) for r in data["results"]] == [
        (n, s) for n in (4, 12) for s in ("chain", "binomial", "unicast")]
    for r in data["results"]:
        assert set(r) == {"nodes", "strategy", "default", "seconds", "floor_seconds", "ratio_to_floor",
                          "lower_bound_seconds"}
        assert r["floor_seconds"] < r["lower_bound_seconds"] <= r["seconds"]
        assert r["default"] == ((r["strategy"] == "chain") if r["nodes"] <= 8 else (r["strategy"] == "binomial"))
    unicast = {r["nodes"]: r["ratio_to_floor"] for r in data["results"] if r["strategy"] == "unicast"}
    assert unicast[12] > 11  # every copy over the store's one link
    assert "x S/B" in result.output

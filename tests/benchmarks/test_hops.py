"""``pipecast bench hops``: the layer split, and a short real run of two workers in which a two-stage
pipeline answers the same tokens as one worker."""

import json

import pytest
from click.testing import CliRunner

from benchmarks.command import bench_group
from benchmarks.hops import HopsBenchError, split_layers
from tests.support.packages import tiny_package


def test_layers_split_into_near_equal_consecutive_ranges():
    assert split_layers(30, 4) == [range(0, 8), range(8, 15), range(15, 22), range(22, 30)]
    assert split_layers(4, 1) == [range(0, 4)]
    with pytest.raises(HopsBenchError, match="--stages: 5 stages for a model of 4 layers"):
        split_layers(4, 5)


def test_stage_counts_must_start_with_the_single_worker_baseline(tmp_path):
    result = CliRunner().invoke(bench_group, ["hops", "--stages", "2,4", "--package", str(tmp_path)])
    assert result.exit_code == 2 and "distinct counts starting with 1 (the baseline), got '2,4'" in result.output


@pytest.mark.timeout(300)
def test_two_stages_answer_one_workers_tokens_and_the_hop_is_measured(tmp_path):
    package = tiny_package(tmp_path / "pkg", seed=4, layers=4, tokenizer=True).path
    out = tmp_path / "hops.json"
    run = CliRunner().invoke(bench_group, ["hops", "--package", str(package), "--stages", "1,2", "--max-tokens", "8",
                                           "--repeat", "2", "--json", str(out), "--workdir", str(tmp_path / "w")])
    assert run.exit_code == 0, f"{run.output}\n{run.exception!r}"
    one, two = json.loads(out.read_text())["results"]
    assert (one["stages"], one["hop_seconds"], two["stages"]) == (1, None, 2)
    assert two["tokens_identical"] and one["tokens_identical"]
    assert two["per_token_seconds"] > 0 and two["hop_seconds"] is not None

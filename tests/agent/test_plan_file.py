"""Static plan files: a bad one is a PlanFileError naming the file and what is wrong."""

import json

import pytest

from control_plane.planner.schedules import make_plan
from pipecast.agent.errors import PlanFileError
from pipecast.agent.plan_file import plan_file_data, read_plan_file

PACKAGE = "ab" * 32
NODES = {"seed": "127.0.0.1:7070", "r1": "127.0.0.1:7071"}


def test_a_plan_file_round_trips(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_file_data(make_plan("chain", ["seed"], ["r1"], 2), PACKAGE, NODES)))
    plan = read_plan_file(path)
    assert plan.package_id == PACKAGE and plan.children_of("seed") == {"r1"}
    assert plan.relay_bytes == 0 and "relay_bytes" not in json.loads(path.read_text())  # each node's own pieces
    path.write_text(json.dumps(plan_file_data(make_plan("chain", ["seed"], ["r1"], 2), PACKAGE, NODES, 65536)))
    assert read_plan_file(path).relay_bytes == 65536  # a long chain's, as a control plane asks


@pytest.mark.parametrize("text, message", [
    ('{"package_id": "x", "package_id": "y"}', "not a JSON object \\(duplicate key 'package_id'\\)"),
    ("[" * 2000, "not a JSON object \\(nested too deeply\\)"),
    ("[1]", "not a JSON object \\(expected a JSON object, got"),
    ('{"package_id": "x", "nodes": {}}', "'package_id' must be the package's id \\(64 hex digits\\)"),
    (json.dumps({"package_id": PACKAGE, "nodes": {"seed": 7}}), "'nodes' must map node ids to host:port"),
    (json.dumps({"package_id": PACKAGE, "nodes": {"seed": "nowhere"}}), "node 'seed': "),
    (json.dumps({"package_id": PACKAGE, "nodes": {}, "relay_bytes": -1}),
     "'relay_bytes' must be an integer >= 0 \\(bytes; 0: each node's own\\), got -1$"),
    (json.dumps({"package_id": PACKAGE, "nodes": {}, "relay_bytes": "64k"}), "'relay_bytes' must be an integer"),
])
def test_a_bad_plan_file_is_refused_naming_the_file_and_the_problem(tmp_path, text, message):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(PlanFileError, match=f"^{path}: {message}"):
        read_plan_file(path)

"""``pipecast bench chaos`` (benchmarks/chaos.py): the short form of the whole reliability suite runs here
(so in CI): every scenario must pass (survived, 0 corrupt blocks served, 0 hangs, within its bounds),
what it writes must have the documented shape, and nothing may be left behind.
"""

import json
import os
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from benchmarks import chaos
from benchmarks.chaos import SCENARIOS, ChaosReport, format_report, parse_only
from benchmarks.chaos_harness import Bounds, ChaosError, ScenarioResult
from benchmarks.chaos_scenarios import last_line
from benchmarks.command import bench_group

SCENARIO_FIELDS = {"name", "faults", "survived", "corrupt_served", "blocks_rehashed", "hangs", "passed",
                   "peak_rss_bytes", "peak_fds", "peak_threads", "bounds", "seconds", "detail"}


def test_only_picks_known_scenarios_in_the_suites_order():
    assert parse_only(None) == tuple(SCENARIOS)
    assert parse_only("unauth-manifest, relay-killed") == ("relay-killed", "unauth-manifest")
    with pytest.raises(ChaosError, match="no-such"):
        parse_only("relay-killed,no-such")


def test_a_scenario_passes_only_if_it_survived_clean_and_within_bounds():
    good = ScenarioResult("a", faults=["x"], survived=True, peak_rss_bytes=1, peak_fds=1, peak_threads=1)
    assert good.passed
    assert not ScenarioResult("b", survived=True, hangs=1).passed
    assert not ScenarioResult("c", survived=True, corrupt_served=1).passed
    assert not ScenarioResult("d", survived=True, peak_fds=Bounds().fds + 1).passed
    assert not ScenarioResult("e", survived=False).passed
    report = ChaosReport([good, ScenarioResult("b", survived=True, hangs=1, detail=["hang: x"])], short=True,
                         started_at="2026-01-01T00:00:00Z")
    text = format_report(report)
    assert "PASS" in text and "FAIL" in text and "FAILED: b" in text
    data = report.to_json()
    assert not data["passed"] and {s["name"] for s in data["scenarios"]} == {"a", "b"}
    assert set(data["scenarios"][0]) == SCENARIO_FIELDS


NO_AGENTS = {"symlinked-checkpoint"}  # runs the packager only: no agent to sample or re-hash


def _ours(workdir: Path) -> list[str]:
    return [" ".join(p.info["cmdline"]) for p in psutil.process_iter(["cmdline"])
            if any(str(workdir) in arg for arg in p.info["cmdline"] or ())]


def test_the_short_suite_passes_every_scenario_and_leaves_nothing_behind(tmp_path):
    out, workdir = tmp_path / "chaos.json", tmp_path / "work"
    result = CliRunner().invoke(bench_group, ["chaos", "--short", "--json", str(out), "--workdir", str(workdir)])
    assert "scenario" in result.output and "passed" in result.output
    data = json.loads(out.read_text())
    assert [s["name"] for s in data["scenarios"]] == list(SCENARIOS)
    assert all(s["corrupt_served"] == 0 and s["hangs"] == 0 for s in data["scenarios"]), result.output
    assert result.exit_code == 0 and data["passed"], result.output
    for scenario in data["scenarios"]:
        assert set(scenario) == SCENARIO_FIELDS
        assert set(scenario["bounds"]) == {"rss_bytes", "fds", "threads"}
        if scenario["name"] not in NO_AGENTS:
            assert scenario["peak_rss_bytes"] > 0, scenario  # its agents were sampled
            assert scenario["blocks_rehashed"] > 0, scenario  # the store's blocks at least: the check is not empty
        assert scenario["passed"] == (scenario["survived"] and not scenario["corrupt_served"]
                                      and not scenario["hangs"]
                                      and scenario["peak_rss_bytes"] <= scenario["bounds"]["rss_bytes"]
                                      and scenario["peak_fds"] <= scenario["bounds"]["fds"]
                                      and scenario["peak_threads"] <= scenario["bounds"]["threads"])
    assert (result.exit_code == 0) == data["passed"]
    assert data["leftovers"] == {"processes": [], "mounts": [], "shm": []}
    assert not _ours(workdir)
    assert str(workdir) not in Path("/proc/mounts").read_text()
    assert {"pipecast", "python", "blake3"} <= set(data["versions"])


@pytest.mark.slow
def test_the_full_suite_runs_every_scenario(tmp_path):
    out, workdir = tmp_path / "chaos.json", tmp_path / "work"
    result = CliRunner().invoke(bench_group, ["chaos", "--json", str(out), "--workdir", str(workdir)])
    data = json.loads(out.read_text())
    failed = [s["name"] for s in data["scenarios"] if not s["passed"]]
    assert result.exit_code == 0 and data["passed"] and not failed, (failed, result.output)
    assert [s["name"] for s in data["scenarios"]] == list(SCENARIOS)
    assert data["leftovers"] == {"processes": [], "mounts": [], "shm": []}
    assert not _ours(workdir)


def test_a_process_error_is_noted_by_its_last_line_from_its_start():
    """Finding: the note kept the last 160 characters of stderr, which began mid-word ("exit 2: efused: ...")."""
    error = "error: refused: " + "x" * 150
    assert last_line(f"WARNING a warning first\n{error}\n") == f"{error[:160]}..."
    assert last_line("warning\nerror: refused: tokenizer.json\n") == "error: refused: tokenizer.json"
    assert last_line("") == ""


def test_shared_memory_left_behind_is_the_suites_not_a_postgresql_servers_beside_it(tmp_path):
    """A PostgreSQL server running beside the suite (the test suite's own, another run's) made segments meanwhile,
    which were reported as the suite's leftovers."""
    before = chaos._shm_names()
    made = [Path("/dev/shm") / f"{prefix}{os.getpid()}-chaos-test" for prefix in ("PostgreSQL.", "ucx_")]
    try:
        for path in made:
            path.write_bytes(b"x")
        assert chaos._leftovers(tmp_path, before)["shm"] == [made[1].name]
    finally:
        for path in made:
            path.unlink(missing_ok=True)

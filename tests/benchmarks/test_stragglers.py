"""``pipecast bench stragglers`` (benchmarks/stragglers.py), its pure parts: options, the results the driver's
observations make, the driver's watch of a transfer (against a fake control plane), verdicts and report. The
real run, in network namespaces, is tests/integration/test_stragglers.py."""

import dataclasses
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from benchmarks import stragglers
from benchmarks.command import bench_group
from benchmarks.cpu import CpuUsage
from benchmarks.stragglers import (
    HANDLED,
    NONE,
    UNHANDLED,
    DriverSpec,
    Observed,
    RunResult,
    StragglersBenchError,
    StragglersConfig,
    StragglersReport,
    StragglersTimeout,
    _watch,
    format_report,
    parse_modes,
    summarize,
    verdicts,
)

MB = 1_000_000
CPU = CpuUsage(mean_percent=40.0, p95_percent=60.0, samples=10, cores=2)


def config(**options) -> StragglersConfig:
    return StragglersConfig(package=Path("pkg"), **{"workers": 4, "link_mbit": 80.0, **options})


def result(mode: str, others: float | None, slow: float | None = 41.0, demoted=("w2", "w3"), repeat: int = 1,
           error: str = "") -> RunResult:
    return RunResult(mode=mode, repeat=repeat, workers=4, link_mbit=80.0, slow_position=3,
                     slow_factor=1.0 if mode == NONE else 0.25, kill_position=0, floor_seconds=10.0,
                     slow_floor_seconds=10.0 if mode == NONE else 40.0, others_max_seconds=others,
                     others_ratio_to_floor=None if others is None else others / 10.0, slow_seconds=slow,
                     complete={"w1": 10.5, **({"w3": slow} if slow else {})}, demoted=list(demoted),
                     plan_strategy="chain", cpu_mean_percent=40.0, cpu_saturated=mode == UNHANDLED, error=error)


# -- options -------------------------------------------------------------------------------------------


def test_modes_are_parsed_naming_the_option():
    assert parse_modes("handled, none") == (HANDLED, NONE)
    for bad in ("", "handled,", "fast", "handled,handled"):
        with pytest.raises(StragglersBenchError, match=r"^--modes: expected distinct modes among handled, "
                                                       r"unhandled, none, got "):
            parse_modes(bad)


@pytest.mark.parametrize(("options", "message"), [
    ({"workers": 1}, "--workers: 1 leaves no receiver besides the slow one"),
    ({"workers": 2, "slow_position": 1, "kill_position": 2},
     "--workers: 2 leaves no receiver besides the slow and the killed one"),
    ({"slow_position": 5}, "--slow-position must be within 1..4, got 5"),
    ({"slow_factor": 1.0}, r"--slow-factor must be within \(0, 1\), got 1.0"),
    ({"slow_direction": "down"}, "--slow-direction must be one of both, up, got 'down'"),
    ({"kill_position": 9}, "--kill-position must be within 0..4, got 9"),
    ({"kill_position": 3}, "--kill-position 3 is the slow receiver's position: kill another one"),
    ({"kill_after_s": -1.0}, "--kill-after must be >= 0 s, got -1.0"),
    ({"link_mbit": 0.0}, "--link-mbit must be > 0, got 0.0"),
    ({"modes": ()}, r"modes must be distinct, among handled, unhandled, none, got \(\)"),
    ({"repeat": 0}, "--repeat must be >= 1, got 0"),
])
def test_a_bad_configuration_is_refused_naming_the_option(options: dict, message: str):
    with pytest.raises(StragglersBenchError, match=f"^{message}$"):
        config(**options)


def test_the_slow_and_killed_receivers_are_named_by_their_position_in_the_scale_up():
    c = config(workers=8, slow_position=2, kill_position=8)
    assert (c.slow_node, c.killed_node) == ("w2", "w8")
    assert config().killed_node is None
    # 20 MB at a quarter of 80 Mbit/s is 8 s: four times that, plus the slack
    assert config(link_mbit=80.0).deadline_s(20 * MB) == pytest.approx(4 * 8.0 + 60.0)


def test_the_command_refuses_bad_options_before_running(tmp_path):
    for args, message in ((["--modes", "fast"], "--modes: expected distinct modes"),
                          (["--kill-position", "3"], "--kill-position 3 is the slow receiver's position"),
                          (["--workers", "4", "--slow-position", "6"], "--slow-position must be within 1..4")):
        run = CliRunner().invoke(bench_group, ["stragglers", "--package", str(tmp_path), *args,
                                               "--workdir", str(tmp_path / "work")])
        assert run.exit_code == 2 and message in run.output, run.output
        assert not (tmp_path / "work").exists()


# -- results -------------------------------------------------------------------------------------------


def test_a_result_leaves_the_slow_and_the_killed_receivers_out_of_the_others():
    c = config(kill_position=4)  # w1..w4 at 80 Mbit/s = 10 MB/s; w3 slow, w4 killed
    seen = {"complete": {"w1": 2.0, "w2": 2.4, "w3": 8.5}, "demoted": ["w3"], "plan_strategy": "chain"}
    r = summarize(c, HANDLED, 1, 20 * MB, seen, CPU)
    assert (r.floor_seconds, r.slow_floor_seconds) == (pytest.approx(2.0), pytest.approx(8.0))
    assert (r.others_max_seconds, r.others_ratio_to_floor, r.slow_seconds) == (2.4, pytest.approx(1.2), 8.5)
    assert (r.demoted, r.plan_strategy, r.kill_position, r.error) == (["w3"], "chain", 4, "")
    assert (r.cpu_mean_percent, r.cpu_saturated) == (40.0, False)

    partial = summarize(c, UNHANDLED, 2, 20 * MB, {**seen, "complete": {"w1": 2.0}, "error": "late"}, CPU)
    assert (partial.others_max_seconds, partial.others_ratio_to_floor, partial.slow_seconds) == (None, None, None)
    assert (partial.repeat, partial.error) == (2, "late")

    reference = summarize(c, NONE, 1, 20 * MB, seen, CPU)  # nobody is slowed in mode none
    assert (reference.slow_factor, reference.slow_floor_seconds) == (1.0, pytest.approx(2.0))
    # Slowed out only, the slow receiver receives at the link rate: its floor is everyone's.
    uplink = summarize(config(kill_position=4, slow_direction="up"), HANDLED, 1, 20 * MB, seen, CPU)
    assert (uplink.slow_factor, uplink.slow_floor_seconds) == (0.25, pytest.approx(2.0))


class FakeControlPlane:
    """Answers the driver's polls from a script: the blocks each worker holds, and the plans' demoted lists,
    per poll."""

    def __init__(self, held: list[dict[str, int]], demoted: list[list[str]]) -> None:
        self.held, self.demoted, self.polls = held, demoted, 0

    async def availability(self, package_id: str):
        view = self.held[min(self.polls, len(self.held) - 1)]
        self.polls += 1
        return SimpleNamespace(by_worker={node: frozenset(range(n)) for node, n in view.items()})

    async def list_plans(self, package_id: str):
        names = self.demoted[min(self.polls - 1, len(self.demoted) - 1)]
        return [SimpleNamespace(demoted=names)] if names else []  # gone: every receiver holds the package


def spec(killed: str | None = None, deadline_s: float = 30.0) -> DriverSpec:
    return DriverSpec("cp:7000", "pkg", "store:7070", ["w1", "w2", "w3"], killed, deadline_s, "e", "r")


async def test_the_driver_records_completions_and_demotions_until_every_live_receiver_holds_the_package(
        monkeypatch):
    monkeypatch.setattr(stragglers, "PLAN_POLL_EVERY", 1)  # the plans at every poll, as the script has them
    cp = FakeControlPlane([{"w1": 1}, {"w1": 2, "w2": 1}, {"w1": 2, "w2": 2}, {"w1": 2, "w2": 2, "w3": 2}],
                          [[], ["w2"], ["w2"], []])
    seen = Observed()
    await _watch(cp, "p", 2, spec(), time.monotonic(), seen)
    assert list(seen.complete) == ["w1", "w2", "w3"] and seen.demoted == {"w2"}
    assert seen.complete["w1"] <= seen.complete["w2"] <= seen.complete["w3"]

    seen = Observed()  # the killed receiver is not waited for
    cp = FakeControlPlane([{"w1": 2, "w2": 2}], [[]])
    await _watch(cp, "p", 2, spec(killed="w3"), time.monotonic(), seen)
    assert set(seen.complete) == {"w1", "w2"}


async def test_the_driver_gives_up_at_its_deadline_naming_who_is_missing_and_keeps_what_it_saw():
    seen, cp = Observed(), FakeControlPlane([{"w1": 2, "w2": 1}], [["w3"]])
    with pytest.raises(StragglersTimeout, match=r"^w2, w3 did not hold the package within 0 s$"):
        await _watch(cp, "p", 2, spec(deadline_s=0.0), time.monotonic() - 1.0, seen)  # 1 s after the scale-up
    assert set(seen.complete) == {"w1"}
    assert json.loads(json.dumps(seen.to_json()))["demoted"] == ["w3"]


# -- verdicts and report -------------------------------------------------------------------------------


def test_verdicts_judge_the_target_and_what_each_mode_demoted():
    assert verdicts([result(HANDLED, 11.5), result(UNHANDLED, 40.5, demoted=()), result(NONE, 10.2, demoted=())]) \
        == ["handled: every other receiver within 1.15x S/B (target <= 1.25x: met); unhandled: 4.05x; "
            "none (no slow receiver): 1.02x",
            "handled: demoted w2, w3 (as expected)", "unhandled: demoted nothing (as expected)",
            "none: demoted nothing (as expected)"]
    assert verdicts([result(HANDLED, 13.0, demoted=()), result(UNHANDLED, None, demoted=("w3",))]) == [
        "handled: every other receiver within 1.30x S/B (target <= 1.25x: NOT met); unhandled: not every other "
        "receiver completed",
        "handled: demoted nothing (expected w2, w3)", "unhandled: demoted w3 (expected nothing)"]
    # repeats: the median of the runs; each run's demotions apart
    assert verdicts([result(HANDLED, 11.0), result(HANDLED, 14.0, demoted=("w3", "w4"), repeat=2),
                     result(HANDLED, 12.0, repeat=3)]) == [
        "handled: every other receiver within 1.20x S/B (target <= 1.25x: met)",
        "handled (run 1): demoted w2, w3 (as expected)", "handled (run 2): demoted w3, w4 (expected w2, w3)",
        "handled (run 3): demoted w2, w3 (as expected)"]
    # a slow uplink only: its children are demoted before it, as nothing tells them apart in a chain
    assert verdicts([result(HANDLED, 7.5, demoted=("w3", "w4", "w5")), result(HANDLED, 20.0, demoted=("w4",),
                     repeat=2)], uplink=True)[1:] == [
        "handled (run 1): demoted w3, w4, w5 (the slow relay among them)",
        "handled (run 2): demoted w4 (expected w3 among them)"]
    assert verdicts([result(HANDLED, None, error="late")])[0] == \
        "handled: not every other receiver completed, 1 of 1 run(s) failed (target <= 1.25x: NOT met)"
    assert verdicts([]) == []


def test_a_mode_with_a_failed_run_is_not_met_and_says_how_many_failed():
    """Finding: a run whose driver gave up (the slow receiver late) still fed the median, and "met" was said of it."""
    late = "StragglersTimeout: w3 did not hold the package within 103 s"
    assert verdicts([result(HANDLED, 11.0, slow=None, error=late), result(HANDLED, 11.0, repeat=2),
                     result(UNHANDLED, 40.5, slow=None, demoted=(), error=late)])[0] == (
        "handled: every other receiver within 1.10x S/B, 1 of 2 run(s) failed (target <= 1.25x: NOT met); unhandled: "
        "4.05x, 1 of 1 run(s) failed")


def test_the_report_has_a_line_per_run_and_reads_back_from_its_json():
    meta = {"model_name": "m", "package_bytes": 20 * MB, "blocks": 8, "workers": 4, "link_mbit": 80.0,
            "mode": "netns", "floor_seconds": 10.0, "slow_node": "w3", "slow_position": 3, "slow_factor": 0.25,
            "slow_floor_seconds": 40.0, "killed_node": "w4", "kill_after_s": 1.5}
    report = StragglersReport(meta, [result(HANDLED, 11.5), result(UNHANDLED, None, slow=None, demoted=(),
                                                                   error="StragglersTimeout: w2 late")])
    text = format_report(report)
    assert text.splitlines()[0] == ("stragglers: m (19.1 MiB, 8 blocks), 4 receivers at 80 Mbit/s (netns), floor "
                                    "S/B 10.00 s; w3 (position 3) at 0.25 x the link, its floor 40.00 s; w4 killed "
                                    "1.5 s after the scale-up")
    assert "handled     1 chain        11.50   1.15   41.00   1.02 w2,w3          40%" in text
    assert "unhandled   1 chain            -      -       -      - -             40%!  error: StragglersTimeout: " \
           "w2 late" in text
    assert "verdict: handled: every other receiver within 1.15x S/B (target <= 1.25x: met)" in text
    again = StragglersReport.from_json(json.loads(json.dumps(report.to_json())))
    assert again.results == report.results and format_report(again) == text
    assert report.to_json()["verdicts"] == verdicts(report.results)


def test_the_printed_verdicts_of_a_slow_uplink_are_the_json_ones():
    """Finding: the printed report judged a slow uplink's demotions as one slow receiver's ("expected w3 alone")."""
    meta = {"model_name": "m", "package_bytes": 20 * MB, "blocks": 8, "workers": 8, "link_mbit": 80.0,
            "mode": "netns", "floor_seconds": 10.0, "slow_node": "w3", "slow_position": 3, "slow_factor": 0.25,
            "slow_direction": "up", "slow_floor_seconds": 10.0, "killed_node": None, "kill_after_s": 1.5}
    report = StragglersReport(meta, [result(HANDLED, 13.0, demoted=("w3", "w4", "w5"))])
    assert "verdict: handled: demoted w3, w4, w5 (the slow relay among them)" in format_report(report)


def test_handling_is_expected_to_demote_the_chain_relay_feeding_the_slow_receiver_too():
    assert result(HANDLED, 11.0).expected_demoted == ["w2", "w3"]
    head = dataclasses.replace(result(HANDLED, 11.0), slow_position=1)  # fed by the store: alone
    assert head.expected_demoted == ["w1"]
    tree = dataclasses.replace(result(HANDLED, 11.0), plan_strategy="binomial")  # siblings tell them apart
    assert tree.expected_demoted == ["w3"]

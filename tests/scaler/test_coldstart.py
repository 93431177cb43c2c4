"""The daemon's measure of a deployment's cold starts: pure, times given."""

from pipecast.scaler.coldstart import KEPT, ColdStarts
from pipecast.scaler.policy import Replica


def loading(*nodes: str) -> list[Replica]:
    return [Replica(node, loading=True) for node in nodes]


def loaded(*nodes: str) -> list[Replica]:
    return [Replica(node, loading=False) for node in nodes]


def test_a_replica_is_timed_from_the_scale_up_that_added_it_to_the_tick_that_sees_it_whole():
    starts = ColdStarts()
    starts.observe([], now=100.0, last_scale_up=None)
    assert starts.seconds is None
    starts.observe(loading("w1", "w2"), now=101.0, last_scale_up=100.0)  # the scale-up of the tick before
    starts.observe(loaded("w1") + loading("w2"), now=106.0, last_scale_up=100.0)
    assert starts.seconds == 6.0
    starts.observe(loaded("w1", "w2"), now=108.0, last_scale_up=100.0)
    assert starts.seconds == 7.0  # the median of 6 and 8
    starts.observe(loaded("w1", "w2"), now=109.0, last_scale_up=100.0)  # whole replicas are timed once
    assert starts.seconds == 7.0


def test_a_replica_not_added_by_a_scale_up_since_the_last_tick_is_timed_from_when_it_was_seen():
    starts = ColdStarts()
    starts.observe([], now=100.0, last_scale_up=50.0)
    starts.observe(loading("w1"), now=101.0, last_scale_up=50.0)  # placed by hand (or a restarted daemon)
    starts.observe(loaded("w1"), now=104.0, last_scale_up=50.0)
    assert starts.seconds == 3.0
    fresh = ColdStarts()  # its first tick: no earlier tick to tell a scale-up of its own by
    fresh.observe(loading("w1"), now=101.0, last_scale_up=100.5)
    fresh.observe(loaded("w1"), now=103.0, last_scale_up=100.5)
    assert fresh.seconds == 2.0


def test_a_replica_gone_while_loading_gives_no_time_and_only_the_last_few_count():
    starts = ColdStarts()
    starts.observe([], now=0.0, last_scale_up=None)
    starts.observe(loading("w1"), now=1.0, last_scale_up=0.0)
    starts.observe([], now=2.0, last_scale_up=0.0)  # released (or dead) before it held the package
    starts.observe(loaded("w1"), now=3.0, last_scale_up=0.0)  # back, whole: never seen loading since
    assert starts.seconds is None
    for i, seconds in enumerate([30.0] * 3 + [5.0] * KEPT):  # a slow fabric once, a fast one since
        at = 100.0 * (i + 1)
        starts.observe([], now=at, last_scale_up=None)
        starts.observe(loading(f"n{i}"), now=at + 1, last_scale_up=at)
        starts.observe(loaded(f"n{i}"), now=at + seconds, last_scale_up=at)
    assert starts.seconds == 5.0


def test_a_replica_whole_by_the_tick_after_its_scale_up_is_timed_too():
    """Found in review: one no tick saw loading (a local load within a tick) gave no time, so the measure was of
    the slow starts only, and scale-ups were sized for them."""
    starts = ColdStarts()
    starts.observe([], now=10.0, last_scale_up=None)
    starts.started(["w1"], at=10.0)  # the scale-up, made at the tick of 10.0
    starts.observe(loaded("w1"), now=10.5, last_scale_up=10.0)
    assert starts.seconds == 0.5

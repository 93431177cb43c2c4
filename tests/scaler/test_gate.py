"""The canary gate's verdicts (pure), and what it remembers between ticks."""

import math

from control_plane.routes import CanaryGate, ModelRoute
from pipecast.scaler.gate import Gate, VersionFigures, add_up_versions, judge
from pipecast.scaler.signals import parse_stats

STABLE, CANARY = "s" * 64, "c" * 64
ROUTE = ModelRoute("chat", STABLE, ((STABLE, 90), (CANARY, 10)), CanaryGate(min_requests=20))
TTFT_WINDOW_S = 60.0  # the routers' (/stats ttft.window_s)


def figures(requests: int, failed: int, p95: float, count: int | None = None,
            ready_s: float | None = math.inf) -> VersionFigures:
    return VersionFigures(requests, failed, p95, requests if count is None else count, ready_s, TTFT_WINDOW_S)


def test_a_canary_is_not_judged_on_the_ttft_of_its_cold_start():
    """Found in review: its first replica loading for 2 s, the 22 requests that waited for it gave a p95 of 2 s
    against the stable's 0.035 s, and the canary was rolled back at once. Its TTFT counts only once it has
    been ready for a whole window (no request that waited for the cold start left in it)."""
    stable = figures(200, 0, 0.035)
    for ready_s in (None, 0.0, TTFT_WINDOW_S - 1):
        assert judge(ROUTE, {STABLE: stable, CANARY: figures(22, 0, 1.978, ready_s=ready_s)}) == []
    [verdict] = judge(ROUTE, {STABLE: stable, CANARY: figures(22, 0, 1.978, ready_s=TTFT_WINDOW_S)})
    assert verdict.reason.startswith("gate: canary p95 TTFT 1.978 s > stable's 0.035 s x 1.5")


def test_the_ttft_is_judged_on_as_many_answers_in_its_window_as_the_gate_asks_for():
    """Found in review: ``min_requests`` was checked against the cumulative counts, the p95 over the last 60 s:
    one slow answer in a quiet minute rolled back a canary with hundreds of requests behind it."""
    stable = figures(500, 0, 0.035)
    assert judge(ROUTE, {STABLE: stable, CANARY: figures(300, 0, 1.0, count=1)}) == []
    assert judge(ROUTE, {STABLE: figures(500, 0, 0.035, count=19), CANARY: figures(300, 0, 1.0)}) == []
    assert len(judge(ROUTE, {STABLE: stable, CANARY: figures(300, 0, 1.0, count=20)})) == 1


def test_a_canary_added_again_is_judged_on_the_counts_since_and_falling_counts_count_from_there():
    gate = Gate()
    failing = {STABLE: figures(100, 0, 0.03), CANARY: figures(20, 10, 0.03)}
    assert len(gate.judge(ROUTE, failing)) == 1  # a route seen first: the routers' whole counts
    gate.saw(ModelRoute("chat", STABLE, ((STABLE, 100),), ROUTE.gate))  # rolled back
    assert gate.judge(ROUTE, failing) == []  # added again: nothing since
    later = {STABLE: figures(130, 0, 0.03), CANARY: figures(45, 10, 0.03)}
    assert gate.judge(ROUTE, later) == []  # 25 since, none failed
    # The routers restarted (counting from 0): the requests from then on count.
    assert gate.judge(ROUTE, {STABLE: figures(10, 0, 0.03), CANARY: figures(5, 0, 0.03)}) == []
    [verdict] = gate.judge(ROUTE, {STABLE: figures(40, 0, 0.03), CANARY: figures(30, 8, 0.03)})
    assert "(canary: 25 requests, 8 failed" in verdict.reason and "stable: 30 requests, 0 failed" in verdict.reason
    gate.forget([])
    assert gate.versions == {} and gate.added == {}


def test_the_routers_figures_add_up_the_shortest_readiness_counting_a_router_without_one_as_ready_long():
    def answer(ready_s: float | None, count: int, *, say: bool = True) -> dict:
        version = {"queue_depth": 0, "in_flight": 0, "ready_s": ready_s,
                   "counters": {"arrived": count, "answered": count, "failed": 0, "completion_tokens": 0},
                   "ttft": {"window_s": 60, "count": count, "p50": 0.1, "p95": 0.1, "p99": 0.1}}
        if not say:
            del version["ready_s"]
        return parse_stats("r", {"format": 1, "queue_depth": 0, "in_flight": 0, "workers": [], "versions": {
            CANARY: version}, "counters": {"arrived": 0, "answered": 0, "failed": 0},
            "ttft": {"window_s": 60, "count": 0, "p50": None, "p95": None, "p99": None}})["versions"]

    assert add_up_versions([answer(90.0, 5), answer(70.0, 7)])[CANARY] == VersionFigures(12, 0, 0.1, 12, 70.0, 60.0)
    assert add_up_versions([answer(90.0, 5), answer(None, 7), None])[CANARY].ready_s is None
    assert add_up_versions([answer(0.0, 5, say=False)])[CANARY].ready_s == math.inf

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


def judged(gate: Gate, route: ModelRoute, **routers: dict) -> list:
    """The gate's verdicts on the figures of the routers named (instance id -> their versions' figures)."""
    totals = {p: VersionFigures(sum(r[p].requests for r in routers.values() if p in r),
                                sum(r[p].failed for r in routers.values() if p in r), 0.03,
                                sum(r[p].ttft_count for r in routers.values() if p in r), math.inf, TTFT_WINDOW_S)
              for p in (STABLE, CANARY)}
    return gate.judge(route, totals, routers)


def test_a_canary_added_again_is_judged_on_the_counts_since_and_falling_counts_count_from_there():
    gate = Gate()
    without = ModelRoute("chat", STABLE, ((STABLE, 100),), ROUTE.gate)
    gate.saw(without)
    failing = {STABLE: figures(100, 0, 0.03), CANARY: figures(20, 10, 0.03)}
    assert judged(gate, ROUTE, a=failing) == []  # added: nothing since
    failing_more = {STABLE: figures(130, 0, 0.03), CANARY: figures(50, 20, 0.03)}
    assert len(judged(gate, ROUTE, a=failing_more)) == 1  # 30 since, 10 failed
    gate.saw(without)  # rolled back
    assert judged(gate, ROUTE, a=failing_more) == []  # added again: nothing since
    later = {STABLE: figures(160, 0, 0.03), CANARY: figures(75, 20, 0.03)}
    assert judged(gate, ROUTE, a=later) == []  # 25 since, none failed
    # The router forgot the versions (counting from 0): the requests from then on count.
    assert judged(gate, ROUTE, a={STABLE: figures(10, 0, 0.03), CANARY: figures(5, 0, 0.03)}) == []
    [verdict] = judged(gate, ROUTE, a={STABLE: figures(40, 0, 0.03), CANARY: figures(30, 8, 0.03)})
    assert "(canary: 25 requests, 8 failed" in verdict.reason and "stable: 30 requests, 0 failed" in verdict.reason
    gate.forget([])
    assert gate.added == {}


def test_a_restarted_daemon_judges_a_canary_on_the_counts_from_its_start_not_the_routers_whole_history():
    """Found in review: a route seen first was judged on the routers' whole counts, so after a restart a canary
    added again after a rollback was rolled back again on its last run's failures."""
    gate = Gate()  # the daemon restarted: the canary is in the route already
    history = {STABLE: figures(100, 0, 0.03), CANARY: figures(40, 15, 0.03)}
    assert judged(gate, ROUTE, a=history) == []
    assert judged(gate, ROUTE, a={STABLE: figures(130, 0, 0.03), CANARY: figures(65, 15, 0.03)}) == []


def test_a_router_silent_for_a_tick_does_not_count_its_history_as_since_the_canary_came():
    """Found in review: the bases were the routers' sums, lowered when a silent router's counts left the sum; when
    it answered again its whole history counted as since the canary was added, diluting the stable version's error
    rate: a canary failing as often as the stable version was rolled back."""
    gate = Gate()
    gate.saw(ModelRoute("chat", STABLE, ((STABLE, 100),), ROUTE.gate))
    before = {STABLE: figures(1000, 0, 0.03), CANARY: figures(0, 0, 0.03)}
    assert judged(gate, ROUTE, a=before, b=before) == []  # the canary added
    assert judged(gate, ROUTE, a=before) == []  # b is silent
    after = {STABLE: figures(1050, 5, 0.03), CANARY: figures(50, 5, 0.03)}
    assert judged(gate, ROUTE, a=after, b=after) == []  # both 10% since: no verdict
    worse = {STABLE: figures(1100, 5, 0.03), CANARY: figures(100, 15, 0.03)}
    [verdict] = judged(gate, ROUTE, a=worse, b=worse)  # the canary 15%, the stable version 5%
    assert "(canary: 200 requests, 30 failed" in verdict.reason and "stable: 200 requests, 10 failed" in verdict.reason


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

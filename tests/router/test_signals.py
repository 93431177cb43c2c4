"""The router's scaling signals, pure (fake clocks): counters, the TTFT window, idle time, the /stats shape."""

import re
from dataclasses import replace

import pytest

from pipecast.router.discovery import DiscoveredPipeline
from pipecast.router import app as app_module
from pipecast.router.app import Router, RouterConfig, _was_ready
from pipecast.router.pool import Dispatcher, Worker, WorkerPool
from pipecast.router import signals as signals_module
from pipecast.router.signals import (MAX_TENANTS, OTHER_TENANTS, SUMMARY_SORT_MAX, VERSION_IDLE_S, Signals,
                                     TtftWindow, answer_tokens, percentile, prompt_tokens, stream_tokens)
from pipecast.serve.health import WorkerHealth

A, B = "http://a:1", "http://b:1"
READY = WorkerHealth(status="ready", blocks_present=1, blocks_total=1, queue_depth=0, running=0, max_queue=8)


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_percentiles_interpolate_linearly_between_ranks():
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0], 50) == 1.5
    values = [float(v) for v in range(1, 101)]  # 1..100: numpy.percentile gives the same
    assert (percentile(values, 50), percentile(values, 95), percentile(values, 99)) == (50.5, pytest.approx(95.05),
                                                                                         pytest.approx(99.01))
    assert percentile([1.0, 2.0, 3.0, 10.0], 95) == pytest.approx(8.95)


def test_the_ttft_window_forgets_samples_older_than_its_length():
    window = TtftWindow(window_s=60.0)
    assert window.summary(0.0) == {"window_s": 60.0, "count": 0, "p50": None, "p95": None, "p99": None}
    window.add(0.0, 9.0)
    window.add(30.0, 1.0)
    window.add(50.0, 3.0)
    assert window.summary(60.0) == {"window_s": 60.0, "count": 3, "p50": 3.0, "p95": pytest.approx(8.4),
                                    "p99": pytest.approx(8.88)}
    assert window.summary(60.5)["count"] == 2 and window.summary(60.5)["p50"] == 2.0  # the 9 s sample left
    assert window.summary(111.0)["count"] == 0 and window.summary(111.0)["p99"] is None


def test_a_large_ttft_window_is_sorted_at_most_once_a_second(monkeypatch):
    """Every /stats poll and /metrics scrape sorted every version's whole window on the event loop: 40 ms a poll
    with four full windows. A large window's summary is now kept for a second; a small one's is not kept."""
    window = TtftWindow(window_s=60.0)
    for i in range(SUMMARY_SORT_MAX + 1):
        window.add(0.0, float(i))
    sorts = []
    monkeypatch.setattr(signals_module, "sorted", lambda values: sorts.append(1) or sorted(values), raising=False)
    first = window.summary(1.0)
    window.add(1.2, 1e6)
    assert window.summary(1.5) == first and len(sorts) == 1  # within the second: the summary kept
    assert window.summary(2.0)["count"] == SUMMARY_SORT_MAX + 2 and len(sorts) == 2
    small = TtftWindow(window_s=60.0)
    small.add(0.0, 1.0)
    assert small.summary(1.0)["count"] == 1
    small.add(1.1, 2.0)
    assert small.summary(1.2)["count"] == 2  # a small window is summarized afresh at every call


def test_the_ttft_window_is_bounded():
    window = TtftWindow(window_s=60.0, max_samples=3)
    for at in range(5):
        window.add(float(at), float(at))
    assert window.summary(5.0)["count"] == 3 and window.summary(5.0)["p50"] == 3.0  # the latest 3


@pytest.mark.parametrize("prompt, tokens", [
    ([1, 2, 3], 3), ([[1, 2], [3, 4, 5]], 5), ("abcdefghi", 2), (["abcd", "abcdefgh"], 3), (["abcd", [1, 2]], 3),
    ([], 0), ("", 0), (None, 0), (42, 0), ({"x": 1}, 0), ([None, {"x": 1}], 0),
])
def test_prompt_tokens_count_ids_and_estimate_text(prompt, tokens):
    assert prompt_tokens(prompt) == tokens


def test_a_worker_answer_nested_too_deeply_counts_no_tokens_instead_of_raising():
    """Found in review: stdlib json raised RecursionError on an answer nested 200000 deep, which the router did
    not catch: a bare 500 for a non-streaming answer, a stream cut without its error event."""
    deep = b"[" * 200_000 + b"]" * 200_000
    assert answer_tokens(b'{"usage": {"completion_tokens": ' + deep + b"}}") == 0
    assert stream_tokens(b'data: {"choices": ' + deep + b'}\n\ndata: {"choices": [{"text": "t"}]}\n\n') == 1
    assert answer_tokens(b'{"usage": {"completion_tokens": 7}}') == 7


def test_a_streams_tokens_are_counted_without_its_last_chunk_which_says_only_the_finish_reason():
    """Found in review: every chunk with choices counted a token, the worker's last one (its finish reason, no
    token) too: a version's completion_tokens in /stats was one too many per stream ending by length or EOS."""
    from pipecast.serve.openai_api import chat_chunk_body, chunk_body, sse, usage_chunk_body

    def stream(ids: bool, chat: bool, last: tuple[str, str | None]) -> bytes:
        def chunk(text: str, reason: str | None, token_ids: list[int], first: bool = False) -> dict:
            shown = token_ids if ids else None
            return (chat_chunk_body("r", 0, "m", text, reason, shown, first=first) if chat else
                    chunk_body("r", 0, "m", text, reason, shown))

        chunks = [chunk("a", None, [1], first=True), chunk("", None, [2]), chunk("中", None, [3])]
        chunks.append(chunk(last[0], last[1], [4]) if last[1] == "stop" else chunk(last[0], None, [4]))
        if last[1] != "stop":
            chunks.append(chunk("", "length" if last[1] == "length" else "stop", []))
        return b"".join(map(sse, [*chunks, usage_chunk_body("r", 0, "m", 2, 4, chat=chat)])) + b"data: [DONE]\n\n"

    for ids in (False, True):
        for chat in (False, True):
            # ended by length, by EOS (its token adds no text), by a stop string (the chunk of its token says so)
            for last in (("b", "length"), ("", "eos"), ("b", "stop")):
                assert stream_tokens(stream(ids, chat, last)) == 4, (ids, chat, last)


def test_counters_and_tenants_accumulate():
    clock = FakeClock()
    signals = Signals(clock, wall_clock=lambda: 1.7e9)
    assert signals.arrived("a", 10) == "a" and signals.arrived("a", 5) == "a" and signals.arrived("b", 1) == "b"
    signals.admission("a", True)
    signals.admission("a", False)
    signals.admission("b", True)
    signals.rejected()
    clock.now += 0.25
    assert signals.answer_started(clock.now - 2.0) == 2.0
    signals.answered()
    signals.failed()
    stats = signals.snapshot(queue_depth=4, in_flight=2, workers=[])
    assert stats["counters"] == {"arrived": 3, "prompt_tokens": 16, "admitted": 2, "answered": 1, "rejected": 1,
                                 "failed": 1}
    assert stats["tenants"] == {"a": {"arrived": 2, "admitted": 1, "rejected": 1, "queued": 0},
                                "b": {"arrived": 1, "admitted": 1, "rejected": 0, "queued": 0}}
    assert stats["ttft"] == {"window_s": 60.0, "count": 1, "p50": 2.0, "p95": 2.0, "p99": 2.0}
    assert (stats["queue_depth"], stats["in_flight"], stats["now_unix"], stats["started_unix"]) == (4, 2, 1.7e9, 1.7e9)


def test_tenant_names_beyond_the_cap_are_counted_together():
    signals = Signals(FakeClock())
    for index in range(MAX_TENANTS):
        signals.arrived(f"t{index}", 0)
    assert signals.arrived("one-more", 0) == OTHER_TENANTS == signals.arrived("and-another", 0)
    assert signals.arrived("t0", 0) == "t0"
    assert len(signals.tenants) == MAX_TENANTS + 1 and signals.tenants[OTHER_TENANTS].arrived == 2


def test_a_workers_idle_time_runs_from_its_join_or_its_last_request():
    clock = FakeClock(1000.0)
    pool = WorkerPool(clock)
    pool.sync({A: "node-a"})
    clock.now = 1003.0
    pool.sync({A: "node-a", B: "node-b"})
    assert [(w.url, w.idle_s(1010.0)) for w in pool.workers()] == [(A, 10.0), (B, 7.0)]
    pool.begin(A)
    pool.begin(A)
    clock.now = 1020.0
    pool.finish(pool.get(A))
    assert pool.get(A).idle_s(1030.0) is None and pool.in_flight == 1  # still one in flight
    clock.now = 1025.0
    pool.finish(pool.get(A))
    assert pool.get(A).idle_s(1030.0) == 5.0 and pool.in_flight == 0


def test_a_worker_is_idle_from_when_it_began_to_serve_not_from_when_it_joined():
    clock = FakeClock(1000.0)
    pool = WorkerPool(clock)
    pool.sync({A: "node-a"})
    clock.now = 1040.0
    pool.record_health(A, replace(READY, status="loading"), 1040.0)
    assert pool.get(A).idle_s(1041.0) == 41.0  # waiting for its package all that time
    clock.now = 1050.0
    pool.record_health(A, READY, 1050.0)
    pool.record_health(A, READY, 1051.0)  # still serving: the spell goes on
    assert pool.get(A).idle_s(1052.0) == 2.0


def test_the_stages_of_a_pipeline_are_busy_while_its_requests_run_even_after_it_dissolves():
    """Found in review: only a Worker's own requests counted, so /stats showed a pipeline's head idle while it served
    pipelined requests (and those moved onto it when the pipeline dissolved), and the scaler released it first."""
    clock = FakeClock(1000.0)
    pool = WorkerPool(clock)
    pool.sync({A: "node-a", B: "node-b"})
    pool.record_health(A, replace(READY, status="partial", blocks_total=2), 1000.0)
    pool.record_health(B, replace(READY, status="loading", blocks_total=2), 1000.0)
    pool.sync_pipelines([DiscoveredPipeline("pipeline:a+b", A, (A, B), "[route]")])
    clock.now = 1005.0
    first, second = pool.begin("pipeline:a+b"), pool.begin("pipeline:a+b")
    clock.now = 1080.0
    assert [(w.url, w.in_flight, w.idle_s(clock.now)) for w in pool.workers()] == [(A, 0, None), (B, 0, None)]
    # A and B now hold the model: the pipeline dissolves, its requests run on; B turning ready is no idle spell.
    pool.record_health(A, READY, 1080.0)
    pool.record_health(B, READY, 1080.0)
    pool.sync_pipelines([])
    pool.finish(first)
    assert [w.idle_s(1090.0) for w in pool.workers()] == [None, None]  # one still runs
    clock.now = 1085.0
    pool.finish(second)
    assert [w.idle_s(1090.0) for w in pool.workers()] == [5.0, 5.0] and pool.in_flight == 0
    pool.begin(A)
    pool.finish(pool.get(A))  # a worker's own requests as before
    assert pool.get(A).idle_s(1090.0) == 5.0 and pool.get(A).pipelined == 0


def test_requests_at_a_removed_worker_stay_in_flight_until_they_end():
    pool = WorkerPool(FakeClock())
    pool.sync({A: "node-a"})
    worker = pool.begin(A)
    pool.sync({})
    assert pool.in_flight == 1
    pool.finish(worker)
    assert pool.in_flight == 0


async def test_the_snapshot_pins_the_stats_contract():
    """The keys an autoscaler reads (format 1): renaming one breaks its pollers."""
    clock = FakeClock(1000.0)
    pool = WorkerPool(clock)
    dispatcher = Dispatcher(pool, max_queue=8, queue_timeout_s=10.0, clock=clock)
    pool.sync({A: "node-a", B: "node-b"})
    pool.record_health(A, replace(READY, queue_depth=3), polled_at=1000.0)
    worker = await dispatcher.acquire(arrival=1000.0)
    clock.now = 1002.5
    signals = Signals(clock, wall_clock=lambda: 1.7e9)
    signals.arrived("default", 3)
    signals.arrived("default", 3, version="pkg-b")
    signals.admission("default", True, version="pkg-b")
    signals.answer_started(1001.5, version="pkg-b")
    signals.answered(version="pkg-b", tokens=7)
    signals.failed(version="pkg-b")
    stats = signals.snapshot(dispatcher.waiting, pool.in_flight, pool.workers(), ready_since={"pkg-b": 1000.0})
    assert list(stats) == ["format", "instance", "now_unix", "started_unix", "queue_depth", "in_flight", "workers",
                           "counters", "ttft", "tenants", "versions"]
    assert stats["versions"] == {"pkg-b": {
        "queue_depth": 0, "in_flight": 0, "ready_s": 2.5,
        "counters": {"arrived": 1, "admitted": 1, "answered": 1, "failed": 1, "completion_tokens": 7},
        "ttft": {"window_s": 60.0, "count": 1, "p50": 1.0, "p95": 1.0, "p99": 1.0}}}
    assert stats["format"] == 1
    assert stats["workers"] == [
        {"url": A, "node_id": "node-a", "status": "ready", "in_flight": 1, "queue_depth": 3, "idle_s": None},
        {"url": B, "node_id": "node-b", "status": "unknown", "in_flight": 0, "queue_depth": 0, "idle_s": 2.5},
    ]
    assert list(stats["counters"]) == ["arrived", "prompt_tokens", "admitted", "answered", "rejected", "failed"]
    assert list(stats["ttft"]) == ["window_s", "count", "p50", "p95", "p99"]
    assert stats["tenants"] == {"default": {"arrived": 2, "admitted": 1, "rejected": 0, "queued": 0}}
    assert (stats["queue_depth"], stats["in_flight"]) == (0, 1)
    dispatcher.release(worker)


def test_the_routers_docstring_names_every_stats_field():
    """Found in review: the field list in the app's docstring lacked ``instance``, ``admitted`` and ``ready_s``."""
    router = Router(RouterConfig(), [])
    router.signals.arrived("default", 3, version="pkg-b")
    stats = router.stats()
    version = stats["versions"]["pkg-b"]
    fields = {*stats, *stats["counters"], *stats["ttft"], *version, *version["counters"]}
    assert {field for field in fields if f"``{field}``" not in app_module.__doc__} == set()


def test_a_request_that_waited_for_a_cold_start_counts_in_the_routers_ttft_not_its_versions():
    """Found in review: samples are stamped when the first token leaves, so a canary's cold-start backlog,
    answered just after it turned ready, filled its window however long it had been ready: the gate rolled it
    back for its first load."""
    clock = FakeClock(1000.0)
    signals = Signals(clock)
    signals.arrived("default", 3, version="pkg-b")
    clock.now = 1030.0
    signals.answer_started(1001.0, version="pkg-b", warm=False)  # arrived before its worker was ready
    signals.answer_started(1029.5, version="pkg-b")
    stats = signals.snapshot(0, 0, [], ready_since={"pkg-b": 1020.0})
    assert stats["ttft"]["count"] == 2 and stats["versions"]["pkg-b"]["ttft"]["count"] == 1
    assert stats["versions"]["pkg-b"]["ttft"]["p99"] == 0.5


def test_a_worker_was_ready_for_a_request_only_if_ready_when_it_arrived():
    ready = Worker(url=A, node_id="node-a", ready_since=1020.0)
    assert _was_ready(ready, 1020.0) and _was_ready(ready, 1025.0) and not _was_ready(ready, 1019.9)
    assert not _was_ready(Worker(url=A, node_id="node-a"), 1025.0)  # not ready (a pipeline has no ready_since at all)


def test_each_router_process_answers_an_instance_id_of_its_own():
    """A poller reaching several routers at one address (a Service), or one restarted, tells their cumulative
    counters apart by it: started_unix alone, shared by two routers started in the same second, cannot."""
    first, second = Signals(FakeClock(), wall_clock=lambda: 1.7e9), Signals(FakeClock(), wall_clock=lambda: 1.7e9)
    instance = first.snapshot(0, 0, [])["instance"]
    assert re.fullmatch(r"[0-9a-f]{32}", instance) and first.snapshot(0, 0, [])["instance"] == instance
    assert second.snapshot(0, 0, [])["instance"] != instance


def test_versions_idle_and_not_current_are_forgotten_but_never_the_last_one_seen():
    clock = FakeClock()
    signals = Signals(clock, wall_clock=lambda: 1.7e9)
    signals.arrived("t", 1, "old")
    clock.now += 1.0
    signals.arrived("t", 1, "routed")
    clock.now += VERSION_IDLE_S - 1.5
    assert signals.forget_versions({"routed"}) == []  # "old" was counted less than VERSION_IDLE_S ago
    clock.now += 1.0
    assert signals.forget_versions({"routed"}) == ["old"]
    clock.now += 2 * VERSION_IDLE_S
    # No longer routed and idle, but the last one seen: without any version, a scaler reads the router's totals.
    assert signals.forget_versions(set()) == [] and list(signals.versions) == ["routed"]
    signals.arrived("t", 1, "old")  # seen again: counted from 0
    assert signals.snapshot_versions()["old"]["counters"]["arrived"] == 1
    clock.now += VERSION_IDLE_S + 1.0
    assert signals.forget_versions(set()) == ["routed"]

"""What the routers answer, read and added up for the policy (pure)."""

from dataclasses import replace

import pytest

from control_plane.deployments import ScalingPolicy
from pipecast.scaler.policy import Pool, Replica, decide
from pipecast.scaler.signals import StatsFormatError, add_up, parse_stats, pool_of, serve_urls
from pipecast.v1 import control_pb2 as pb


def stats(queue: int, arrived: int, answered: int, p99: float | None, workers: list[tuple[str, str, float | None]]):
    """A router's /stats answer, as :mod:`pipecast.router.app` sends it (format 1)."""
    return {"format": 1, "queue_depth": queue, "in_flight": 1,
            "counters": {"arrived": arrived, "prompt_tokens": 0, "answered": answered, "rejected": 0, "failed": 0},
            "ttft": {"window_s": 60, "count": 3, "p50": 0.1, "p95": 0.2, "p99": p99},
            "workers": [{"url": url, "node_id": "", "status": status, "in_flight": 0, "idle_s": idle}
                        for url, status, idle in workers]}


def test_two_routers_add_up_and_each_worker_counts_once():
    """Every router lists every worker: a worker serving (or ready) counts once, not once per router; the
    counters add up, the p99 is the worst router's, a worker is as idle as the least idle view of it."""
    nodes = {"http://10.0.0.1:8000": "w1", "http://10.0.0.2:8000": "w2", "http://10.0.0.3:8000": "w3"}
    workers = [("http://10.0.0.1:8000/", "ready", 4.0), ("http://10.0.0.2:8000", "partial", None),
               ("http://10.0.0.3:8000", "loading", 9.0)]
    a = parse_stats("r1", stats(2, 10, 7, 0.5, workers))
    b = parse_stats("r2", stats(1, 5, 4, 1.5, [(url, status, 1.0 if idle else idle) for url, status, idle in workers]))
    signals = add_up(100.0, [a, b, None], nodes)
    assert (signals.routers_total, signals.routers_answered) == (3, 2)
    assert (signals.queue_depth, signals.in_flight, signals.arrived, signals.answered) == (3, 2, 15, 11)
    assert (signals.serving, signals.ready, signals.ttft_p99_s) == (2, 1, 1.5)
    assert signals.idle_s == {"w1": 1.0, "w2": None, "w3": 1.0}


def test_only_the_deployments_own_workers_count_where_a_router_serves_other_packages_too():
    # Found in review: a canary's deployment counted its stable version's ready workers as its own, and sized
    # its scale-up for them.
    nodes = {f"http://10.0.0.{i}:8000": f"w{i}" for i in range(1, 5)}
    workers = [(f"http://10.0.0.{i}:8000", "ready", 1.0) for i in (1, 2, 3)]
    workers.append(("http://10.0.0.4:8000", "loading", None))
    answer = parse_stats("r1", stats(2, 10, 7, 0.5, workers))
    assert (add_up(100.0, [answer], nodes).serving, add_up(100.0, [answer], nodes).ready) == (3, 3)
    canary = add_up(100.0, [answer], nodes, nodes={"w4"})
    assert (canary.serving, canary.ready, canary.idle_s) == (0, 0, {"w4": None})


def test_requests_waiting_in_serving_workers_own_queues_count_once_per_worker():
    """Workers take requests up to their own queue bound, so in a surge the backlog waits there: each serving
    worker's queue counts once (every router polls the same worker), a loading worker's not at all, and a
    router that sends no per-worker queue (one before the field) counts as 0."""
    nodes = {"http://10.0.0.1:8000": "w1", "http://10.0.0.2:8000": "w2", "http://10.0.0.3:8000": "w3"}
    answer = stats(0, 10, 7, 0.5, [("http://10.0.0.1:8000", "ready", None), ("http://10.0.0.2:8000", "partial", None),
                                   ("http://10.0.0.3:8000", "loading", None)])
    for worker, queued in zip(answer["workers"], (5, 2, 4)):
        worker["queue_depth"] = queued
    old = stats(0, 0, 0, None, [("http://10.0.0.1:8000", "ready", None)])
    signals = add_up(100.0, [parse_stats("r1", answer), parse_stats("r2", answer), parse_stats("r3", old)], nodes)
    assert signals.queued_at_workers == 7
    with pytest.raises(StatsFormatError, match=r"router r1: /stats field 'queue_depth' is -1, not a number within "
                                               r"0\.\.2\*\*53"):
        parse_stats("r1", {**answer, "workers": [{**answer["workers"][0], "queue_depth": -1}]})


def test_a_figure_beyond_2_53_is_the_routers_fault():
    """Review of the scaler, finding 1: a 400-digit integer (valid JSON) was read, and the policy's float math
    overflowed on it: the daemon's loop died."""
    answer = stats(2 ** 53, 10, 7, 0.5, [])
    assert parse_stats("r1", answer)["queue_depth"] == 2 ** 53
    for key, value in (("queue_depth", 10 ** 400), ("queue_depth", 2 ** 53 + 1), ("in_flight", 1e300)):
        with pytest.raises(StatsFormatError, match=rf"router r1: /stats field '{key}' is \S+, not a number within "
                                                   r"0\.\.2\*\*53$") as caught:
            parse_stats("r1", {**answer, key: value})
        assert len(str(caught.value)) < 120  # 400 digits are not repeated in the log
    with pytest.raises(StatsFormatError, match=r"field 'arrived' is 1e\+300, "):
        parse_stats("r1", {**answer, "counters": {**answer["counters"], "arrived": 1e300}})


def test_an_answer_without_what_the_policy_reads_is_the_routers_fault():
    with pytest.raises(StatsFormatError, match="router r1: /stats lacks counters, ttft or workers"):
        parse_stats("r1", {"format": 1, "counters": {}})
    with pytest.raises(StatsFormatError, match="router r1: /stats is not format 1"):
        parse_stats("r1", {"format": 2})


def version(queue: int, in_flight: int, arrived: int, answered: int, p99: float | None) -> dict:
    """One package's entry of a router's /stats ``versions``."""
    return {"queue_depth": queue, "in_flight": in_flight,
            "counters": {"arrived": arrived, "answered": answered, "failed": 0, "completion_tokens": 0},
            "ttft": {"window_s": 60, "count": answered, "p50": p99, "p95": p99, "p99": p99}}


def test_a_package_no_request_went_to_at_a_router_that_counts_versions_gets_none_of_its_load():
    # Found in review: a router without an entry for the package gave its totals, so a deployment beside a busy
    # one (or a canary never chosen) was sized to the other's whole load every tick, re-acquired after each release.
    a, b = "a" * 64, "b" * 64
    busy = {**stats(5, 40, 30, 0.9, []), "in_flight": 3, "versions": {b: version(5, 3, 40, 30, 0.9)}}
    idle = add_up(100.0, [parse_stats("r1", busy)], {}, a)
    assert (idle.queue_depth, idle.in_flight, idle.arrived, idle.answered, idle.ttft_p99_s) == (0, 0, 0, 0, None)
    mine = add_up(100.0, [parse_stats("r1", busy)], {}, b)
    assert (mine.queue_depth, mine.in_flight, mine.arrived, mine.answered, mine.ttft_p99_s) == (5, 3, 40, 30, 0.9)
    # Requests waiting there for no version may be anyone's: they still count for the idle package.
    unattributed = parse_stats("r1", {**busy, "queue_depth": 7})
    assert add_up(100.0, [unattributed], {}, a).queue_depth == 2


def test_a_canary_never_chosen_is_not_scaled_for_its_stable_versions_queue():
    stable, canary = "s" * 64, "c" * 64
    answer = parse_stats("r1", {**stats(6, 20, 14, 0.4, []), "versions": {stable: version(6, 1, 20, 14, 0.4)}})
    signals = add_up(100.0, [answer], {}, canary)
    assert (signals.queue_depth, signals.in_flight, signals.arrived) == (0, 0, 0)
    assert add_up(100.0, [answer], {}, stable).queue_depth == 6


def test_a_router_that_counts_no_version_gives_its_totals():
    """Routers before versions, or one none of whose requests went to a package by name (no routes, no worker
    naming the model): a router in front of one package, whose totals are that package's."""
    old = parse_stats("r1", stats(4, 9, 5, 0.7, []))
    new = parse_stats("r2", {**stats(2, 6, 6, 0.3, []), "versions": {"b" * 64: version(2, 1, 6, 6, 0.3)}})
    signals = add_up(100.0, [old, new], {}, "a" * 64)
    assert (signals.queue_depth, signals.in_flight, signals.arrived, signals.answered) == (4, 1, 9, 5)
    assert signals.ttft_p99_s == 0.7


def test_each_router_process_is_told_apart_by_its_instance_an_older_router_by_its_url():
    answer = stats(0, 10, 7, 0.5, [])
    a, b = parse_stats("r1", {**answer, "instance": "f" * 32}), parse_stats("r2", answer)
    assert (a["instance"], b["instance"]) == ("f" * 32, "r2")
    assert add_up(100.0, [b, None, a], {}).instances == ("f" * 32, "r2")
    with pytest.raises(StatsFormatError, match=r"^router r1: /stats instance is 7, not a non-empty string$"):
        parse_stats("r1", {**answer, "instance": 7})
    # Found in review: the whole value went into the message, which the daemon logs every tick (1.5 MB a line).
    with pytest.raises(StatsFormatError) as err:
        parse_stats("r1", {**answer, "instance": list(range(200_000))})
    assert len(str(err.value)) < 200
    with pytest.raises(StatsFormatError) as err:
        parse_stats("r1", {**answer, "versions": {"p" * 1_000_000: None}})
    assert len(str(err.value)) < 200


def test_one_router_listed_under_two_names_counts_once():
    """Found in review: a deployment naming its router as 127.0.0.1 and localhost added its queue up twice, and
    sized twice the replicas; the router's instance id says the two answers are one router's."""
    answer = parse_stats("http://127.0.0.1:9", {**stats(16, 10, 7, 0.5, []), "instance": "a" * 32})
    signals = add_up(100.0, [answer, parse_stats("http://localhost:9", {**stats(16, 10, 7, 0.5, []),
                                                                         "instance": "a" * 32}), None], {})
    assert (signals.queue_depth, signals.arrived, signals.routers_answered, signals.routers_total) == (16, 10, 1, 2)


def test_a_workers_url_matches_its_serve_url_spelled_otherwise():
    """Found in review: a router listing a worker as ``http://LOCALHOST:8000/`` (or without its default port) matched
    no node: the replica had no idle time and was never released."""
    registered = [pb.WorkerState(worker=pb.WorkerSpec(peer=pb.Peer(node_id=f"w{i}"), serve_url=url), alive=True)
                  for i, url in enumerate(("http://localhost:8000", "http://w1/"))]
    answer = stats(0, 0, 0, None, [("http://LOCALHOST:8000/", "ready", 3.0), ("HTTP://w1:80", "ready", 4.0)])
    assert add_up(100.0, [parse_stats("r1", answer)], serve_urls(registered)).idle_s == {"w0": 3.0, "w1": 4.0}


def test_a_worker_whose_node_id_is_null_goes_by_its_url():
    answer = stats(0, 10, 7, 0.5, [("http://w1:1", "ready", 3.0), ("http://w2:1", "ready", 4.0)])
    for worker in answer["workers"]:
        worker["node_id"] = None  # found in review: taken for a node named "None", both workers one
    signals = add_up(100.0, [parse_stats("r1", answer)], {})
    assert signals.serving == 2 and set(signals.idle_s) == {"http://w1:1", "http://w2:1"}


def test_polls_of_a_service_that_land_on_another_router_are_no_burst_of_arrivals():
    """Found in review: two routers behind one Service (values-ha.yaml), the daemon's keep-alive connection moving
    from one (1,000 requests so far, 1 req/s) to the other (5,000 so far, 1 req/s): the counters jumped by the
    difference, read as 801 req/s, and 14 replicas were added. A poll of another router process is like a missed
    one: no rate between the two; polls of the same router again give its rate."""
    url = "http://pipecast-router.default.svc:8080"
    nodes = {"http://10.0.0.1:8000": "w1", "http://10.0.0.2:8000": "w2"}
    workers = [(worker, "ready", None) for worker in nodes]
    pool = Pool(now=0.0, replicas=(Replica("w1", False), Replica("w2", False)), free=14)
    policy = ScalingPolicy(min_replicas=1, max_replicas=16)
    history, rates = [], []
    for t in range(22):  # on router B, on router A at t = 19 only, then on B again
        instance, total = ("a" * 32, 5000 + t) if t == 19 else ("b" * 32, 1000 + t)
        answer = {**stats(0, total, total, 0.3, workers), "instance": instance}
        history.append(add_up(1000.0 + t, [parse_stats(url, answer)], nodes))
        decision = decide(history, replace(pool, now=1000.0 + t), policy)
        assert decision.add == 0, decision.reason
        rates.append(decision.inputs["arrival_rps"])
    assert rates[-4:] == [1.0, 0.0, 1.0, 1.0]


def test_the_arrival_rate_is_of_the_admitted_requests_an_older_routers_arrived():
    """Found in review: a tenant over its limit is refused at once, however many replicas serve, yet its requests
    counted as arrivals: 1 admitted and 93 refused in 2 s scaled a pool of one up to its max of 8."""
    package = "p" * 64
    answer = stats(0, 94, 1, None, [])
    answer["counters"]["admitted"] = 1
    answer["versions"] = {package: version(0, 0, 94, 1, None)}
    answer["versions"][package]["counters"]["admitted"] = 1
    parsed = parse_stats("r1", answer)
    assert (parsed["arrived"], parsed["versions"][package]["arrived"]) == (1, 1)
    before = add_up(100.0, [parse_stats("r1", {**answer, "counters": {**answer["counters"], "admitted": 0},
                                                "versions": {}})], {})
    history = [before, add_up(102.0, [parse_stats("r1", {**answer, "versions": {}})], {})]
    decision = decide(history, Pool(now=102.0, replicas=(Replica("w1", False),), free=7),
                      ScalingPolicy(min_replicas=0, max_replicas=8, replica_rps=1.0))
    assert decision.add == 0 and decision.inputs["arrival_rps"] == 0.5, decision.reason
    older = parse_stats("r1", stats(0, 94, 1, None, []))  # a router before ``admitted``: its arrivals
    assert older["arrived"] == 94


def test_the_totals_are_the_routers_not_its_last_versions():
    """Found in review: the versions' loop took the names of the totals' counters, so a router's totals were read
    as its last version's (hidden where a deployment reads its own version's figures)."""
    answer = {**stats(0, 100, 90, None, []), "versions": {"v" * 64: version(0, 0, 3, 2, None)}}
    signals = add_up(100.0, [parse_stats("r1", answer)], {}, package_id="")
    assert (signals.arrived, signals.answered) == (100, 90)


def state(node: str, held: int, package: str = "p" * 64, serves: str = "") -> pb.WorkerState:
    spec = pb.WorkerSpec(peer=pb.Peer(node_id=node), serve_url=f"http://{node}:8000", serve_package=serves)
    return pb.WorkerState(worker=spec, alive=True, held=[pb.PackageBlocks(package_id=package,
                                                                          blocks=list(range(held)))])


def test_a_worker_released_moments_ago_is_free_not_a_replica():
    """Found in review: a released worker (its drop not reported yet) was neither, so a surge whose only spare
    workers were those just released held at no_free_workers for the keep-alive, though they hold every block.
    Free, a scale-up takes them back (the control plane places it on holders first)."""
    workers = [state("w1", 4), state("w2", 4), state("w3", 0)]
    pool = pool_of("p" * 64, 4, workers, [], now=0.0, released={"w1", "w2"})
    assert (pool.replicas, pool.free) == ((), 3)
    assert pool_of("p" * 64, 4, workers, [], now=0.0).replicas == (Replica("w1", False), Replica("w2", False))


def test_a_worker_serving_another_package_is_neither_a_replica_nor_free():
    """Found in review: a canary placed on a worker serving its stable version (`pipecast serve STABLE`) counted as
    the canary's replica, though it never served it, and the stable version's workers counted as free for the
    canary. Only workers bound to the package, or to none (agents before --serve-package), are in its pool."""
    canary, stable = "c" * 64, "s" * 64
    workers = [state("w1", 4, canary, serves=stable), state("w2", 0, stable, serves=stable),
               state("w3", 4, canary, serves=canary), state("w4", 0, canary, serves=canary), state("w5", 2, canary)]
    pool = pool_of(canary, 4, workers, [], now=0.0)
    assert (pool.replicas, pool.free) == ((Replica("w3", False), Replica("w5", True)), 1)


def test_a_worker_serving_another_package_that_holds_or_receives_this_one_is_a_stray_to_release():
    """Found in review: a copy on a worker bound to another package (placed before its agent said what it serves,
    or by `cp scale-up --count`) was stranded: in no pool, no release reached it, and its memory kept the worker's
    own package off it. It is a stray of the package's pool (released ones aside), which the daemon releases."""
    canary, stable = "c" * 64, "s" * 64
    workers = [state("w1", 4, canary, serves=stable), state("w2", 0, canary, serves=stable),
               state("w3", 0, canary, serves=stable), state("w4", 2, canary, serves=stable),
               state("w5", 4, canary, serves=canary)]
    plans = [pb.PlanSummary(package_id=canary, pending=["w2"]), pb.PlanSummary(package_id=stable, pending=["w3"])]
    pool = pool_of(canary, 4, workers, plans, now=0.0, released={"w4"})
    assert (pool.replicas, pool.free, pool.strays) == ((Replica("w5", False),), 0, ("w1", "w2"))
    assert pool_of(stable, 4, workers, plans, now=0.0).strays == ()
    assert pool_of(canary, 4, workers, plans, now=0.0, store="w1").strays == ("w2", "w4")  # never released

"""The scaling policy on load shapes (step, ramp, spike, noise, decay), missing data and cooldowns: pure."""

import random
from dataclasses import replace

import pytest

from control_plane.deployments import ScalingPolicy
from pipecast.scaler.policy import (
    SHORT_WINDOW_S, STALE_S, Decision, Pool, Replica, Signals, arrival_rate, baseline_demand, cold_start_demand,
    cold_start_of, decide, replica_throughput)

POLICY = ScalingPolicy(min_replicas=0, max_replicas=8, slo_ttft_p99_s=2.0, warm=0, keep_alive_s=10.0,
                       scale_up_cooldown_s=5.0, scale_down_cooldown_s=20.0, replica_rps=1.0, replica_concurrency=4)


class Sim:
    """A tiny closed loop: arrivals per second in, the policy's decisions applied to a pool (loading takes
    ``load_s``), replicas serving ``POLICY.replica_rps`` each; records every decision."""

    def __init__(self, policy: ScalingPolicy = POLICY, workers: int = 8, load_s: float = 5.0, replicas: int = 0):
        self.policy, self.workers, self.load_s = policy, workers, load_s
        self.t = 1000.0
        self.history: list[Signals] = []
        self.replicas: dict[str, float] = {f"w{i}": self.t - 100 for i in range(replicas)}  # node -> ready at
        self.idle_since: dict[str, float] = {}
        self.arrived = self.answered = 0
        self.queue = 0.0
        self.decisions: list[tuple[float, Decision]] = []
        self.last_up = None

    def step(self, arrivals: int, *, routers_answered: int = 1) -> Decision:
        self.t += 1.0
        ready = [n for n, at in self.replicas.items() if at <= self.t]
        self.arrived += arrivals
        self.queue += arrivals
        served = min(self.queue, len(ready) * self.policy.replica_rps)
        self.queue -= served
        self.answered += int(served)
        busy = set(ready[:int(round(served))])
        for node in ready:
            if node in busy:
                self.idle_since.pop(node, None)
            else:
                self.idle_since.setdefault(node, self.t)
        idle = {n: (None if n in busy else self.t - self.idle_since[n]) for n in ready}
        self.history.append(Signals(at=self.t, routers_total=1, routers_answered=routers_answered,
                                    queue_depth=int(self.queue), in_flight=len(busy), arrived=self.arrived,
                                    answered=self.answered, serving=len(ready), idle_s=idle))
        pool = Pool(now=self.t, replicas=tuple(Replica(n, at > self.t) for n, at in sorted(self.replicas.items())),
                    free=self.workers - len(self.replicas), last_scale_up=self.last_up)
        decision = decide(self.history[-120:], pool, self.policy)
        free = [f"w{i}" for i in range(self.workers) if f"w{i}" not in self.replicas]
        for node in free[:decision.add]:
            self.replicas[node] = self.t + self.load_s
        for node in decision.release:
            del self.replicas[node]
            self.idle_since.pop(node, None)
        if decision.add:
            self.last_up = self.t
        if decision.action != "hold":
            self.decisions.append((self.t, decision))
        return decision

    def run(self, load: list[int]) -> None:
        for arrivals in load:
            self.step(arrivals)

    def thrash(self) -> list[tuple[float, float]]:
        """(release time, acquire time) pairs closer than the scale-down cooldown."""
        out = []
        releases = [t for t, d in self.decisions if d.release]
        for t_up, d in self.decisions:
            out += [(t_r, t_up) for t_r in releases if d.add and 0 <= t_up - t_r < self.policy.scale_down_cooldown_s]
        return out


def test_a_step_is_met_with_the_whole_gap_at_once_not_one_at_a_time():
    sim = Sim()
    sim.run([0] * 10 + [4] * 3)
    ups = [d for _, d in sim.decisions if d.add]
    assert ups and ups[0].add >= 1
    sim.run([4] * 20)
    assert 4 <= len(sim.replicas) <= 8  # 4 req/s at 1 req/s each
    assert len([d for _, d in sim.decisions if d.add]) <= 3, sim.decisions


def test_the_first_decision_adds_enough_for_the_queue():
    sim = Sim()
    decision = sim.step(20)  # a burst: 20 waiting at 4 per replica
    assert decision.add == 5 and decision.kind == "demand"
    assert "queue 20 + in flight 0 need 5 at 4 each" in decision.reason


def test_a_ramp_grows_the_pool_monotonically_and_never_past_max():
    sim = Sim()
    sim.run([min(i // 4, 12) for i in range(60)])
    sizes = [len(sim.replicas)]
    assert sizes[-1] == POLICY.max_replicas
    assert all(not d.release for _, d in sim.decisions)


def test_a_spike_then_quiet_scales_up_then_back_to_zero_after_keep_alive_without_thrash():
    sim = Sim()
    sim.run([30] + [0] * 200)
    assert any(d.add for _, d in sim.decisions)
    assert len(sim.replicas) == 0  # min 0: scale to zero
    releases = [(t, d) for t, d in sim.decisions if d.release]
    first_add = min(t for t, d in sim.decisions if d.add)
    assert all(t - first_add >= POLICY.keep_alive_s for t, _ in releases)
    assert sim.thrash() == []


def test_noise_around_a_level_does_not_oscillate():
    rng = random.Random(7)
    sim = Sim(replicas=3)
    sim.run([max(0, round(3 + rng.gauss(0, 1))) for _ in range(300)])
    assert sim.thrash() == []
    assert len([d for _, d in sim.decisions if d.release]) <= 2, sim.decisions


def test_a_decaying_load_releases_gradually_and_keeps_min_and_warm():
    policy = ScalingPolicy(**{**POLICY.__dict__, "min_replicas": 1, "warm": 1})
    sim = Sim(policy=policy)
    sim.run([6] * 30 + [3] * 60 + [1] * 60 + [0] * 150)
    releases = [d for _, d in sim.decisions if d.release]
    assert len(sim.replicas) == 1  # no demand: warm 1 on top of 0, and min 1
    assert len(releases) >= 2  # stepwise, following the decay
    assert sim.thrash() == []


def test_no_signals_hold_the_pool_and_never_scale_to_zero():
    sim = Sim(replicas=3)
    sim.run([0] * 30)
    decision = sim.step(0, routers_answered=0)
    assert decision.action == "hold" and decision.kind == "no_signals"
    assert decision.reason.startswith("no signals from any router: holding")
    pool = Pool(now=10_000.0, replicas=(Replica("w0", False),), free=0)
    stale = decide(sim.history, pool, POLICY)
    assert stale.kind == "no_signals" and stale.desired == 1


def test_without_signals_the_pool_is_still_raised_to_its_minimum_never_lowered():
    """Found in review: without signals the pool was held as it was, so --min 2 with no router (or all down)
    stayed at 0 replicas, reporting desired 0."""
    two = replace(POLICY, min_replicas=2)
    none = decide([], Pool(now=0.0, replicas=(), free=3), two)
    assert (none.add, none.kind, none.desired) == (2, "min_replicas", 2)
    assert none.reason == "no signals from any router: raising 0 replicas to the minimum 2: add 2"
    assert decide([], Pool(now=0.0, replicas=(Replica("w0", True),), free=0), two).kind == "no_free_workers"
    cooling = decide([], Pool(now=0.0, replicas=(Replica("w0", True),), free=3, last_scale_up=-1.0), two)
    assert (cooling.add, cooling.kind) == (0, "cooldown")
    over = decide([], Pool(now=0.0, replicas=tuple(Replica(f"w{i}", False) for i in range(3)), free=3), two)
    assert (over.action, over.kind, over.desired) == ("hold", "no_signals", 3)


def test_a_restarted_daemon_releases_nothing_until_its_signals_span_the_keep_alive():
    """Found in review: after a restart (one poll, no rate yet) or a gap in the signals the peak covered only the
    polls present, so replicas the load of the keep-alive needed were released at once (4 req/s on 5 replicas:
    one released on the first tick after a restart, re-acquired soon after)."""
    policy = replace(POLICY, keep_alive_s=60.0, scale_down_cooldown_s=60.0, replica_concurrency=8)
    sim = Sim(policy=policy, replicas=5)
    sim.run([4] * 100)
    assert len(sim.replicas) == 5 and sim.decisions == []
    sim.history.clear()  # the daemon restarts: its signal history starts empty
    first = sim.step(4)
    assert first.action == "hold" and "not releasing on 0 s of signals, less than the 60 s" in first.reason
    sim.run([4] * 100)
    assert len(sim.replicas) == 5 and sim.decisions == []
    # A missed poll is no gap (the counters are cumulative); polls no router answered (silent routers, failed
    # ticks) over more than STALE_S are one, and start the span again.
    sim.step(4, routers_answered=0)
    assert "not releasing on" not in sim.step(4).reason
    for _ in range(int(STALE_S) + 1):
        sim.step(4, routers_answered=0)
    assert "not releasing on 0 s of signals" in sim.step(4).reason
    # Idle for good: released once a keep-alive of signals shows it.
    sim.run([0] * 200)
    assert len(sim.replicas) == 0


def test_a_keep_alive_longer_than_the_history_kept_needs_the_whole_history():
    policy = replace(POLICY, keep_alive_s=900.0)  # the daemon keeps HISTORY_S (600 s) of polls
    history = [Signals(at=float(t), routers_total=1, routers_answered=1, idle_s={"w0": 1000.0})
               for t in range(0, 601, 10)]
    pool = Pool(now=600.0, replicas=(Replica("w0", False),), free=0)
    assert decide(history, pool, policy).release == ("w0",)
    assert "not releasing on 590 s of signals" in decide(history[1:], pool, policy).reason


def test_a_silent_router_blocks_releases_not_scale_ups():
    history = [Signals(at=float(t), routers_total=2, routers_answered=1, idle_s={"w0": 100.0}) for t in range(30)]
    pool = Pool(now=29.0, replicas=(Replica("w0", False),), free=3)
    decision = decide(history, pool, POLICY)
    assert decision.action == "hold" and "router(s) are silent" in decision.reason
    busy = history + [Signals(at=30.0, routers_total=2, routers_answered=1, queue_depth=12)]
    assert decide(busy, Pool(now=30.0, replicas=(), free=3), POLICY).add == 3


def test_slo_miss_with_a_queue_adds_one_more_than_demand():
    history = [Signals(at=float(t), routers_total=1, routers_answered=1, queue_depth=1, serving=2, arrived=t,
                       answered=t, ttft_p99_s=5.0) for t in range(10)]
    pool = Pool(now=9.0, replicas=(Replica("w0", False), Replica("w1", False)), free=4)
    decision = decide(history, pool, POLICY)
    assert decision.kind == "slo" and decision.add == 1
    assert "p99 TTFT 5.00 s over the SLO 2.00 s" in decision.reason
    # With a replica on its way, it takes the queue: no SLO replica on top of it.
    loading = replace(pool, replicas=pool.replicas + (Replica("w2", True),))
    decision = decide(history, loading, POLICY)
    assert decision.kind != "slo" and decision.add == 0
    # Within the scale-up cooldown (that replica came up fast) a missed SLO adds one all the same.
    cooling = replace(pool, last_scale_up=7.0)
    decision = decide(history, cooling, POLICY)
    assert decision.kind == "slo" and decision.add == 1


def test_a_p99_over_the_slo_while_the_backlog_falls_fast_enough_adds_nothing():
    # As measured after a surge's cold start (docs/benchmarks.md): four replicas catching up, the router's p99
    # still the cold start's 5.8 s. 24 requests present 5 s ago, 8 now: 3.2/s, gone in 2.5 s, within the drain
    # (the 5.4 s cold start).
    policy = replace(POLICY, cold_start_s=5.4)
    present = [24, 21, 17, 14, 11, 8]
    history = [Signals(at=float(t), routers_total=1, routers_answered=1, queue_depth=2, in_flight=n - 2, serving=4,
                       ready=4, arrived=3 * t, answered=3 * t + 24 - n, ttft_p99_s=5.8) for t, n in enumerate(present)]
    replicas = tuple(Replica(f"w{i}", False) for i in range(4))
    decision = decide(history, Pool(now=5.0, replicas=replicas, free=4), policy)
    assert decision.action == "hold" and decision.kind == "steady"
    assert "p99 TTFT 5.80 s over the SLO, but the backlog is falling, gone within 5.4s at the pace measured" \
        in decision.reason
    # The same p99 with a backlog that falls too slowly to be gone within the drain (1 request in 5 s) adds one.
    slow = [replace(s, in_flight=s.in_flight + 14 - i // 5) for i, s in enumerate(history)]
    assert decide(slow, Pool(now=5.0, replicas=replicas, free=4), policy).kind == "slo"
    # Fewer requests because one of two routers fell silent is not a backlog falling.
    silent = [replace(s, routers_total=2, routers_answered=2 if i == 0 else 1) for i, s in enumerate(history)]
    assert decide(silent, Pool(now=5.0, replicas=replicas, free=4), policy).kind == "slo"


def test_requests_present_that_fall_fast_enough_add_no_replica_for_the_concurrency():
    # 20 requests at 4 a replica ask for 5, and the 2 ready at 1 req/s each would take 10 s, over the 8 s cold
    # start; but they fell from 35 in 5 s: 3/s, gone in under 7 s.
    present = [35, 32, 29, 26, 23, 20]
    history = [Signals(at=float(t), routers_total=1, routers_answered=1, in_flight=n, serving=2, ready=2)
               for t, n in enumerate(present)]
    pool = Pool(now=5.0, replicas=(Replica("w0", False), Replica("w1", False)), free=6)
    cold = replace(POLICY, cold_start_s=8.0)
    decision = decide(history, pool, cold)
    assert decision.add == 0 and "need 2 at 4 each (falling, gone within 8s at the pace measured)" in decision.reason
    rising = [replace(s, in_flight=n) for s, n in zip(history, (5, 8, 11, 14, 17, 20))]  # to the same 20
    assert decide(rising, pool, cold).add == 3


def test_within_the_scale_up_cooldown_a_queue_waits_for_the_replicas_loading_but_a_higher_rate_adds():
    history = [Signals(at=float(t), routers_total=1, routers_answered=1, arrived=t, queue_depth=8) for t in range(10)]
    pool = Pool(now=9.0, replicas=(Replica("w0", True),), free=4, last_scale_up=7.0)
    decision = decide(history, pool, POLICY)
    assert decision.kind == "cooldown" and decision.add == 0
    faster = [Signals(at=float(t), routers_total=1, routers_answered=1, arrived=3 * t) for t in range(10)]
    assert decide(faster, pool, POLICY).add == 2
    # Found in review: a rate above the pool let the queue's demand in too (40 waiting at 4 each: 8 more).
    queued = [Signals(at=float(t), routers_total=1, routers_answered=1, arrived=3 * t, queue_depth=40)
              for t in range(10)]
    decision = decide(queued, pool, POLICY)
    assert decision.add == 2 and decision.desired == 3
    assert decision.reason.endswith("in the scale-up cooldown: for the rate, 3: add 2")


def test_idle_replicas_go_in_one_release_not_one_per_cooldown():
    idle = {f"w{i}": 30.0 for i in range(4)}
    history = [Signals(at=float(t), routers_total=1, routers_answered=1, idle_s=idle) for t in range(100, 131)]
    replicas = tuple(Replica(n, False) for n in idle)
    decision = decide(history, Pool(now=130.0, replicas=replicas, free=0, last_scale_up=50.0), POLICY)
    assert sorted(decision.release) == sorted(idle) and decision.kind == "idle"
    soon = decide(history, Pool(now=130.0, replicas=replicas, free=0, last_scale_up=120.0), POLICY)
    assert soon.kind == "cooldown" and not soon.release  # 10 s after a scale-up: not yet


def test_a_burst_shorter_than_a_cold_start_adds_nothing_once_replicas_serve_but_starts_a_surge_from_nothing():
    # 3 req/s for 8 s, then 7 in each of the last 2 s: 7 req/s over the last 2 s, 4.6 over the last 5.
    arrived = [3 * t for t in range(9)] + [24 + 7, 24 + 14]
    history = [Signals(at=float(t), routers_total=1, routers_answered=1, in_flight=4, arrived=n, serving=3, ready=3)
               for t, n in enumerate(arrived)]
    pool = Pool(now=10.0, replicas=tuple(Replica(f"w{i}", False) for i in range(3)), free=5)
    two = ScalingPolicy(**{**POLICY.__dict__, "replica_rps": 2.0})
    serving = decide(history, pool, two)
    assert serving.add == 0 and serving.inputs["arrival_rps"] == 4.6  # 3 replicas at 2 req/s take it
    nothing = [Signals(**{**s.__dict__, "in_flight": 0, "serving": 0, "ready": 0}) for s in history]
    cold = decide(nothing, Pool(now=10.0, replicas=(), free=8), two)
    assert cold.add == 4 and cold.inputs["arrival_rps"] == 7.0  # from nothing the first seconds count


def test_release_keeps_the_peak_of_the_keep_alive_not_of_the_longer_scale_down_cooldown():
    # 8 requests in flight 15 s ago (2 replicas at 4 each), none since; 4 replicas idle past the 10 s
    # keep-alive, the last scale-up long ago: the 20 s cooldown is no reason to keep that peak's 3.
    idle = {f"w{i}": 12.0 for i in range(4)}
    history = [Signals(at=float(t), routers_total=1, routers_answered=1, in_flight=8 if t == 115 else 0,
                       idle_s=idle) for t in range(100, 131)]
    pool = Pool(now=130.0, replicas=tuple(Replica(n, False) for n in idle), free=0, last_scale_up=50.0)
    assert len(decide(history, pool, POLICY).release) == 4
    recent = [Signals(**{**s.__dict__, "in_flight": 8 if s.at == 125 else 0}) for s in history]
    kept = decide(recent, pool, POLICY)  # within the keep-alive: 1.25 x 2 -> 3 kept
    assert len(kept.release) == 1 and "keeping 3" in kept.reason


AUTO = ScalingPolicy(**{**POLICY.__dict__, "warm_auto_factor": 2.0})


def steady(seconds: int, *, start: int = 0) -> list[Signals]:
    """0.8 req/s: four arrivals every five seconds, one at a time (one in flight)."""
    return [Signals(at=float(t), routers_total=1, routers_answered=1, arrived=(t * 4) // 5, answered=(t * 4) // 5,
                    in_flight=1, serving=1) for t in range(start, start + seconds)]


def test_auto_warm_absorbs_twice_the_steady_baseline_beyond_what_is_needed_now():
    history = steady(120)
    pool = Pool(now=119.0, replicas=(Replica("w0", False),), free=4)
    decision = decide(history, pool, AUTO)
    # baseline 0.8 replicas; 2.0x is 1.6 -> 2 replicas; the rate now needs 1: warm 1
    assert "+warm auto 1 (2.0x baseline 0.8 replicas) -> desired 2, have 1: add 1" in decision.reason
    assert decision.add == 1 and decision.inputs["baseline_replicas"] == 0.8
    tripled = decide(history, pool, ScalingPolicy(**{**AUTO.__dict__, "warm_auto_factor": 3.0}))
    assert tripled.desired == 3 and "+warm auto 2 (3.0x baseline 0.8 replicas)" in tripled.reason


def test_a_spike_barely_moves_the_baseline_and_the_warm_pool_is_not_added_on_top_of_it():
    history = steady(120)
    arrived = history[-1].arrived
    history += [Signals(at=float(t), routers_total=1, routers_answered=1, arrived=arrived + 20 * (t - 119),
                        in_flight=8, serving=1) for t in range(120, 135)]
    assert baseline_demand(history, 1.0, AUTO) == pytest.approx(0.8)
    decision = decide(history, Pool(now=134.0, replicas=(Replica("w0", False),), free=30), AUTO)
    assert "+warm auto 0 (2.0x baseline 0.8 replicas) -> desired 8" in decision.reason  # 20 req/s, max 8


def test_auto_warm_with_no_traffic_is_zero_but_min_holds():
    history = [Signals(at=float(t), routers_total=1, routers_answered=1) for t in range(60)]
    policy = ScalingPolicy(**{**AUTO.__dict__, "min_replicas": 1})
    decision = decide(history, Pool(now=59.0, replicas=(), free=4), policy)
    assert decision.add == 1 and "+warm auto 0 (2.0x baseline 0 replicas) -> desired 1" in decision.reason
    silent = decide(history[:-1] + [Signals(at=59.0, routers_total=1, routers_answered=0)],
                    Pool(now=59.0, replicas=(Replica("w0", False),), free=4), AUTO)
    assert silent.kind == "no_signals" and silent.desired == 1


def test_polls_no_router_answered_are_no_part_of_the_auto_warm_baseline():
    # The routers were down for longer than they answered: no signal, not a spell of no load.
    gap = [Signals(at=float(t), routers_total=1, routers_answered=0) for t in range(60, 200)]
    history = steady(60) + gap + steady(60, start=200)
    assert baseline_demand(history, 1.0, AUTO) == pytest.approx(0.8)
    decision = decide(history, Pool(now=259.0, replicas=(Replica("w0", False),), free=4), AUTO)
    assert decision.inputs["baseline_replicas"] == 0.8 and decision.desired == 2


def test_partial_replicas_are_still_in_their_cold_start_and_a_rising_rate_adds_to_them():
    """A replica serving layer by layer while its blocks arrive (partial) takes requests, but not yet at a
    replica's throughput: what arrives meanwhile waits for it, so it does not count as keeping up. Three
    partial replicas of a surge rising to 6 req/s: the daemon adds for the rate and the cold start."""
    cold = ScalingPolicy(**{**POLICY.__dict__, "cold_start_s": 5.0, "max_replicas": 16})
    history = [Signals(at=1000.0 + t, routers_total=1, routers_answered=1, in_flight=3, arrived=6 * t, serving=3,
                       ready=0) for t in range(6)]
    pool = Pool(now=1005.0, replicas=tuple(Replica(f"w{i}", True) for i in range(3)), free=13,
                last_scale_up=1003.0)
    decision = decide(history, pool, cold)
    # 6 req/s for 5 s: 30 requests drained within the 5 s cold start, 6 more replicas at 1 req/s, plus the 6: 12.
    assert decision.add == 9 and decision.inputs["ready"] == 0 and "12 to drain what arrives" in decision.reason
    # The same three holding the model take 3 req/s: only the other 3 pile up (15 requests, 3 replicas).
    ready = [Signals(**{**h.__dict__, "ready": 3}) for h in history]
    assert "9 to drain what arrives" in decide(ready, pool, cold).reason


def test_auto_warm_in_the_closed_loop_settles_at_twice_the_baseline_without_thrash():
    sim = Sim(policy=AUTO)
    sim.run([1, 1, 1, 1, 0] * 60)
    assert len(sim.replicas) == 2
    assert sim.thrash() == []


def test_with_a_cold_start_the_scale_up_drains_what_arrives_while_the_replicas_load():
    # 3 req/s at 1 req/s per replica, nothing serving, 5 s to load and a 2 s SLO: 3 for the rate, and 15
    # requests arrive meanwhile, drained within the cold start (longer than the SLO) by 3 more: 6.
    cold = ScalingPolicy(**{**POLICY.__dict__, "cold_start_s": 5.0, "max_replicas": 16})
    assert cold_start_demand(3.0, 0, 1.0, cold, 5.0) == 6
    assert cold_start_demand(3.0, 3, 1.0, cold, 5.0) == 0  # the serving replicas keep up: nothing piles up
    assert cold_start_demand(3.0, 2, 1.0, cold, 5.0) == 4  # 1 req/s beyond them for 5 s: 3 + 1
    assert cold_start_demand(3.0, 0, 1.0, POLICY, 0.0) == 0  # not counted without a cold start
    # A cold start shorter than the SLO: its 3 requests are drained within the SLO, 1.5 more.
    assert cold_start_demand(3.0, 0, 1.0, cold, 1.0) == 5
    sim = Sim(cold, workers=16)
    sim.run([3] * 2)  # the first second: the queue (no rate yet); the second: 3 req/s seen
    (_, first), (_, second) = sim.decisions
    assert (first.add, second.add) == (1, 5) and "6 to drain what arrives in a 5s cold start" in second.reason
    sim.run([3] * 38 + [0] * 60)  # once they serve, the extra ones go after the keep-alive, then the rest
    assert len(sim.replicas) == 0 and sim.thrash() == []
    plain = Sim()
    plain.run([3] * 4)  # without a cold start: the rate alone, 3 replicas at 1 req/s each
    assert sum(d.add for _, d in plain.decisions) == 3


def test_requests_the_ready_replicas_finish_within_a_cold_start_add_no_replica():
    # Two ready replicas at 3 req/s each, 2 req/s arriving, 17 requests at them (8 a batch): one arriving now
    # waits 17 / 6 = 2.8 s behind them, later ones less (the backlog shrinks at 6 - 2 a second), while a replica
    # added now serves only after its 5 s cold start.
    cold = ScalingPolicy(**{**POLICY.__dict__, "cold_start_s": 5.0, "replica_rps": 3.0, "replica_concurrency": 8})
    history = [Signals(at=1000.0 + t, routers_total=1, routers_answered=1, in_flight=17, arrived=2 * t, serving=2,
                       ready=2) for t in range(6)]
    pool = Pool(now=1005.0, replicas=(Replica("w0", False), Replica("w1", False)), free=6)
    held = decide(history, pool, cold)
    assert held.add == 0 and ("need 2 at 8 each (one arriving now waits 2.8s for them at the 2 ready, within the "
                              "5s a new one takes)") in held.reason
    assert "arriving now" not in decide(history, pool, POLICY).reason  # no cold start: nothing capped
    # 21 requests: 5.25 s until the last of them is served, but a wait of 3.5 s: still held (the add at 10.1 s of
    # docs/benchmarks.md's long run). 35 requests: a 5.8 s wait, longer than the cold start: worth adding.
    assert decide([replace(h, in_flight=21) for h in history], pool, cold).add == 0
    assert decide([replace(h, in_flight=35) for h in history], pool, cold).add == 3
    # Arrivals at the ready replicas' throughput: the backlog never shrinks, whatever its size.
    assert decide([replace(h, arrived=6 * i) for i, h in enumerate(history)], pool, cold).add > 0
    # Without a cold start the requests present count at the batch size, as before.
    plain = ScalingPolicy(**{**cold.__dict__, "cold_start_s": 0.0})
    assert decide(history, pool, plain).add == 1


def test_a_measured_cold_start_sizes_the_scale_up_only_where_the_policy_asks_for_it():
    measured = ScalingPolicy(**{**POLICY.__dict__, "cold_start_measured": True, "max_replicas": 16})
    before, after = Pool(now=1002.0, replicas=(), free=16), Pool(now=1002.0, replicas=(), free=16, cold_start_s=5.0)
    assert cold_start_of(measured, before) == (0.0, "policy")  # nothing measured yet: the policy's (0: none)
    assert cold_start_of(measured, after) == (5.0, "measured")
    assert cold_start_of(POLICY, after) == (0.0, "policy")  # not asked for: the measure is not used
    history = [Signals(at=1000.0 + t, routers_total=1, routers_answered=1, queue_depth=3 * t, arrived=3 * t)
               for t in range(3)]
    sized, plain = decide(history, after, measured), decide(history, after, POLICY)
    assert (sized.add, plain.add) == (6, 3)  # as with cold_start_s 5 above
    assert "6 to drain what arrives in a 5s cold start (measured)" in sized.reason
    assert (sized.inputs["cold_start_s"], sized.inputs["cold_start_from"]) == (5.0, "measured")


def test_a_surge_after_a_quiet_spell_is_sized_at_the_throughput_measured_in_the_last_one():
    # Two replicas answered 6 req/s between them while requests queued (3 each, the policy says 1); then
    # quiet, scaled to zero; now 6 req/s arrive again with nothing queued yet: 2 replicas at the 3 measured,
    # not 6 at the policy's 1.
    def signals(t: float, **values) -> Signals:
        return Signals(at=1000.0 + t, routers_total=1, routers_answered=1, **values)

    busy = [signals(t, queue_depth=10, in_flight=8, arrived=6 * t, answered=6 * t, serving=2, ready=2)
            for t in range(6)]
    # Then replicas still loading, queued: they answer at the pace their blocks arrive (0.5 req/s each),
    # not their own, so that is no measure of what a replica serves.
    partial = [signals(t, queue_depth=10, in_flight=8, arrived=30 + 6 * (t - 6), answered=30 + (t - 6),
                       serving=2, ready=1) for t in range(6, 12)]
    quiet = [signals(t, arrived=66, answered=66) for t in range(12, 66)]
    surge = [signals(t, arrived=66 + 6 * (t - 65), answered=66) for t in range(66, 68)]
    pool = Pool(now=1067.0, replicas=(), free=8)
    decision = decide(busy + partial + quiet + surge, pool, POLICY)
    assert decision.inputs["replica_rps"] == 3.0 and decision.add == 2
    assert decide(partial + quiet + surge, pool, POLICY).inputs["replica_rps"] == POLICY.replica_rps
    assert decide(quiet + surge, pool, POLICY).add == 6  # never measured: the policy's 1 req/s


def test_a_steady_load_with_a_one_poll_queue_blip_adds_nothing():
    """Review of the scaler (7), finding 1: two polls a second apart with a queue were a throughput measure, and
    answers finish in bursts: 1 answered in that second read 0.25 req/s a replica where 1.0 was real, kept for
    the 10 minutes of history, so 4 replicas carrying 4 req/s with no queue got 12 more."""
    policy = replace(POLICY, max_replicas=32, replica_concurrency=8)
    replicas = tuple(Replica(f"w{i}", False) for i in range(4))

    def steady(queued: range, answers: dict[int, int]) -> list[Signals]:
        """4 req/s at 4 replicas, 28 in flight, 4 answered a second but as ``answers`` says; a queue at ``queued``."""
        history, answered = [], 0
        for t in range(120):
            answered += answers.get(t, 4)
            history.append(Signals(at=1000.0 + t, routers_total=1, routers_answered=1,
                                   queue_depth=3 if t in queued else 0, in_flight=28, arrived=4 * (t + 1),
                                   answered=answered, serving=4, ready=4, instances=("r",)))
        return history

    blip = steady(range(30, 32), {31: 1, 32: 7})  # the second with the queue: 1 answered, then the rest
    for end in range(1, len(blip) + 1):
        decision = decide(blip[:end], Pool(now=blip[end - 1].at, replicas=replicas, free=28), policy)
        assert decision.add == 0 and decision.inputs["replica_rps"] >= 1.0, (end, decision.reason)
    # A queue that lasts is a measure (1 req/s a replica, the same long requests), but what the replicas answer
    # later is no less than that: 4 req/s at 4 replicas, 1 each.
    slow = steady(range(30, 36), {t: 1 for t in range(31, 36)})
    assert replica_throughput(slow[:36], policy) == 0.25 and replica_throughput(slow, policy) == 1.0
    assert decide(slow, Pool(now=slow[-1].at, replicas=replicas, free=28), policy).add == 0


def test_two_queue_blips_with_none_between_them_are_no_measure():
    # Found in review: two one-poll blips 3 s apart spanned MEASURE_MIN_S and measured the unsaturated replicas'
    # 1 req/s, so a surge after them was sized at a third of what a replica serves.
    policy = replace(POLICY, max_replicas=32, replica_concurrency=8, replica_rps=3.0)
    history = [Signals(at=1000.0 + t, routers_total=1, routers_answered=1, queue_depth=1 if t in (30, 33) else 0,
                       in_flight=8, arrived=4 * (t + 1), answered=4 * t, serving=4, ready=4, instances=("r",))
               for t in range(60)]
    assert replica_throughput(history, policy) == 3.0


def test_requests_waiting_in_the_workers_own_queues_are_named_but_start_no_measure():
    # Workers take requests up to their own queue bound, so the routers' queues stay empty in a surge. A
    # decision names the requests waiting there; they do not start a throughput measure (the policy docstring
    # of replica_throughput says why): 2 replicas answering 2 req/s between them while 3 req/s arrive are
    # sized at the policy's 3 req/s each, not the 1 they answer.
    fast = ScalingPolicy(**{**POLICY.__dict__, "replica_rps": 3.0})
    history = [Signals(at=1000.0 + t, routers_total=1, routers_answered=1, in_flight=8, queued_at_workers=6,
                       arrived=3 * t, answered=2 * t, serving=2, ready=2) for t in range(6)]
    pool = Pool(now=1005.0, replicas=(Replica("w1", False), Replica("w2", False)), free=6)
    decision = decide(history, pool, fast)
    assert (decision.inputs["replica_rps"], decision.add) == (3.0, 0)
    assert "queue 0 + in flight 8 (6 waiting in workers' queues) need 2 at 4 each" in decision.reason
    assert decision.inputs["queued_at_workers"] == 6
    # The same with the backlog in a router: measured, 1 req/s each (and the 14 requests present need 4).
    routed = decide([Signals(**{**h.__dict__, "queue_depth": 6, "queued_at_workers": 0}) for h in history], pool, fast)
    assert (routed.inputs["replica_rps"], routed.add) == (1.0, 2)


def test_a_router_missing_one_poll_is_no_surge_of_arrivals():
    # Found by a property search: the routers' cumulative counters are added up over those that answered, so a
    # poll one of two routers missed read, 5 s later, as ~10,000 req/s and added replicas up to the maximum.
    policy = ScalingPolicy()
    idle = {"n0": None, "n1": None}
    history, decisions = [], []
    for k in range(12):  # two routers, 1 req/s each, the second silent at k = 3 only
        arrived = 50_000 + k
        silent = k == 3
        history.append(Signals(at=1000.0 + k, routers_total=2, routers_answered=1 if silent else 2, in_flight=1,
                               arrived=arrived if silent else 2 * arrived,
                               answered=(arrived if silent else 2 * arrived) - 1, serving=2, ready=2,
                               ttft_p99_s=0.3, idle_s=idle))
        pool = Pool(now=1000.0 + k, replicas=(Replica("n0", False), Replica("n1", False)), free=6)
        decisions.append(decide(history, pool, policy))
    assert [d.action for d in decisions if d.action != "hold"] == []
    assert "2.00 req/s" in decisions[-1].reason


def test_a_counter_that_goes_back_is_a_restarted_router_and_the_rate_is_taken_since():
    """A router that sends no instance id (one before it) and restarted: its counters begin again. The rate
    is its own since the restart, not 0 (nor a difference across the restart)."""
    history = [Signals(at=1000.0 + t, routers_total=1, routers_answered=1, ready=1,
                       arrived=50_000 + 10 * t if t < 16 else 10 * (t - 16), answered=0) for t in range(20)]
    assert arrival_rate(history) == 10.0
    busy = [replace(s, queue_depth=4, serving=1, answered=s.arrived) for s in history]
    assert decide(busy, Pool(now=1019.0, replicas=(Replica("w1", False),), free=7), POLICY).inputs[
        "replica_rps"] == 10.0


def test_a_queue_falling_at_no_ready_replica_is_given_up_not_drained_and_scales_up():
    """Review of the scaler, finding 11: requests waiting at zero replicas that leave (clients give up, queue
    timeouts) read as a backlog the replicas in place drain, and the pool stayed at zero."""
    history = [Signals(at=100.0 + t, routers_total=1, routers_answered=1, queue_depth=q, arrived=10)
               for t, q in enumerate([10, 8, 6, 4, 2, 1])]
    decision = decide(history, Pool(now=105.0, replicas=(), free=4), replace(POLICY, replica_concurrency=8))
    assert (decision.action, decision.add) == ("scale_up", 1) and "falling" not in decision.reason


def test_polls_a_router_missed_are_no_signals_for_the_keep_alives_peak():
    """Review of the scaler, finding 4: a router silent for most of the keep-alive counted as no load there, so
    right after it answered again the replicas its requests had kept busy were released with the rest."""
    policy = replace(POLICY, keep_alive_s=60.0, scale_down_cooldown_s=60.0, replica_concurrency=8)
    replicas = tuple(Replica(f"r{i}", False) for i in range(1, 5))

    def history(silent_until: int) -> list[Signals]:
        # The second router carried 16 requests until t = 50; the first router never any.
        return [Signals(at=1000.0 + t, routers_total=2, routers_answered=1 if t < silent_until else 2,
                        in_flight=16 if t < 50 and t >= silent_until else 0,
                        instances=("A",) if t < silent_until else ("A", "B"),
                        idle_s={} if t < 50 else {"r1": t - 49.0, "r2": t - 49.0, "r3": 500.0, "r4": 500.0})
                for t in range(61)]

    pool = Pool(now=1060.0, replicas=replicas, free=0)
    assert decide(history(0), pool, policy).release == ("r3",)  # its 16 requests keep 3 (2 x 1.25)
    decision = decide(history(58), pool, policy)
    assert decision.action == "hold" and "not releasing on 2 s of signals, less than the 60 s" in decision.reason


class CountedReads(list):
    """A history that counts the polls read from it (each index, each one a slice or an iteration copies)."""

    reads = 0

    def __getitem__(self, index):
        got = super().__getitem__(index)
        self.reads += len(got) if isinstance(index, slice) else 1
        return got

    def __iter__(self):
        self.reads += len(self)
        return super().__iter__()


def test_a_release_reads_each_poll_of_the_keep_alive_a_bounded_number_of_times():
    """Review of the scaler, finding 4: the keep-alive's peak took each poll's arrival rate over a copy of the
    history up to it, quadratic in its length: 153 ms per deployment per tick at --tick 0.1 (6,001 polls)."""
    policy = replace(POLICY, keep_alive_s=600.0, scale_down_cooldown_s=0.0)
    for polls in (601, 6001):
        history = CountedReads(Signals(at=1000.0 + i * 600.0 / (polls - 1), routers_total=1, routers_answered=1,
                                       serving=4, ready=4, instances=("A",), idle_s={"r4": 700.0})
                               for i in range(polls))
        pool = Pool(now=history[-1].at, replicas=tuple(Replica(f"r{i}", False) for i in range(1, 5)), free=0)
        history.reads = 0
        assert decide(history, pool, policy).release == ("r4",)
        # Per poll: a few passes over the history and, for its rate, the polls of the SHORT_WINDOW_S before it.
        assert history.reads < polls * (10 + 2 * (polls - 1) * SHORT_WINDOW_S / 600.0), (polls, history.reads)


def test_a_policy_stored_before_its_bounds_or_a_throughput_near_0_make_no_decision_raise():
    """Review of the scaler, finding 2: values the control plane accepted then (replica_rps 1e-320, a cold start
    of 1e308 s) made a demand of inf replicas, and math.ceil raised: the daemon's loop died."""
    history = [Signals(at=100.0 + t, routers_total=1, routers_answered=1, queue_depth=5, arrived=10 * t)
               for t in range(6)]
    pool = Pool(now=105.0, replicas=(), free=4)
    for stored in (replace(POLICY, replica_rps=1e-320), replace(POLICY, cold_start_s=1e308),
                   replace(POLICY, replica_rps=1e-310, cold_start_s=1.0)):
        decision = decide(history, pool, stored)
        assert (decision.add, decision.desired) == (4, POLICY.max_replicas), stored


def test_a_release_keeps_ready_replicas_while_others_still_load():
    """Found in review: replicas still loading counted towards what is kept, so the ready ones were released and
    nothing served until the loading ones were done."""
    policy = ScalingPolicy(min_replicas=1, max_replicas=8, keep_alive_s=10, scale_up_cooldown_s=5,
                           scale_down_cooldown_s=20)
    history = [Signals(at=t, routers_total=1, routers_answered=1, arrived=100, answered=100, serving=2, ready=2,
                       idle_s={"w1": 40.0 + t - 1000, "w2": 40.0 + t - 1000}, instances=("r",))
               for t in range(1000, 1031)]
    pool = Pool(now=1030, replicas=(Replica("w1", False), Replica("w2", False),
                                    *(Replica(f"w{i}", True) for i in range(3, 7))), free=2, last_scale_up=970)
    decision = decide(history, pool, policy)
    assert decision.release == ("w1",), decision.reason
    longer = [replace(s, idle_s={"w1": s.idle_s["w1"], "w2": s.idle_s["w2"] + 50}) for s in history]
    store = (Replica("w1", False), Replica("w2", False, pinned=True))
    assert decide(longer, Pool(now=1030, replicas=store, free=2, last_scale_up=970), policy).release == ("w1",)
    assert decide(longer, Pool(now=1030, replicas=(Replica("w1", False), Replica("w2", False)), free=2,
                               last_scale_up=970), policy).release == ("w2",)  # the longest idle, were it no store

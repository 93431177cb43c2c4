"""Prometheus metrics of the scaling daemon, in a registry of its own."""

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from pipecast.scaler.policy import Decision


class ScalerMetrics:
    """Desired and actual replicas per deployment, their measured cold start, decisions by action and kind, the
    replicas they added and released, canaries the gate rolled back."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.desired = Gauge("pipecast_scaler_desired_replicas", "Replicas the policy wants, per deployment.",
                             ["package"], registry=self.registry)
        self.actual = Gauge("pipecast_scaler_replicas", "Replicas loaded or loading, per deployment.", ["package"],
                            registry=self.registry)
        self.decisions = Counter("pipecast_scaler_decisions", "Decisions by action (scale_up, release, hold) and "
                                 "kind (demand, slo, idle, steady, cooldown, no_signals, min_replicas, "
                                 "no_free_workers; refused: a hold where the control plane refused the scale-up "
                                 "or release decided).",
                                 ["package", "action", "kind"], registry=self.registry)
        self.changed = Counter("pipecast_scaler_replicas_changed", "Replicas the scale-ups placed (action "
                               "scale_up: fewer than decided where the control plane could not place them all) "
                               "and the releases released (release), per deployment.", ["package", "action"],
                               registry=self.registry)
        self.cold_start = Gauge("pipecast_scaler_cold_start_seconds", "Median seconds the deployment's last new "
                                "replicas took from the scale-up to holding the package (the daemon's measure).",
                                ["package"], registry=self.registry)
        self.gate_rollbacks = Counter("pipecast_scaler_canary_rollbacks", "Canaries the automatic gate rolled "
                                      "back, per served model name.", ["route"], registry=self.registry)
        self.tick_failures = Counter("pipecast_scaler_tick_failures", "Ticks that failed (the control plane "
                                     "unreachable or refusing the daemon): every pool held, nothing scaled.",
                                     registry=self.registry)
        self.last_tick = Gauge("pipecast_scaler_last_tick_timestamp_seconds", "When the last tick that reached the "
                               "control plane ended (Unix time): alert on time() minus it.", registry=self.registry)
        self._kinds: dict[str, set[tuple[str, str]]] = {}  # package -> the (action, kind) of its decisions

    def observe(self, package_id: str, decision: Decision, replicas: int, cold_start_s: float | None = None) -> None:
        self.desired.labels(package_id).set(decision.desired)
        self.actual.labels(package_id).set(replicas)
        if cold_start_s is not None:
            self.cold_start.labels(package_id).set(cold_start_s)
        self.decisions.labels(package_id, decision.action, decision.kind).inc()
        if decision.action != "hold":
            self.changed.labels(package_id, decision.action).inc(decision.add or len(decision.release))
        self._kinds.setdefault(package_id, set()).add((decision.action, decision.kind))

    def forget(self, package_id: str) -> None:
        """Drop every series of ``package_id`` (undeployed): its gauges would show its last figures for good."""
        for gauge in (self.desired, self.actual, self.cold_start):
            try:
                gauge.remove(package_id)
            except KeyError:  # never set (no cold start measured)
                pass
        kinds = self._kinds.pop(package_id, set())
        for action, kind in kinds:
            self.decisions.remove(package_id, action, kind)
        for action in {action for action, _ in kinds} - {"hold"}:
            self.changed.remove(package_id, action)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

"""``pipecast bench simulate``: multicast completion at any N, from the control plane's own plans in the
chunk-level simulator (:mod:`control_plane.planner.simulate`), beside the floor and a lower bound.

For each receiver count N and strategy, the plan :func:`control_plane.planner.schedules.make_plan` makes
from one store is simulated with uniform links, chunk cut-through and a per-hop latency; the figure is
when the last receiver holds the model. The floor is S/B (one copy over one link); the lower bound,
which no schedule can beat, adds the first chunk's time and one hop's latency. ``default`` marks the
strategy the control plane picks itself for N receivers from one store (``default_strategy``).
"""

from dataclasses import asdict, dataclass

from control_plane.placement import default_strategy
from control_plane.planner.schedules import make_plan
from control_plane.planner.simulate import simulate
from pipecast.core.units import format_bytes

STRATEGIES = ("chain", "binomial", "tree", "unicast")


@dataclass(frozen=True)
class SimulatedRun:
    """One (N, strategy) figure, the JSON ``results[]`` entry."""

    nodes: int
    strategy: str
    default: bool
    seconds: float
    floor_seconds: float
    ratio_to_floor: float
    lower_bound_seconds: float


def run(nodes: list[int], strategies: list[str], *, model_bytes: int, blocks: int, link_mbit: float,
        chunk_bytes: int, hop_latency_s: float, progress=lambda line: None) -> list[SimulatedRun]:
    """Simulate every (N, strategy); ``progress`` gets a line per figure."""
    rate = link_mbit * 1e6 / 8
    block_bytes = [model_bytes // blocks + (b < model_bytes % blocks) for b in range(blocks)]
    floor = model_bytes / rate
    bound = floor + min(chunk_bytes, max(block_bytes)) / rate + hop_latency_s
    out = []
    for n in nodes:
        receivers = [f"w{i}" for i in range(n)]
        for strategy in strategies:
            plan = make_plan(strategy, ["store"], receivers, blocks)
            seconds = max(simulate(plan, block_bytes, rate, chunk_bytes, hop_latency_s=hop_latency_s).values())
            figure = SimulatedRun(n, strategy, strategy == default_strategy(1, n), seconds, floor, seconds / floor,
                                  bound)
            progress(f"N={n} {strategy}: {seconds:.2f} s = {figure.ratio_to_floor:.2f} x S/B")
            out.append(figure)
    return out


def report(results: list[SimulatedRun], *, model_bytes: int, blocks: int, link_mbit: float, chunk_bytes: int,
           hop_latency_s: float) -> str:
    """The table: per N, each strategy's completion over S/B, the default marked, the bound beside."""
    lines = [f"simulated multicast of {format_bytes(model_bytes)} in {blocks} blocks, {format_bytes(chunk_bytes)} "
             f"chunks, {link_mbit:g} Mbit/s links, {hop_latency_s * 1e3:g} ms a hop, from one store",
             f"{'N':>6}  {'strategy':<9} {'seconds':>9} {'x S/B':>7}  lower bound", ]
    for r in results:
        mark = " (default)" if r.default else ""
        lines.append(f"{r.nodes:>6}  {r.strategy:<9} {r.seconds:>9.2f} {r.ratio_to_floor:>7.2f}  "
                     f"{r.lower_bound_seconds:.2f} s{mark}")
    return "\n".join(lines)


def to_json(results: list[SimulatedRun], **settings) -> dict:
    return {"settings": settings, "results": [asdict(r) for r in results]}

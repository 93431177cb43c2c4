"""The strategies a surge benchmark compares, and their registry.

A strategy says how a pool of N workers gets the model: how many workers already hold it when the
surge arrives (warm), whether those warm workers are multicast sources, who decides to bring it to cold
ones (the scaling daemon from the routers' signals, the load generator at the surge's first instant, an
oracle no deployment has, or nobody: a fixed pool), which control-plane plan brings it, and whether a
worker serves while its blocks arrive (execute-while-load) or only once it holds them all
(load-then-serve), and whether the router also routes to the cross-node pipelines the control plane forms
while no worker holds the whole model. The orchestration (:mod:`benchmarks.surge.run`) reads only
these fields, so adding a strategy is one :func:`register` call (or one entry in :data:`BUILTIN`).

A name may carry a warm count, ``NAME:W`` (e.g. ``warm-pool:4``): the strategy with W warm workers.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace

from control_plane.planner.plan import STRATEGIES as PLAN_STRATEGIES
from pipecast.core.errors import PipecastError

BASELINE = "unicast"
PIPECAST = "pipecast"
PIPECAST_PIPELINES = "pipecast-pipelines"
WARM_POOL = "warm-pool"
FIXED = "fixed"
ORACLE_SUFFIX = "-oracle"
#: Who scales the cold workers up: the daemon (``pipecast scaler``), the load generator at the surge's first
#: instant (an oracle), or nobody (a fixed pool of the warm workers).
SCALERS = ("daemon", "oracle", "none")


class StrategyError(PipecastError):
    """An unknown or malformed strategy name, or a strategy that does not fit the pool (the caller's)."""


@dataclass(frozen=True)
class Strategy:
    """How the pool is provisioned; see the module docstring."""

    name: str
    description: str
    #: The control plane's scale-up strategy for the cold workers; "" lets it choose (from one source a
    #: chain up to 64 receivers or further for a large package, else a binomial pipeline (`default_strategy`);
    #: rotated pipelines from several).
    plan_strategy: str
    #: Serve while blocks arrive (the worker's health goes ``partial``); else only once all are in.
    execute_while_load: bool
    #: Workers holding the model in memory before the surge; None: the benchmark's minimum pool.
    warm: int | None = None
    #: Warm workers register with the control plane, so its plans use them as sources; otherwise cold
    #: workers get the model from the store alone, and a scaling daemon neither sees nor counts the warm ones.
    warm_are_sources: bool = False
    #: One of SCALERS.
    scaled_by: str = "oracle"
    #: The router learns the control plane's cross-node pipelines and routes to them while no worker has
    #: room (``pipecast router --control-plane``); otherwise it knows the workers alone.
    pipelines: bool = False

    def __post_init__(self) -> None:
        if self.scaled_by not in SCALERS:
            raise StrategyError(f"strategy {self.name!r}: scaled_by {self.scaled_by!r} is not one of "
                                f"{', '.join(SCALERS)}")
        if self.plan_strategy and self.plan_strategy not in PLAN_STRATEGIES:
            raise StrategyError(f"strategy {self.name!r}: plan strategy {self.plan_strategy!r} is not one of "
                                f"{', '.join(PLAN_STRATEGIES)}")
        if self.warm is not None and self.warm < 0:
            raise StrategyError(f"strategy {self.name!r}: warm workers must be >= 0, got {self.warm}")

    def warm_count(self, min_workers: int) -> int:
        """Warm workers of this strategy in a benchmark whose minimum pool is ``min_workers``."""
        return min_workers if self.warm is None else max(self.warm, min_workers)

    def check_fits(self, workers: int, min_workers: int) -> None:
        """Raise :class:`StrategyError` when its warm workers outnumber the pool or leave no cold one."""
        warm = self.warm_count(min_workers)
        if warm > workers or (warm == workers and self.scaled_by != "none"):
            raise StrategyError(f"strategy {self.name!r}: {warm} warm worker(s) leave no cold worker in a pool of "
                                f"{workers}; the surge would scale nothing")


BUILTIN: dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    """Add ``strategy`` to the registry (a name may be registered once)."""
    if ":" in strategy.name or not strategy.name:
        raise StrategyError(f"strategy names are non-empty and hold no ':', got {strategy.name!r}")
    if strategy.name in BUILTIN:
        raise StrategyError(f"strategy {strategy.name!r} is registered already")
    BUILTIN[strategy.name] = strategy
    return strategy


register(Strategy(BASELINE, "the scaling daemon adds workers; each pulls the whole model from the store, then serves "
                            "(load-then-serve)",
                  plan_strategy="unicast", execute_while_load=False, scaled_by="daemon"))
register(Strategy(BASELINE + ORACLE_SUFFIX, "every cold worker is scaled up at the surge's first instant (an oracle) "
                                            "and pulls the whole model from the store, then serves",
                  plan_strategy="unicast", execute_while_load=False))
register(Strategy(WARM_POOL, "W workers hold the model in memory before the surge; the rest are scaled up at the "
                             "surge's first instant (an oracle) by unicast from the store (load-then-serve)",
                  plan_strategy="unicast", execute_while_load=False, warm=2))
register(Strategy(FIXED, "W workers hold the model in memory from the start; nothing scales", plan_strategy="unicast",
                  execute_while_load=False, warm=1, scaled_by="none"))
register(Strategy(PIPECAST, "the scaling daemon adds workers from the routers' signals; pipelined multicast from "
                            "every holder, planned by the control plane; workers serve while blocks arrive "
                            "(execute-while-load)",
                  plan_strategy="", execute_while_load=True, warm_are_sources=True, scaled_by="daemon"))
register(Strategy(PIPECAST + ORACLE_SUFFIX, "pipecast with every cold worker scaled up at the surge's first instant "
                                            "(an oracle no deployment has: a baseline, not the headline)",
                  plan_strategy="", execute_while_load=True, warm_are_sources=True))

# The same with the control plane told to plan a chain: every worker receives the blocks in order, one
# chunk behind its parent, so the first worker that can serve is also among the first to hold everything.
register(Strategy(PIPECAST_PIPELINES, "pipecast with W warm workers (default 1) as multicast sources beside the "
                                           "store (each a slot of a plan rotated by bytes), and the router routing "
                                           "to the pipelines across cold workers the control plane forms as blocks "
                                           "land, until they hold the whole model; scaled by the daemon",
                  plan_strategy="", execute_while_load=True, warm=1, warm_are_sources=True, scaled_by="daemon",
                  pipelines=True))
register(Strategy(PIPECAST_PIPELINES + ORACLE_SUFFIX, "pipecast-pipelines with every cold worker scaled up at the "
                                                     "surge's first instant (an oracle no deployment has: a "
                                                     "baseline, not the headline)",
                  plan_strategy="", execute_while_load=True, warm=1, warm_are_sources=True, pipelines=True))
register(Strategy(f"{PIPECAST}-chain", "pipecast with a chain plan (blocks in layer order at every worker, "
                                       "cut-through), execute-while-load, scaled by the daemon",
                  plan_strategy="chain", execute_while_load=True, warm_are_sources=True, scaled_by="daemon"))



def resolve(name: str) -> Strategy:
    """The registered strategy ``name``, or ``NAME:W`` for it with W warm workers."""
    base, sep, warm = name.strip().partition(":")
    strategy = BUILTIN.get(base)
    if strategy is None:
        raise StrategyError(f"unknown strategy {base!r}; known: {', '.join(BUILTIN)}")
    if not sep:
        return strategy
    if not warm.isdigit():
        raise StrategyError(f"strategy {name!r}: the warm count after ':' must be a whole number, got {warm!r}")
    return replace(strategy, name=f"{base}:{int(warm)}", warm=int(warm))


def parse_strategies(text: str) -> tuple[Strategy, ...]:
    """``"unicast,warm-pool:4,pipecast"`` to strategies, in that order; names must be distinct."""
    strategies = tuple(resolve(part) for part in text.split(",") if part.strip())
    names = [s.name for s in strategies]
    if not strategies or len(set(names)) != len(names):
        raise StrategyError(f"--strategy must list distinct strategies, got {text!r}")
    return strategies


def check_pool(strategies: Sequence[Strategy], workers: int, min_workers: int) -> None:
    """Every strategy fits a pool of ``workers`` with ``min_workers`` warm at least."""
    if not 0 <= min_workers < workers:
        raise StrategyError(f"the minimum pool must be within 0..{workers - 1} for {workers} workers, "
                            f"got {min_workers}")
    for strategy in strategies:
        strategy.check_fits(workers, min_workers)

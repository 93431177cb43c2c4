"""PNG charts for the benchmarks (matplotlib, Agg): one figure per call, no pyplot global state.

A chart is a list of :class:`Series` drawn as lines with markers; a series marked ``reference`` (a floor,
a baseline's theory) is drawn black, dashed (a second one dotted), without markers, so measured and bound
read apart at a glance.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REFERENCE_STYLES = ("--", ":", "-.")


@dataclass(frozen=True)
class Series:
    """One line of a chart: ``y[i]`` at ``x[i]``; ``reference`` lines are bounds, not measurements."""

    label: str
    x: Sequence[float]
    y: Sequence[float]
    reference: bool = False

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(f"series {self.label!r}: {len(self.x)} x values but {len(self.y)} y values")


def save_line_chart(path: Path, series: Sequence[Series], *, title: str, xlabel: str, ylabel: str,
                    x_ticks: Sequence[float] | None = None, log2_x: bool = False, note: str | None = None) -> Path:
    """Draw ``series`` into a PNG at ``path`` (parent folders created) and return the path.

    ``x_ticks`` puts a labelled tick at each of those values (e.g. the worker counts measured);
    ``log2_x`` spaces doubling x values evenly; ``note`` is a small line under the title (the run's
    conditions: link rate, mode, versions).
    """
    from matplotlib.figure import Figure  # heavy; only the benchmarks that plot pay for it

    if not series:
        raise ValueError("save_line_chart: nothing to draw (no series)")
    figure = Figure(figsize=(8, 5), dpi=110, layout="constrained")
    axes = figure.add_subplot()
    references = 0
    for s in series:
        if s.reference:  # dashed, then dotted: two bounds on one chart stay apart
            axes.plot(s.x, s.y, linestyle=REFERENCE_STYLES[references % len(REFERENCE_STYLES)], color="black",
                      linewidth=1.2, label=s.label)
            references += 1
        else:
            axes.plot(s.x, s.y, marker="o", linewidth=1.8, label=s.label)
    if log2_x:
        axes.set_xscale("log", base=2)
    if x_ticks is not None:
        axes.set_xticks(list(x_ticks), [f"{t:g}" for t in x_ticks])
        axes.minorticks_off()
    top = max((v for s in series for v in s.y if math.isfinite(v)), default=1.0)
    axes.set_ylim(0, top * 1.08)
    figure.suptitle(title)
    if note:
        axes.set_title(note, fontsize=8, color="dimgray")
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(True, alpha=0.3)
    axes.legend()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    return path

"""The surge benchmark's PNGs (matplotlib, Agg; one figure per call, no pyplot global state).

- :func:`save_ttft_cdf`: the distribution of TTFT per strategy (every answered request of every
  repeat), with the floor S/B marked: no cold worker can answer sooner.
- :func:`save_timeline`: per strategy (its first repeat), each worker's share of the model held against
  time, a dot where it turned ready, and the requests arriving per second underneath.
"""

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

from benchmarks.surge.report import StrategySummary, WorkerTimeline

NOTE_WIDTH = 170  # characters per line of the conditions printed under a chart
# Arrival histogram bins: about this many over the run, none shorter than the minimum.
ARRIVAL_BINS = 60
MIN_ARRIVAL_BIN_S = 0.1


def _figure(height: float = 5.0):
    from matplotlib.figure import Figure  # heavy; only the benchmarks that plot pay for it

    return Figure(figsize=(9, height), dpi=110, layout="constrained")


def _save(figure, path: Path, note: str | None) -> Path:
    if note:  # a figure-level x label: the constrained layout leaves room for it, unlike free text
        figure.supxlabel(textwrap.fill(note, NOTE_WIDTH), x=0.01, ha="left", fontsize=7, color="dimgray")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    return path


def save_ttft_cdf(path: Path, summaries: Sequence[StrategySummary], *, floor_s: float | None = None,
                  note: str | None = None) -> Path:
    """Draw the TTFT CDF of each strategy into a PNG at ``path`` (log time axis) and return the path."""
    if not summaries:
        raise ValueError("save_ttft_cdf: no strategies to draw")
    figure = _figure()
    axes = figure.add_subplot()
    for s in summaries:
        ttfts = sorted(r.ttft_s for run in s.runs for r in run.requests if r.status == "ok")
        if ttfts:
            axes.step(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], where="post", linewidth=1.8,
                      label=f"{s.strategy} ({len(ttfts)} answered)")
    if floor_s is not None:
        axes.axvline(floor_s, linestyle="--", color="black", linewidth=1.1, label=f"floor S/B = {floor_s:.1f} s")
    if axes.has_data():
        axes.set_xscale("log")
    axes.set_ylim(0, 1.02)
    axes.set_title("time to first token during the surge")
    axes.set_xlabel("TTFT, seconds (log scale)")
    axes.set_ylabel("fraction of answered requests")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower right")
    return _save(figure, path, note)


def held_steps(worker: WorkerTimeline, end: float) -> tuple[list[float], list[float]]:
    """A cold worker's share of the model held over time: growing with each block of each time it held a
    replica, back to 0 when it dropped the package."""
    intervals = worker.billed or ((0.0, None),)
    xs, ys = [0.0], [0.0]
    for start, stop in intervals:
        times = sorted(t for t in worker.block_times if t >= start and (stop is None or t <= stop))
        for i, t in enumerate(times):
            xs.append(t)
            ys.append(min((i + 1) / worker.blocks_total, 1.0))
        if stop is not None:
            xs.append(stop)
            ys.append(0.0)
    xs.append(end)
    ys.append(ys[-1])
    return xs, ys


def save_timeline(path: Path, summaries: Sequence[StrategySummary], *, note: str | None = None) -> Path:
    """Draw each strategy's first repeat: workers' load progress and request arrivals; return the path."""
    if not summaries:
        raise ValueError("save_timeline: no strategies to draw")
    figure = _figure(height=2.6 * len(summaries) + 0.6)
    end = max((run.end_s for s in summaries for run in s.runs[:1]), default=1.0)
    shared = None
    for row, s in enumerate(summaries):
        axes = figure.add_subplot(len(summaries), 1, row + 1, sharex=shared)
        shared = shared or axes
        run = s.runs[0]
        for worker in run.workers:
            if not worker.warm and worker.provisioned_s is None:  # never scaled up
                continue
            if worker.warm:
                xs, ys = [worker.provisioned_s, end], [1.0, 1.0]
            else:
                xs, ys = held_steps(worker, end)
            label = worker.name + (" (warm)" if worker.warm else "")
            (line,) = axes.step(xs, ys, where="post", linewidth=1.3, label=label)
            if worker.ready_s is not None and worker.ready_s >= 0:
                axes.plot([worker.ready_s], [1.0], marker="o", color=line.get_color(), markersize=5)
        axes.set_xlim(0, end)
        axes.set_ylim(0, 1.08)
        axes.set_ylabel("model held")
        axes.set_title(f"{s.strategy} (repeat {run.repeat}): load progress, dot = ready", fontsize=10)
        axes.grid(True, alpha=0.3)
        arrivals = axes.twinx()
        width = max(end / ARRIVAL_BINS, MIN_ARRIVAL_BIN_S)
        bins = max(1, math.ceil(end / width))
        arrivals.hist([r.arrival_s for r in run.requests], bins=bins, range=(0, bins * width), color="gray",
                      alpha=0.25, weights=[1 / width] * len(run.requests))
        arrivals.set_ylabel("requests / s", color="dimgray", fontsize=8)
        axes.set_zorder(arrivals.get_zorder() + 1)  # progress lines over the arrival bars
        axes.patch.set_visible(False)
        if len(run.workers) <= 10:
            axes.legend(loc="lower right", fontsize=7, ncol=2)
    axes.set_xlabel("seconds since the surge began")
    return _save(figure, path, note)

"""Request traces and the replay schedule of a surge (pure: no sockets, no clocks).

A trace is a CSV file with the columns of the Azure LLM inference trace 2023 (``TIMESTAMP``,
``ContextTokens``, ``GeneratedTokens``; Splitwise, ISCA 2024): one request per row, its arrival time and
its prompt and output lengths in tokens. ``TIMESTAMP`` is a date-time (``2023-11-16 18:15:46.6805900``,
any number of fractional digits, optional UTC offset; without one it is read as UTC) or a number of
seconds. Rows need not be sorted; other columns are ignored.

A replay takes a window of the trace (a start offset, then a duration and/or a request count), stretches
or compresses its time by ``time_scale`` (replay seconds per trace second: 0.5 replays twice as fast)
and caps every prompt and output length (this machine's CPU is no GPU). The surge begins with the
window's first request, at replay time 0. A synthetic ``step`` (a constant rate from 0) or ``burst``
(many requests at once) is the alternative to a trace; its requests use the caps as their lengths.
"""

import csv
import math
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

from pipecast.core.errors import PipecastError

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
SYNTHETIC_KINDS = ("step", "burst")
# The window over which the peak request rate of a schedule is measured.
PEAK_WINDOW_S = 10.0

_DATETIME = re.compile(r"^(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:\.(\d+))?\s*(Z|[+-]\d{2}:?\d{2})?$")


class TraceError(PipecastError):
    """A trace file, window or synthetic load that cannot be replayed (the caller's input)."""


@dataclass(frozen=True)
class TraceRecord:
    """One request of a trace: its arrival in seconds after the trace's first request, and its lengths."""

    offset_s: float
    context_tokens: int
    generated_tokens: int


@dataclass(frozen=True)
class Trace:
    """A trace's requests in arrival order; ``source`` names where it came from."""

    source: str
    records: tuple[TraceRecord, ...]

    @property
    def duration_s(self) -> float:
        """Seconds from the first request to the last."""
        return self.records[-1].offset_s if self.records else 0.0


@dataclass(frozen=True)
class Window:
    """Which part of a trace is replayed: from ``start_s`` (seconds after its first request), for
    ``duration_s`` seconds and/or ``requests`` requests, whichever ends first (neither: to the end)."""

    start_s: float = 0.0
    duration_s: float | None = None
    requests: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.start_s) or self.start_s < 0:
            raise TraceError(f"the window's start must be >= 0 s, got {self.start_s}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise TraceError(f"the window's duration must be > 0 s, got {self.duration_s}")
        if self.requests is not None and self.requests < 1:
            raise TraceError(f"the window's request count must be >= 1, got {self.requests}")

    def describe(self) -> str:
        limits = [f"{self.duration_s:g} s" if self.duration_s is not None else "",
                  f"{self.requests} requests" if self.requests is not None else ""]
        return f"from {self.start_s:g} s, " + (" or ".join(x for x in limits if x) or "to the end")


@dataclass(frozen=True)
class TokenCaps:
    """Largest prompt and output lengths sent, in tokens (longer trace requests are cut to these)."""

    prompt_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise TraceError(f"token caps must be >= 1, got prompt {self.prompt_tokens}, output {self.output_tokens}")


@dataclass(frozen=True)
class ScheduledRequest:
    """One request of a replay: sent ``at_s`` seconds after the surge begins."""

    index: int
    at_s: float
    prompt_tokens: int
    max_tokens: int
    trace_prompt_tokens: int  # before the caps
    trace_output_tokens: int


@dataclass(frozen=True)
class SyntheticLoad:
    """A synthetic surge: ``step`` sends ``rate_per_s`` requests per second for ``duration_s``; ``burst``
    sends ``requests`` requests spread evenly over ``spread_s`` (0: all at once)."""

    kind: str
    rate_per_s: float = 0.0
    duration_s: float = 0.0
    requests: int = 0
    spread_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in SYNTHETIC_KINDS:
            raise TraceError(f"synthetic load kind must be one of {', '.join(SYNTHETIC_KINDS)}, got {self.kind!r}")
        if self.kind == "step" and not (self.rate_per_s > 0 and self.duration_s > 0):
            raise TraceError(f"a step needs rate > 0 and duration > 0, got rate {self.rate_per_s}, "
                             f"duration {self.duration_s}")
        if self.kind == "burst" and (self.requests < 1 or self.spread_s < 0):
            raise TraceError(f"a burst needs requests >= 1 and spread >= 0, got requests {self.requests}, "
                             f"spread {self.spread_s}")

    def describe(self) -> str:
        if self.kind == "step":
            return f"synthetic step: {self.rate_per_s:g} requests/s for {self.duration_s:g} s"
        return f"synthetic burst: {self.requests} requests within {self.spread_s:g} s"


@dataclass(frozen=True)
class ScheduleFacts:
    """What a schedule asks of the pool, for the report."""

    requests: int
    duration_s: float
    mean_rate_per_s: float
    peak_rate_per_s: float  # the most requests in any PEAK_WINDOW_S, per second
    prompt_tokens: int
    max_output_tokens: int


# -- reading -------------------------------------------------------------------------------------------


def parse_timestamp(text: str, where: str) -> float:
    """Seconds since the epoch of a trace timestamp: a date-time (see the module docstring) or a number."""
    text = text.strip()
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(value):
            raise TraceError(f"{where}: TIMESTAMP {text!r} is not a finite number")
        return value
    match = _DATETIME.match(text)
    if match is None:
        raise TraceError(f"{where}: TIMESTAMP {text!r} is neither a date-time (YYYY-MM-DD HH:MM:SS[.fff]) "
                         "nor a number of seconds")
    day, clock, fraction, zone = match.groups()
    try:
        whole = datetime.fromisoformat(f"{day}T{clock}")
    except ValueError as exc:
        raise TraceError(f"{where}: TIMESTAMP {text!r}: {exc}") from None
    offset = timezone.utc
    if zone and zone != "Z":
        sign = -1 if zone[0] == "-" else 1
        digits = zone[1:].replace(":", "")
        offset = timezone(sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:])))
    # Fractions are added as a float: datetime keeps only microseconds, traces may carry more digits.
    return whole.replace(tzinfo=offset).timestamp() + (float(f"0.{fraction}") if fraction else 0.0)


def _count(text: str, column: str, where: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise TraceError(f"{where}: {column} {text!r} is not a whole number of tokens") from None
    if value < 0:
        raise TraceError(f"{where}: {column} {value} is negative")
    return value


def parse_trace(lines: Iterable[str], source: str) -> Trace:
    """A trace from CSV text lines (header first); :class:`TraceError` names the line of any bad value."""
    reader = csv.DictReader(lines)
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or ())]
    if missing:
        raise TraceError(f"{source}: not a trace: no column(s) {', '.join(missing)} (expected {', '.join(COLUMNS)}; "
                         f"found {', '.join(reader.fieldnames or ()) or 'nothing'})")
    rows = []
    for row in reader:
        where = f"{source}, line {reader.line_num}"
        if any(row[c] is None for c in COLUMNS):
            raise TraceError(f"{where}: the row has fewer fields than the header")
        rows.append((parse_timestamp(row["TIMESTAMP"], where), _count(row["ContextTokens"], "ContextTokens", where),
                     _count(row["GeneratedTokens"], "GeneratedTokens", where)))
    if not rows:
        raise TraceError(f"{source}: the trace holds no requests")
    rows.sort(key=lambda r: r[0])  # stable: rows of one instant keep the file's order
    first = rows[0][0]
    return Trace(source, tuple(TraceRecord(t - first, c, g) for t, c, g in rows))


def read_trace(path: Path) -> Trace:
    """The trace in the CSV file at ``path``."""
    try:
        with Path(path).open(newline="") as f:
            return parse_trace(f, str(path))
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not a text CSV file ({exc.reason})") from None


# -- schedules -----------------------------------------------------------------------------------------


def replay_schedule(trace: Trace, window: Window, time_scale: float, caps: TokenCaps) -> tuple[ScheduledRequest, ...]:
    """The requests of ``window``, timed from the window's first request and scaled by ``time_scale``."""
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise TraceError(f"the time scale must be > 0, got {time_scale}")
    end = window.start_s + window.duration_s if window.duration_s is not None else math.inf
    chosen = [r for r in trace.records if window.start_s <= r.offset_s < end][:window.requests]
    if not chosen:
        raise TraceError(f"{trace.source}: no request in the window {window.describe()} "
                         f"(the trace spans {trace.duration_s:.1f} s)")
    first = chosen[0].offset_s
    return tuple(ScheduledRequest(index=i, at_s=(r.offset_s - first) * time_scale,
                                  prompt_tokens=max(1, min(r.context_tokens, caps.prompt_tokens)),
                                  max_tokens=max(1, min(r.generated_tokens, caps.output_tokens)),
                                  trace_prompt_tokens=r.context_tokens, trace_output_tokens=r.generated_tokens)
                 for i, r in enumerate(chosen))


def synthetic_schedule(load: SyntheticLoad, caps: TokenCaps) -> tuple[ScheduledRequest, ...]:
    """The requests of a synthetic step or burst, each of the capped lengths."""
    if load.kind == "step":
        count = max(1, math.floor(load.rate_per_s * load.duration_s))
        times = [i / load.rate_per_s for i in range(count)]
    else:
        step = load.spread_s / (load.requests - 1) if load.requests > 1 else 0.0
        times = [i * step for i in range(load.requests)]
    return tuple(ScheduledRequest(index=i, at_s=t, prompt_tokens=caps.prompt_tokens, max_tokens=caps.output_tokens,
                                  trace_prompt_tokens=caps.prompt_tokens, trace_output_tokens=caps.output_tokens)
                 for i, t in enumerate(times))


def repeat_surges(schedule: Sequence[ScheduledRequest], surges: int, quiet_s: float) -> tuple[ScheduledRequest, ...]:
    """``schedule`` played ``surges`` times, each after ``quiet_s`` seconds without a request: the long run
    in which a pool must scale down in the quiet and cold-start again for the next surge."""
    if surges < 1 or not (math.isfinite(quiet_s) and quiet_s >= 0):
        raise TraceError(f"surges must be >= 1 and the quiet period >= 0 s, got {surges} and {quiet_s}")
    if not schedule:
        return ()
    period = schedule[-1].at_s - schedule[0].at_s + quiet_s
    out = []
    for k in range(surges):
        for r in schedule:
            out.append(replace(r, index=len(out), at_s=r.at_s + k * period))
    return tuple(out)


def parse_synthetic(text: str) -> SyntheticLoad:
    """``step:rate=4,duration=30`` or ``burst:requests=100,spread=2`` to a :class:`SyntheticLoad`."""
    kind, _, params = text.partition(":")
    fields = {"rate": "rate_per_s", "duration": "duration_s", "requests": "requests", "spread": "spread_s"}
    values: dict[str, float | int] = {}
    for item in filter(None, (p.strip() for p in params.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise TraceError(f"synthetic load {text!r}: expected KIND:key=value,... with keys "
                             f"{', '.join(fields)}, got {item!r}")
        try:
            values[fields[key]] = int(value) if key == "requests" else float(value)
        except ValueError:
            raise TraceError(f"synthetic load {text!r}: {key}={value!r} is not a number") from None
    return SyntheticLoad(kind=kind.strip(), **values)


def schedule_facts(schedule: Sequence[ScheduledRequest]) -> ScheduleFacts:
    """Size, duration, mean and peak rate and token counts of a schedule."""
    times = [r.at_s for r in schedule]
    duration = times[-1] - times[0] if times else 0.0
    peak, lo = 0, 0
    for hi, t in enumerate(times):  # times are sorted: a sliding window
        while t - times[lo] >= PEAK_WINDOW_S:
            lo += 1
        peak = max(peak, hi - lo + 1)
    return ScheduleFacts(requests=len(schedule), duration_s=duration,
                         # n requests span n - 1 gaps
                         mean_rate_per_s=(len(schedule) - 1) / duration if duration > 0 else 0.0,
                         peak_rate_per_s=peak / PEAK_WINDOW_S,
                         prompt_tokens=sum(r.prompt_tokens for r in schedule),
                         max_output_tokens=sum(r.max_tokens for r in schedule))


def prompt_token_ids(request: ScheduledRequest, vocab_size: int, seed: int = 0) -> list[int]:
    """The prompt of ``request``: ``prompt_tokens`` ids drawn from the vocabulary, the same for every
    strategy and repeat (seeded by ``seed`` and the request's index), so all strategies do equal work."""
    if vocab_size < 1:
        raise TraceError(f"vocabulary size must be >= 1, got {vocab_size}")
    rng = random.Random(seed * 1_000_003 + request.index)
    return [rng.randrange(vocab_size) for _ in range(request.prompt_tokens)]

"""The router's scaling signals: the bookkeeping behind ``GET /stats``, for autoscalers that poll it.

Pure logic, no sockets; both clocks are injected (``clock``: monotonic, for durations; ``wall_clock``: Unix
time, for the answer's timestamps). Counters are cumulative since the router started, so a poller takes
rates by differencing two answers of the same router process (``instance``, a random id of each process: a
poller that reaches several routers at one address, or one restarted, tells their answers apart by it) and
adds several routers' answers up; the rest (queue depth, requests in flight, each worker's idle time) is the
state now. TTFT here is the router's: from a request's arrival at
the router to the first whole event relayed to the client (streaming; none when the worker's error event
comes first: a stream it failed counts as failed) or to the whole answer (a non-streaming 200), over a
sliding window of the last 60 s. The same counters (plus completion tokens) and TTFT window are kept per
version of a served model (``versions``, by package id), which is what the canary gate
(:mod:`pipecast.scaler.gate`) compares.
"""

import math
import time
import uuid
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pipecast.core.strictjson import JSONInputError, loads
from pipecast.router.pool import Worker

#: Version of the ``/stats`` answer; a change of its meaning bumps it.
STATS_FORMAT = 1
TTFT_WINDOW_S = 60.0
#: TTFT samples kept at most (the latest): the window spans fewer than 60 s only beyond ~1,000 answers/s.
MAX_TTFT_SAMPLES = 65536
#: A TTFT window of more samples than this is summarized (sorted) at most every SUMMARY_EVERY_S seconds; a smaller
#: one at every call. A summary then lags its window by up to that much, in a window of a minute.
SUMMARY_SORT_MAX = 4096
SUMMARY_EVERY_S = 1.0
#: Tenants counted by name; later ones are counted together under OTHER_TENANTS, since tenants named in a
#: header are whatever clients send and the answer (and /metrics) must stay bounded.
MAX_TENANTS = 1000
OTHER_TENANTS = "(other)"
#: Text prompts are not tokenized at the router: about 4 characters a token, as for English text.
CHARS_PER_TOKEN = 4
#: Versions counted at most (they come from the control plane's routes; this bounds the answer regardless).
MAX_VERSIONS = 256
#: Seconds a version neither routed nor served, and counted for no request, keeps its counters (then forgotten,
#: :meth:`Signals.forget_versions`): longer than the scaling daemon's longest window (its 600 s history), so its
#: counts drop to 0 only after every poll the daemon still holds saw them unchanged (a fall reads as a restart).
VERSION_IDLE_S = 900.0


def _single_prompt_tokens(prompt: object) -> int | None:
    """Tokens of one prompt (text, or a list of token ids), None when ``prompt`` is neither."""
    if isinstance(prompt, str):
        return len(prompt) // CHARS_PER_TOKEN
    # Judged by the first item only: this runs on the event loop, and a prompt may hold a million ids.
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)
    return None


def prompt_tokens(prompt: object) -> int:
    """The prompt tokens of a completion request's ``prompt`` field.

    A list of token ids counts its length, a text ``len(text) // 4`` (an estimate), and a batch (a list
    of either) the sum of its prompts; anything else counts 0.
    """
    tokens = _single_prompt_tokens(prompt)
    if tokens is not None:
        return tokens
    if isinstance(prompt, list):
        return sum(_single_prompt_tokens(item) or 0 for item in prompt)
    return 0


def request_prompt_tokens(payload: dict) -> int:
    """The prompt tokens of a completion (``prompt``) or chat (``messages``: their text contents) request,
    as :func:`prompt_tokens` counts them."""
    messages = payload.get("messages")
    if isinstance(messages, list):
        return sum(len(m["content"]) // CHARS_PER_TOKEN for m in messages
                   if isinstance(m, dict) and isinstance(m.get("content"), str))
    return prompt_tokens(payload.get("prompt"))


def percentile(ordered: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of non-empty sorted values, interpolated linearly between the two
    nearest ranks (numpy's default method)."""
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class TtftWindow:
    """TTFT samples of the last ``window_s`` seconds (at most ``max_samples``, the latest) and their percentiles."""

    def __init__(self, window_s: float = TTFT_WINDOW_S, max_samples: int = MAX_TTFT_SAMPLES) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._summarized: tuple[float, dict] | None = None  # (when, what): a large window's last summary

    def add(self, at: float, ttft_s: float) -> None:
        """Record a TTFT of ``ttft_s`` observed at clock time ``at`` (times never decrease)."""
        self._samples.append((at, ttft_s))

    def summary(self, now: float) -> dict:
        """The window at clock time ``now``: its length, sample count and p50/p95/p99 (None when empty). A window
        of more than :data:`SUMMARY_SORT_MAX` samples is summarized at most every :data:`SUMMARY_EVERY_S`: sorting
        65,536 of them took ~10 ms of the event loop, for every /stats poll and /metrics scrape of every version."""
        if (len(self._samples) > SUMMARY_SORT_MAX and self._summarized is not None
                and 0 <= now - self._summarized[0] < SUMMARY_EVERY_S):
            return self._summarized[1]
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        ordered = sorted(ttft for _, ttft in self._samples)
        quantiles = {f"p{q}": percentile(ordered, q) if ordered else None for q in (50, 95, 99)}
        summary = {"window_s": self.window_s, "count": len(ordered), **quantiles}
        self._summarized = (now, summary)
        return summary


@dataclass
class RequestCounters:
    """Cumulative counts of completion requests since the router started (``/stats`` ``counters``)."""

    #: Requests from an identified tenant: those its limit refused (before their body is read) and the admitted
    #: ones with a valid JSON body.
    arrived: int = 0
    #: Prompt tokens of the arrived requests (see :func:`prompt_tokens`; 0 for a refused one).
    prompt_tokens: int = 0
    #: Of the arrived requests, those their tenant's limit admitted: the demand a scaler sizes the pool for
    #: (a tenant over its limit is refused at once, whatever the pool's size).
    admitted: int = 0
    #: Answers completed with status 200.
    answered: int = 0
    #: The router's own 429s (its queue full, or a tenant over its limit).
    rejected: int = 0
    #: 5xx answers (the router's and workers') and streams ended by a worker failure.
    failed: int = 0


@dataclass
class TenantCounters:
    """Cumulative counts of one tenant's requests: arrived, then admitted or rejected by its limit."""

    arrived: int = 0
    admitted: int = 0
    rejected: int = 0


def answer_tokens(answer: bytes) -> int:
    """Completion tokens of a non-streaming answer (its ``usage``; 0 when it has none)."""
    try:
        tokens = loads(answer)["usage"]["completion_tokens"]
    except (JSONInputError, KeyError, TypeError):  # a worker's answer nested however deep counts 0, never raises
        return 0
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else 0


def stream_tokens(events: bytes) -> int:
    """Tokens in whole server-sent events of a streamed answer: a chunk's ``token_ids`` where it has them, else
    one per chunk with choices (a chunk carries one decoded piece: a token, or the few a character spans) but the
    last one, which says the finish reason with no text (a pipecast worker's carries no token)."""
    count = 0
    for event in events.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            continue  # [DONE], comments, the empty tail
        try:
            count += _chunk_tokens(loads(event[6:]).get("choices"))
        except (JSONInputError, AttributeError):
            continue
    return count


def _chunk_tokens(choices: Any) -> int:
    """Tokens of one streamed chunk's ``choices`` (see :func:`stream_tokens`)."""
    if not choices:
        return 0
    choice = choices[0] if isinstance(choices, list) else None
    if not isinstance(choice, dict):
        return 1
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return len(ids)
    delta = choice.get("delta")
    text = choice.get("text") or (delta.get("content") if isinstance(delta, dict) else None)
    return 0 if choice.get("finish_reason") is not None and not text else 1


@dataclass
class VersionCounters:
    """Cumulative counts of one version's requests (``/stats`` ``versions``): arrived, admitted (by their
    tenant's limit), answered with 200, failed (5xx or a broken stream) and the completion tokens answered. A
    request its tenant's limit refused counts for no version (its body, which names the model, is not read)."""

    arrived: int = 0
    admitted: int = 0
    answered: int = 0
    failed: int = 0
    completion_tokens: int = 0


class Signals:
    """The counters and the TTFT window of one router; :meth:`snapshot` is the ``/stats`` answer.

    The methods taking ``version`` also count the request for that version of a served model (a package
    id; None: the request named no route)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, window_s: float = TTFT_WINDOW_S,
                 max_samples: int = MAX_TTFT_SAMPLES) -> None:
        self.clock = clock
        self.wall_clock = wall_clock
        self.started_unix = wall_clock()
        #: This process's counters (``/stats`` ``instance``): random, unlike ``started_unix``, which two
        #: routers started in the same second share.
        self.instance = uuid.uuid4().hex
        self.counters = RequestCounters()
        self.tenants: dict[str, TenantCounters] = {}
        self.ttft = TtftWindow(window_s, max_samples)
        self._window = (window_s, max_samples)
        self.versions: dict[str, tuple[VersionCounters, TtftWindow]] = {}
        self._version_seen: dict[str, float] = {}  # package id -> clock time it was last counted, routed or served

    def _version(self, version: str | None) -> tuple[VersionCounters, TtftWindow] | None:
        if version is None or (version not in self.versions and len(self.versions) >= MAX_VERSIONS):
            return None
        self._version_seen[version] = self.clock()
        return self.versions.setdefault(version, (VersionCounters(), TtftWindow(*self._window)))

    def forget_versions(self, current: Collection[str]) -> list[str]:
        """Drop the counters of the versions that were not in ``current`` (the packages routed or served now)
        nor counted for :data:`VERSION_IDLE_S`, but the one seen last; return the package ids dropped. Without
        it, every package a long-lived router ever routed would be counted (and exported) for good, and new
        ones not at all beyond :data:`MAX_VERSIONS`. A version seen again counts from 0."""
        now = self.clock()
        for package in current:
            if package in self.versions:
                self._version_seen[package] = now
        # Never every version: a scaler reads a router's totals while it counts none, and a version's count
        # turning into the totals would read as that many arrivals at once.
        last = max(self._version_seen, key=self._version_seen.__getitem__, default=None)
        gone = [p for p, seen in self._version_seen.items() if now - seen > VERSION_IDLE_S and p != last]
        for package in gone:
            del self.versions[package], self._version_seen[package]
        return gone

    def arrived(self, tenant: str, tokens: int, version: str | None = None) -> str:
        """Count a request of ``tenant`` with ``tokens`` prompt tokens; return the name it is counted
        under (``tenant``, or :data:`OTHER_TENANTS` beyond :data:`MAX_TENANTS` names)."""
        name = tenant if tenant in self.tenants or len(self.tenants) < MAX_TENANTS else OTHER_TENANTS
        counts = self.tenants.setdefault(name, TenantCounters())
        counts.arrived += 1
        self.counters.arrived += 1
        self.counters.prompt_tokens += tokens
        if of := self._version(version):
            of[0].arrived += 1
        return name

    def admission(self, name: str, admitted: bool, version: str | None = None) -> None:
        """Count the admission decision for a request counted under tenant ``name`` (an admitted one also in
        the totals' and its version's ``admitted``)."""
        counts = self.tenants[name]
        if admitted:
            counts.admitted += 1
            self.counters.admitted += 1
            if of := self._version(version):
                of[0].admitted += 1
        else:
            counts.rejected += 1

    def answer_started(self, arrival: float, version: str | None = None, *, warm: bool = True) -> float:
        """The first event of an answer (or a whole non-streaming one) left for the client now; record and
        return the TTFT of the request that arrived at clock time ``arrival``. ``warm``: the worker that
        answered was ready when the request arrived; a request that waited for a cold start counts in the
        router's window only, not its version's (the canary gate compares versions' serving, not a new
        version's first load)."""
        now = self.clock()
        self.ttft.add(now, now - arrival)
        if warm and (of := self._version(version)):
            of[1].add(now, now - arrival)
        return now - arrival

    def answered(self, version: str | None = None, tokens: int = 0) -> None:
        """Count an answer completed with status 200, of ``tokens`` completion tokens."""
        self.counters.answered += 1
        if of := self._version(version):
            of[0].answered += 1
            of[0].completion_tokens += tokens

    def rejected(self) -> None:
        """Count a 429 of the router's own."""
        self.counters.rejected += 1

    def failed(self, version: str | None = None) -> None:
        """Count a 5xx answer or a stream ended by a worker's failure (its error event included)."""
        self.counters.failed += 1
        if of := self._version(version):
            of[0].failed += 1

    def snapshot(self, queue_depth: int, in_flight: int, workers: Iterable[Worker],
                 queued: Mapping[str, int] | None = None,
                 versions_now: Mapping[str, tuple[int, int]] | None = None,
                 ready_since: Mapping[str, float] | None = None) -> dict:
        """The ``GET /stats`` answer (format :data:`STATS_FORMAT`; the README's Router section lists it);
        ``queued``: tenant -> requests waiting in the router now, each tenant's ``queued`` (a tenant counted
        under :data:`OTHER_TENANTS` adds to that one's); ``versions_now``: package id -> (requests waiting
        for a worker of it, requests at its workers) now; ``ready_since``: package id -> clock time since which
        it has had a ``ready`` worker (packages without one now left out)."""
        now = self.clock()
        waiting = dict.fromkeys(self.tenants, 0)
        for tenant, count in (queued or {}).items():
            name = tenant if tenant in self.tenants else OTHER_TENANTS
            waiting[name] = waiting.get(name, 0) + count
        return {
            "format": STATS_FORMAT, "instance": self.instance, "now_unix": self.wall_clock(),
            "started_unix": self.started_unix,
            "queue_depth": queue_depth, "in_flight": in_flight,
            "workers": [{"url": worker.url, "node_id": worker.node_id, "status": worker.status,
                         "in_flight": worker.in_flight,
                         "queue_depth": worker.health.queue_depth if worker.health else 0,
                         "idle_s": worker.idle_s(now)} for worker in workers],
            "counters": asdict(self.counters),
            "ttft": self.ttft.summary(now),
            "tenants": {name: {**asdict(counts), "queued": waiting[name]}
                        for name, counts in sorted(self.tenants.items())},
            "versions": self.snapshot_versions(versions_now, ready_since),
        }

    def snapshot_versions(self, versions_now: Mapping[str, tuple[int, int]] | None = None,
                          ready_since: Mapping[str, float] | None = None) -> dict:
        """The ``/stats`` answer's ``versions``: per package id, its ``queue_depth`` and ``in_flight`` now
        (``versions_now``; 0 when not given), ``ready_s`` (seconds since ``ready_since``; None without a ready
        worker), ``counters`` and ``ttft`` window."""
        now = self.clock()
        since = ready_since or {}
        return {package: {"queue_depth": (versions_now or {}).get(package, (0, 0))[0],
                          "in_flight": (versions_now or {}).get(package, (0, 0))[1],
                          "ready_s": now - since[package] if package in since else None,
                          "counters": asdict(counts), "ttft": window.summary(now)}
                for package, (counts, window) in sorted(self.versions.items())}

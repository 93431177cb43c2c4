"""Per-tenant admission at the router: whose a request is, and whether its tenant may send it now.

Pure logic, no sockets; the clock is injected. A request's tenant is its API key's when the router has
API keys (``router_api_keys``; a missing or unknown key is refused), else the value of a request header
(``router_tenant_header``, ``default`` when absent). That header is trusted as sent: set it at a gateway in
front of the router, since a client could name any tenant there, a new one per request to dodge the
default limit.

Each limited tenant has a token bucket of ``burst`` tokens refilled at ``rate`` per second; a request
takes one, and a request that finds none is refused with the time until one is back. Admission comes
before the router's queue, so a tenant over its limit never holds a queue slot another tenant could use.

Buckets are bounded (:data:`MAX_BUCKETS`): tenant names in a header are whatever clients send. A tenant named
in the configured limits keeps its bucket for good (their number is the configuration's). A tenant held to the
default limit loses its bucket only once it is full again (a fresh one would be the same), so no tenant ever
gets tokens back by others' names crowding it out. Past the bound, with no bucket full again, new tenants share
one overflow bucket of the default limit until a bucket can go: a flood of new names gets one tenant's rate.
"""

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pipecast.core.settings import Settings, TenantLimit
from pipecast.router.errors import TenantAuthError, TenantNameError
from pipecast.router.fairness import TOKEN_TOLERANCE

DEFAULT_TENANT = "default"
TENANT_HEADER: str = Settings.model_fields["router_tenant_header"].default
AUTHORIZATION = "Authorization"
#: Default-limit buckets kept before the full ones are dropped (a full bucket is a fresh one): tenant names in a
#: header are whatever clients send, so they must not grow the router's memory without bound. Past it, with none
#: full again, new tenants share the overflow bucket (module docstring).
MAX_BUCKETS = 4096
#: The least time (s) between two scans of a full set of buckets for ones full again: a scan costs O(MAX_BUCKETS),
#: and new names arriving in between go to the overflow bucket at O(1) each.
SCAN_INTERVAL_S = 1.0
#: A tenant header's value: printable text of at most this many characters (it names metrics' labels).
MAX_TENANT_CHARS = 128
#: The longest ``Retry-After`` told to a refused client: a slow tenant rate would tell it to come back in a day,
#: and a client holding back that long is better off asking again (a request refused costs the router little).
MAX_RETRY_AFTER_S = 3600


@dataclass(frozen=True)
class AdmissionConfig:
    """Who the tenants are and their limits (settings ``router_*``; see the README's configuration)."""

    limits: Mapping[str, TenantLimit] = field(default_factory=dict)
    #: The limit of tenants not in ``limits``; None: they are unlimited.
    default_limit: TenantLimit | None = None
    #: API key -> tenant; empty: tenants are named by ``tenant_header``. Secrets: kept out of the repr.
    api_keys: Mapping[str, str] = field(default_factory=dict, repr=False)
    tenant_header: str = TENANT_HEADER

    def limit_of(self, tenant: str) -> TenantLimit | None:
        """The limit ``tenant`` is held to, None when it is unlimited."""
        return self.limits.get(tenant, self.default_limit)

    def tenant_of(self, headers: Mapping[str, str]) -> str:
        """The tenant of a request with ``headers`` (case-insensitive, as aiohttp's are).

        Raises :class:`TenantAuthError` when API keys are set and the request has none the router knows, and
        :class:`TenantNameError` for a tenant header that is no printable text of at most MAX_TENANT_CHARS.
        """
        if not self.api_keys:
            tenant = headers.get(self.tenant_header) or DEFAULT_TENANT
            # isprintable: no control characters, nor the surrogates a non-UTF-8 header decodes to
            if len(tenant) > MAX_TENANT_CHARS or not tenant.isprintable():
                raise TenantNameError(self.tenant_header, MAX_TENANT_CHARS)
            return tenant
        scheme, _, key = headers.get(AUTHORIZATION, "").strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise TenantAuthError("missing API key")
        tenant = self.api_keys.get(key)
        if tenant is None:
            raise TenantAuthError("unknown API key")
        return tenant


@dataclass(frozen=True)
class Admission:
    """The answer to one request: admitted, or refused until ``retry_after_s`` from now."""

    tenant: str
    admitted: bool
    limit: TenantLimit | None = None
    retry_after_s: float = 0.0

    @property
    def retry_after_header(self) -> int:
        """The ``Retry-After`` value of a refusal: whole seconds, rounded up, at least 1 and at most
        MAX_RETRY_AFTER_S."""
        # capped before the rounding: math.ceil of an infinite wait raises OverflowError
        return max(1, math.ceil(min(self.retry_after_s, MAX_RETRY_AFTER_S)))


@dataclass
class TokenBucket:
    """``limit.burst`` tokens at most, refilled at ``limit.rate`` per second since ``updated``."""

    limit: TenantLimit
    tokens: float
    updated: float

    def refill(self, now: float) -> None:
        """Add the tokens earned since the last update (never beyond the burst)."""
        self.tokens = min(float(self.limit.burst), self.tokens + (now - self.updated) * self.limit.rate)
        self.updated = now

    def take(self, now: float) -> float:
        """Take one token at ``now``: 0.0 when there was one, else the seconds until one is back."""
        self.refill(now)
        if self.tokens >= 1.0 - TOKEN_TOLERANCE:  # a client back when told is not refused over float rounding
            self.tokens = max(self.tokens - 1.0, 0.0)
            return 0.0
        return (1.0 - self.tokens) / self.limit.rate


class AdmissionControl:
    """The token buckets of every limited tenant; :meth:`admit` decides each request."""

    def __init__(self, config: AdmissionConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self._named: dict[str, TokenBucket] = {}  # tenants of config.limits: never dropped
        self._buckets: dict[str, TokenBucket] = {}  # tenants held to the default limit, at most MAX_BUCKETS
        #: The bucket new default-limit tenants share while there is no room (module docstring).
        self._overflow: TokenBucket | None = None
        self._scan_at = -math.inf  # no scan for buckets full again before this clock time

    def admit(self, tenant: str) -> Admission:
        """Admit a request of ``tenant`` now (taking a token of its bucket), or refuse it."""
        limit = self.config.limit_of(tenant)
        if limit is None:
            return Admission(tenant, admitted=True)
        now = self.clock()
        wait_s = self._bucket(tenant, limit, now).take(now)
        return Admission(tenant, admitted=wait_s == 0.0, limit=limit, retry_after_s=wait_s)

    def _bucket(self, tenant: str, limit: TenantLimit, now: float) -> TokenBucket:
        if tenant in self.config.limits:
            bucket = self._named.get(tenant)
            if bucket is None:
                bucket = self._named[tenant] = TokenBucket(limit, float(limit.burst), now)
            return bucket
        bucket = self._buckets.get(tenant)
        if bucket is None and self._has_room(limit, now):
            bucket = self._buckets[tenant] = TokenBucket(limit, float(limit.burst), now)
        elif bucket is None:
            if self._overflow is None:
                self._overflow = TokenBucket(limit, float(limit.burst), now)
            bucket = self._overflow
        return bucket

    def _has_room(self, limit: TenantLimit, now: float) -> bool:
        """Whether a new bucket of the default ``limit`` fits, after dropping those full again if it would not (a
        scan at most every SCAN_INTERVAL_S, and none before the first one could be full again)."""
        if len(self._buckets) < MAX_BUCKETS:
            return True
        if now < self._scan_at:
            return False
        soonest = 1.0 / limit.rate  # a bucket made from now on has given a token: full again no sooner
        for tenant, bucket in list(self._buckets.items()):
            bucket.refill(now)
            if bucket.tokens >= bucket.limit.burst:
                del self._buckets[tenant]
            else:
                soonest = min(soonest, (bucket.limit.burst - bucket.tokens) / bucket.limit.rate)
        self._scan_at = now + max(soonest, SCAN_INTERVAL_S)
        return len(self._buckets) < MAX_BUCKETS

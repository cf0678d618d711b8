"""Rate limits per role and per client identity: token buckets checked before any engine work.

`security.rate_limits` in the YAML gives each role (`monitor`, `operator`, `engineer`, `security_admin`: one bucket
shared by every client of that role) and each client identity (`per_client`: one bucket per certificate + user) a
refill rate in calls per second and a burst. A call is allowed only when every bucket that applies holds a token,
and then takes one from each; a refused call takes none, so a client over its own limit does not drain its role's
bucket. The caller answers a refusal with BadTooManyOperations and counts it (`appliance_rate_limited_total{role}`).

Runs on the event loop: no locks. Torch-free, numpy-free.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from core.config import RateLimit, RateLimitsConfig

ROLE_BUCKETS = ("monitor", "operator", "engineer", "security_admin")  # security.rate_limits' role keys
MAX_TRACKED_CLIENTS = 10_000  # per-client buckets kept; see RateLimiter._client_bucket
# A client calling exactly at its rate must not be refused for float rounding of elapsed time (0.1 s steps of a
# clock at 1000 s sum to 0.0999999...)
TOKEN_EPSILON = 1e-9


@dataclass
class TokenBucket:
    """`burst` tokens at most, refilled at `rate` per second; starts full."""

    rate: float
    burst: int
    tokens: float
    updated: float

    @classmethod
    def full(cls, limit: RateLimit, now: float) -> "TokenBucket":
        return cls(limit.calls_per_s, limit.burst, float(limit.burst), now)

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.tokens = min(float(self.burst), self.tokens + (now - self.updated) * self.rate)
        self.updated = max(self.updated, now)  # a clock that steps back never adds tokens


class RateLimiter:
    """`allow(role, client)` -> True when the call may go on (and its tokens are taken)."""

    def __init__(self, limits: RateLimitsConfig, clock: Callable[[], float] = time.monotonic,
                 max_clients: int = MAX_TRACKED_CLIENTS):
        self.limits, self.clock, self.max_clients = limits, clock, max_clients
        now = clock()
        self._roles = {role: TokenBucket.full(limit, now) for role in ROLE_BUCKETS
                       if (limit := getattr(limits, role)) is not None}
        self._clients: OrderedDict[str, TokenBucket] = OrderedDict()
        self.refused: dict[str, int] = {}  # role -> calls refused, for appliance_rate_limited_total{role}

    @property
    def enabled(self) -> bool:
        return bool(self._roles) or self.limits.per_client is not None

    def allow(self, role: str, client: str) -> bool:
        if not self.enabled:
            return True
        now = self.clock()
        buckets = [b for b in (self._roles.get(role), self._client_bucket(client, now)) if b is not None]
        for bucket in buckets:
            bucket.refill(now)
        if any(bucket.tokens < 1.0 - TOKEN_EPSILON for bucket in buckets):
            self.refused[role] = self.refused.get(role, 0) + 1
            return False
        for bucket in buckets:
            bucket.tokens = max(0.0, bucket.tokens - 1.0)
        return True

    def _client_bucket(self, client: str, now: float) -> TokenBucket | None:
        """The client's bucket, most recently used last. Beyond max_clients the least recently used one is
        dropped: a bucket that has refilled is the same as a new one, so nothing is lost unless more than
        max_clients identities called within one refill time (then the dropped client starts full again)."""
        limit = self.limits.per_client
        if limit is None:
            return None
        bucket = self._clients.get(client)
        if bucket is None:
            bucket = self._clients[client] = TokenBucket.full(limit, now)
            while len(self._clients) > self.max_clients:
                self._clients.popitem(last=False)
        else:
            self._clients.move_to_end(client)
        return bucket

    def tracked_clients(self) -> int:
        return len(self._clients)

"""Token-bucket rate limits per role and per client identity, driven by a fake clock."""
from __future__ import annotations

import pytest

from core.config import RateLimit, RateLimitsConfig, load_config_text
from appliance.rate_limit import RateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def limiter(clock: Clock, **limits) -> RateLimiter:
    return RateLimiter(RateLimitsConfig(**{k: RateLimit(*v) for k, v in limits.items()}), clock=clock)


def test_no_limits_configured_allows_everything():
    rl = RateLimiter(RateLimitsConfig(), clock=Clock())
    assert not rl.enabled and all(rl.allow("operator", "plc") for _ in range(10_000)) and rl.refused == {}


def test_a_client_gets_its_burst_at_once_then_the_refill_rate():
    clock = Clock()
    rl = limiter(clock, per_client=(10.0, 5))
    assert [rl.allow("operator", "plc-1") for _ in range(6)] == [True] * 5 + [False]
    clock.now += 0.1  # one token back
    assert [rl.allow("operator", "plc-1") for _ in range(2)] == [True, False]
    clock.now += 10  # refills to the burst, not beyond
    assert sum(rl.allow("operator", "plc-1") for _ in range(20)) == 5
    assert rl.refused == {"operator": 1 + 1 + 15}


def test_clients_have_their_own_buckets_but_share_their_roles():
    clock = Clock()
    rl = limiter(clock, operator=(1.0, 4), per_client=(100.0, 3))
    assert [rl.allow("operator", "a") for _ in range(4)] == [True, True, True, False]  # a's own burst is 3
    assert [rl.allow("operator", "b") for _ in range(2)] == [True, False]  # the role's 4th token, then empty
    assert rl.allow("engineer", "c")  # another role without a role limit: only c's own bucket applies
    assert rl.refused == {"operator": 2}


def test_a_refused_call_takes_no_token_from_any_bucket():
    clock = Clock()
    rl = limiter(clock, operator=(0.001, 2), per_client=(0.001, 1))
    assert rl.allow("operator", "a")
    assert not rl.allow("operator", "a")  # a's bucket is empty; the role still holds one token
    assert rl.allow("operator", "b")  # ... which b gets


def test_a_clock_that_steps_back_adds_no_tokens():
    clock = Clock()
    rl = limiter(clock, per_client=(1.0, 1))
    assert rl.allow("monitor", "a") and not rl.allow("monitor", "a")
    clock.now -= 100
    assert not rl.allow("monitor", "a")
    clock.now += 100.5
    assert not rl.allow("monitor", "a")  # 0.5 s after the last refill: half a token
    clock.now += 0.5
    assert rl.allow("monitor", "a")


def test_the_number_of_tracked_clients_is_bounded():
    clock = Clock()
    rl = RateLimiter(RateLimitsConfig(per_client=RateLimit(1.0, 1)), clock=clock, max_clients=100)
    for i in range(1000):
        assert rl.allow("operator", f"c{i}")
    assert rl.tracked_clients() == 100
    assert not rl.allow("operator", "c999")  # recent clients keep their (empty) buckets


def test_limits_come_from_the_yaml():
    cfg = load_config_text("security:\n  rate_limits:\n    monitor: {calls_per_s: 0.5, burst: 1}\n"
                           "models:\n  te: {kind: tensor, path: builtin:te-classifier}\n")
    clock = Clock()
    rl = RateLimiter(cfg.security.rate_limits, clock=clock)
    assert rl.allow("monitor", "x") and not rl.allow("monitor", "y")
    clock.now += 2
    assert rl.allow("monitor", "y") and rl.allow("operator", "z")


@pytest.mark.parametrize("calls", [1, 3])
def test_a_steady_rate_at_the_limit_is_never_refused(calls):
    clock = Clock()
    rl = limiter(clock, per_client=(10.0, calls))
    for _ in range(1000):
        assert all(rl.allow("operator", "plc") for _ in range(calls))
        clock.now += calls / 10.0

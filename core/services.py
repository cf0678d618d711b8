"""The domain services the OPC UA server is handed, as the server sees them. The daemon (appliance/daemon.py) builds
each from the configuration and passes them in one UaServices bundle; uaserver/ builds none and imports nothing of
appliance/. Each protocol lists only what the server calls; the implementations live in appliance/ (named below)."""
from __future__ import annotations

import datetime
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


class RateLimits(Protocol):
    """appliance/rate_limit.py RateLimiter: `security.rate_limits`, checked before any engine work."""

    def allow(self, role: str, client: str) -> bool: ...


class Job(Protocol):
    """appliance/jobs.py Job: one StartInfer / StartGenerate / StartTask of a caller's identity."""

    id: int
    owner: str
    model: str
    kind: str  # infer | generate | task:<name>
    result: Any
    error: Exception | None
    partial_text: str
    partial_tokens: int

    def progress(self, text: str, tokens: int) -> None: ...


class Jobs(Protocol):
    """appliance/jobs.py JobStore: the jobs of every caller, bounded per client, kept until read or expired."""

    on_ready: Callable[[Any], None] | None  # the server's JobResultReady event, set by the server

    def start(self, owner: str, model: str, kind: str, run: Callable[[Any], Awaitable[Any]]) -> Job: ...

    def get(self, owner: str, model: str, job_id: int) -> Job: ...

    async def wait(self, owner: str, model: str, job_id: int, wait_s: float) -> Job: ...

    def cancel(self, owner: str, model: str, job_id: int) -> None: ...

    def release(self, owner: str, model: str, job_id: int) -> None: ...

    def sweep(self) -> None: ...

    def counts(self) -> dict[tuple[str, str], int]: ...

    async def cancel_all(self) -> None: ...


class VariantRouting(Protocol):
    """appliance/variants.py VariantRouter: which A/B variant answers a caller (the identity travels down, the
    variant's name comes back), and Admin/PromoteVariant."""

    def variants(self, model: str) -> tuple[str, ...]:
        """The model's configured variants ((): it has none)."""

    def variant_for(self, model: str, identity: str) -> str:
        """The variant that serves this caller (a configured one or core.config.MAIN_VARIANT)."""

    def promote(self, model: str, variant: str | None) -> None: ...


class DriftState(Protocol):
    state: str  # Ok | Drifting | NoReference
    score: float
    feature: str
    since: datetime.datetime | None


class DriftWatch(Protocol):
    """appliance/drift.py DriftDetector: one tensor model's input drift against its reference."""

    status: DriftState

    def update(self, inputs: Any, probabilities: Any) -> DriftState: ...


class Classified(Protocol):
    class_index: list[int]
    label: list[str]
    confidence: list[float]


class ClassUpdate(Protocol):
    result: Classified
    raised: set[int]
    cleared: set[int]
    any_raised: set[int]
    any_cleared: set[int]


class Classifier(Protocol):
    """appliance/classify.py ClassifierState: one labelled model's classification and class alarms per source."""

    labels: list[str]
    alarm_classes: list[int]
    sources: list[str]

    def source_of(self, *, mailbox: str | None = None, identity: str | None = None) -> str: ...

    def update(self, output: Any, source: str = ...) -> ClassUpdate: ...


class CallChecks(Protocol):
    """appliance/call_checks.py CallChecks: the engine's own argument checks, so a job or task is refused at its
    start exactly as the synchronous call would be (the tokenizer's prompt rule included)."""

    def samples(self, values: Any, input_shape: Sequence[int], max_samples: int, first: int = 0) -> np.ndarray: ...

    def generate(self, prompt: Any, max_tokens: Any, temperature: Any, first: int = 0) -> str: ...

    def task_text(self, name: str, value: str, index: int) -> None: ...


@dataclass(frozen=True)
class UaServices:
    """What the daemon builds and the OPC UA server uses: one of each, built once from the configuration."""

    rate_limiter: RateLimits
    jobs: Jobs
    variants: VariantRouting
    drift: Mapping[str, DriftWatch]  # tensor model -> its detector (models with a drift reference)
    classifiers: Mapping[str, Classifier]  # tensor model with labels -> its state
    call_checks: CallChecks

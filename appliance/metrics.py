"""The Prometheus metrics of the contract, in one registry owned by the daemon (no process-global state).

Every metric is created here so that its HELP and TYPE lines are exposed from the start; labelled series appear
once they have a value. Engine parts receive the `Metrics` object and update it; nothing else registers metrics.
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
WATCHDOG_STATES = {"Ok": 0, "Warning": 1, "Critical": 2, "NoGpu": 3}


class _Series:
    def __init__(self, store: dict, key: tuple, lock: threading.Lock):
        self._store, self._key, self._lock = store, key, lock

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self._store[self._key] = self._store.get(self._key, 0.0) + amount


class _RequestsCounter:
    """appliance_requests_total{model,method,status} plus `variant` on the series of models with A/B variants:
    a family whose series differ in label names, which prometheus_client's Counter cannot hold."""

    name, documentation = "appliance_requests", "Method calls answered, by model, method and OPC UA status name " \
        "(and the A/B variant that answered, where the model has variants)"

    def __init__(self, registry):
        self._values: dict[tuple, float] = {}
        self._series: dict[tuple, _Series] = {}  # one view per label set, made once (every call counts one)
        self._lock = threading.Lock()
        registry.register(self)

    def labels(self, model: str, method: str, status: str, variant: str = "") -> _Series:
        key = (model, method, status, variant)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _Series(self._values, key, self._lock)
        return series

    def describe(self):
        return [Metric(self.name, self.documentation, "counter")]

    def collect(self):
        family = Metric(self.name, self.documentation, "counter")
        with self._lock:
            items = sorted(self._values.items())
        for (model, method, status, variant), value in items:
            labels = {"model": model, "method": method, "status": status}
            if variant:
                labels["variant"] = variant
            family.add_sample(self.name + "_total", labels, value)
        return [family]


class Metrics:
    def __init__(self, gpu_present: bool = False):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests_total = _RequestsCounter(registry=r)
        self.request_duration = Histogram(
            "appliance_request_duration_seconds", "Time from a method call's arrival to its answer",
            ["model", "method"], buckets=LATENCY_BUCKETS, registry=r)
        self._durations: dict[tuple[str, str], object] = {}  # request_duration's children (call_duration)
        self.queue_wait = Histogram(
            "appliance_queue_wait_seconds", "Time a request waited in the queue before its batch ran",
            ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram(
            "appliance_batch_size", "Samples (tensor models) or sequences (generative models) per executed batch",
            ["model"], buckets=BATCH_BUCKETS, registry=r)
        self.queue_depth = Gauge("appliance_queue_depth", "Requests waiting in the model's queue", ["model"],
                                 registry=r)
        self.kv_slots_total = Gauge("appliance_kv_slots_total", "KV-cache slots preallocated", registry=r)
        self.kv_slots_used = Gauge("appliance_kv_slots_used", "KV-cache slots owned by a session", registry=r)
        self.conversations_parked = Gauge(
            "appliance_conversations_parked", "Evicted conversations parked in host memory until their next call",
            registry=r)
        self.tokens_total = Counter("appliance_tokens", "Tokens processed, by kind (prompt | generated)",
                                    ["model", "kind"], registry=r)
        self.prefix_cache_hits_total = Counter(
            "appliance_prefix_cache_hits", "Conversations whose shared prompt head was copied from the prefix cache "
            "instead of computed", ["model"], registry=r)
        self.time_to_first_token = Histogram(
            "appliance_time_to_first_token_seconds", "Time from a Generate call's arrival to its first token",
            ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.ua_sessions = Gauge("appliance_ua_sessions", "OPC UA sessions open", registry=r)
        self.heartbeat_timestamp = Gauge(
            "appliance_heartbeat_timestamp_seconds", "Unix time of the appliance loop's last tick (1 Hz): a box whose "
            "loop stalled shows an old time while its other gauges keep their last values", registry=r)
        self.model_info = Gauge("appliance_model_info",
                                "1 for each loaded model, labelled with version, backend and weight format",
                                ["model", "version", "backend", "weight_format"], registry=r)
        self.model_ready = Gauge("appliance_model_ready", "1 when the model is Ready, else 0", ["model"], registry=r)
        self.watchdog_state = Gauge("appliance_watchdog_state", "Watchdog state: 0 Ok, 1 Warning, 2 Critical, 3 NoGpu",
                                    registry=r)
        self.server_cert_expiry = Gauge("appliance_server_certificate_expiry_seconds",
                                        "Seconds until the server certificate expires", registry=r)
        self.server_cert_expiring = Gauge("appliance_server_certificate_expiring",
                                          "1 when the server certificate expires within 30 days", registry=r)
        self.ca_crl_expiry = Gauge("appliance_ca_crl_expiry_seconds",
                                   "Seconds until the appliance CA's CRL passes its nextUpdate", registry=r)
        self.ca_crl_expiring = Gauge("appliance_ca_crl_expiring", "1 when the appliance CA's CRL passes its "
                                     "nextUpdate within security.cert_expiry_warning_days (not re-signed)", registry=r)
        self.worker_up = Gauge("appliance_worker_up", "1 while the model's worker process answers, else 0",
                               ["model"], registry=r)
        self.worker_cpu_share = Gauge("appliance_worker_cpu_share", "The CPU share (models.NAME.cpu_share) of the "
                                      "model's worker and how it is enforced: mechanism cgroup (cpu.weight), nice "
                                      "or off", ["model", "mechanism"], registry=r)
        self.worker_threads = Gauge("appliance_worker_threads", "Engine threads of the model's worker, sized to its "
                                    "CPU share (0: the library's default, all cores)", ["model"], registry=r)
        self.worker_restarts = Counter("appliance_worker_restarts", "Times the model's worker process was replaced",
                                       ["model"], registry=r)
        self.alarm_active = Gauge("appliance_alarm_active", "1 while the alarm is active (Objects/Appliance/Alarms)",
                                  ["alarm"], registry=r)
        self.drift_score = Gauge("appliance_drift_score", "Drift score of a tensor model's inputs (0: like the "
                                 "reference data; above the threshold: Drifting)", ["model"], registry=r)
        self.drift_state = Gauge("appliance_drift_state", "Drift state: 0 Ok, 1 Drifting, 2 NoReference", ["model"],
                                 registry=r)
        self.fallback = Counter("appliance_fallback", "Calls answered by a model's fallback, by reason "
                                "(not_ready | restarting | deadline)", ["model", "reason"], registry=r)
        self.jobs = Gauge("appliance_jobs", "Unreleased jobs by state (running | done | failed)", ["model", "state"],
                          registry=r)
        self.rate_limited = Counter("appliance_rate_limited", "Calls refused with BadTooManyOperations by a rate limit",
                                    ["role"], registry=r)
        self.audit_errors = Counter("appliance_audit_write_errors", "Audit records that could not be written",
                                    registry=r)
        # sources (YAML `sources`): the appliance as a client of the line's OPC UA servers
        self.source_state = Gauge("appliance_source_state", "A source's state: 0 Connected, 1 Connecting, 2 BadData, "
                                  "3 Refused, 4 Disabled", ["source"], registry=r)
        self.source_samples = Counter("appliance_source_samples", "Samples received from a source", ["source"],
                                      registry=r)
        self.source_reconnects = Counter("appliance_source_reconnects", "Times a source was connected again after "
                                         "a loss", ["source"], registry=r)
        self.source_windows = Counter("appliance_source_windows", "A feed's windows by outcome (run | dropped: the "
                                      "model was busy | failed: the model refused it)", ["feed", "outcome"], registry=r)
        self.source_windows_skipped = Counter("appliance_source_windows_skipped", "Windows not run because of the "
                                              "data (bad, uncertain, type, missing, stale, gap)", ["source", "reason"],
                                              registry=r)
        self.source_delay = Histogram("appliance_source_delay_seconds", "From a window's last SourceTimestamp to its "
                                      "result in the address space", ["feed"], registry=r,
                                      buckets=(0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5,
                                               1, 2.5, 5, 10))
        self.source_process_restarts = Counter("appliance_source_process_restarts", "Times the sources client process "
                                               "was replaced", registry=r)
        self.gpu_present = gpu_present
        if gpu_present:
            self.gpu_temperature = Gauge("appliance_gpu_temperature_celsius", "GPU temperature", ["gpu"], registry=r)
            self.gpu_memory_used = Gauge("appliance_gpu_memory_used_bytes", "GPU memory in use", ["gpu"], registry=r)
            self.gpu_utilization = Gauge("appliance_gpu_utilization_ratio", "GPU busy fraction", ["gpu"], registry=r)
            self.gpu_ecc_errors = Gauge("appliance_gpu_ecc_errors", "Uncorrected ECC errors since boot", ["gpu"],
                                        registry=r)
            self.gpu_power = Gauge("appliance_gpu_power_watts", "GPU power draw", ["gpu"], registry=r)

    def call_duration(self, model: str, method: str):
        """appliance_request_duration_seconds{model,method}: its child looked up once per label pair (every call
        observes one; no series of it is ever removed)."""
        child = self._durations.get((model, method))
        if child is None:
            child = self._durations[(model, method)] = self.request_duration.labels(model, method)
        return child

    def count_request(self, model: str, method: str, status: str, variant: str = "") -> None:
        """appliance_requests_total; with a `variant` label where the model has A/B variants (the contract)."""
        self.requests_total.labels(model, method, status, variant).inc()

    def set_model_info(self, model: str, version: str, backend: str) -> None:
        # One series per model: drop the old version's series on reload.
        for labels in [s.labels for fam in self.model_info.collect() for s in fam.samples]:
            if labels.get("model") == model:
                self.model_info.remove(labels["model"], labels["version"], labels["backend"],
                                       labels["weight_format"])
        self.model_info.labels(model, version, backend, weight_format_of(backend)).set(1)

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """Prometheus text; OpenMetrics (with the latency histogram's exemplars: the calls' correlation ids) when
        the scraper asks for it (Prometheus does with exemplar storage on)."""
        if "application/openmetrics-text" in accept:
            from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OM_TYPE
            from prometheus_client.openmetrics.exposition import generate_latest as om_latest
            return om_latest(self.registry), OM_TYPE
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def weight_format_of(backend: str) -> str:
    """The weight format a generative model's Backend names (appliance/engine/llm/weight_plan.py writes
    "<device> <format>: <how>", e.g. "cpu Q4_K+Q6_K/int8: ..."); "" for backends that name none (tensor models)."""
    head, sep, _ = backend.partition(": ")
    device, _, fmt = head.partition(" ")
    return fmt if sep and device in ("cpu", "cuda") and fmt else ""

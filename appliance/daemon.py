"""`appliance serve`: wires configuration, PKI, engine services, OPC UA server and monitoring together.

Start order: PKI (created on first start), metrics, audit, accounts, watchdog, OPC UA server (State Starting),
monitoring HTTP, then the models load in the background; each turns Ready on its own. Stop order is the reverse,
and every session's KV slot is freed before the engine stops.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import socket
from pathlib import Path
from urllib.parse import urlparse

from .config import ApplianceConfig
from .metrics import Metrics

log = logging.getLogger(__name__)


def certificate_names(config: ApplianceConfig) -> tuple[list[str], list[str]]:
    """Host names and IPs for the server certificate's SubjectAltName."""
    hostnames = {"localhost", socket.gethostname()}
    try:
        hostnames.add(socket.getfqdn())
    except OSError:
        pass
    hostnames.update(config.server.dns_names)
    ips = {"127.0.0.1"}
    ips.update(config.server.ip_addresses)
    for host in (urlparse(config.server.endpoint).hostname, config.server.advertised_host):
        if not host:
            continue
        try:
            ip = ipaddress.ip_address(host)
            if not ip.is_unspecified:
                ips.add(str(ip))
        except ValueError:
            hostnames.add(host)
    try:
        for ip in socket.gethostbyname_ex(socket.gethostname())[2]:
            ips.add(ip)
    except OSError:
        pass
    return sorted(hostnames), sorted(ips)


def resolve_device(requested: str) -> str:
    """'cpu' or 'cuda:N NAME'; torch is only asked when CUDA could be meant."""
    if requested == "cpu":
        return "cpu"
    try:
        import torch
        if torch.cuda.is_available():
            index = int(requested.split(":")[1]) if ":" in requested else 0
            return f"cuda:{index} {torch.cuda.get_device_name(index)}"
    except Exception:
        pass
    if requested.startswith("cuda"):
        log.warning("CUDA was asked for but is not available; running on the CPU")
    return "cpu"


class Appliance:
    def __init__(self, config: ApplianceConfig):
        self.config = config
        self.services: dict = {}
        self.ua = None
        self.http = None
        self.watchdog = None
        self.audit = None
        self.metrics: Metrics | None = None
        self._tasks: list[asyncio.Task] = []

    def build_services(self, device: str) -> dict:
        from .engine.batcher import BatchPolicy
        from .engine.tensor_service import TensorModelService

        eng = self.config.engine
        services = {}
        for name, m in self.config.models.items():
            on_event = self._model_event(name)
            if m.kind == "tensor":
                policy = BatchPolicy(max_batch_size=m.max_batch_size or eng.max_batch_size,
                                     max_queue_delay_s=(m.max_queue_delay_ms if m.max_queue_delay_ms is not None
                                                        else eng.max_queue_delay_ms) / 1000.0,
                                     max_queue_size=eng.max_queue_size)
                services[name] = TensorModelService(
                    name, m.resolved_path, backend=m.backend, device=device.split(" ")[0], threads=eng.threads,
                    version_label=m.version, max_samples=m.max_samples, policy=policy, metrics=self.metrics,
                    on_event=on_event)
            else:
                from .engine.llm_service import GenerativeModelService, GenerativeSettings
                settings = GenerativeSettings(
                    kv_slots=eng.kv_slots, max_seq_len=eng.max_seq_len, max_new_tokens=eng.max_new_tokens,
                    slot_policy=eng.slot_policy, prefill_chunk=eng.prefill_chunk, dtype=eng.dtype,
                    device=device.split(" ")[0], threads=eng.threads, seed=eng.seed,
                    max_text_chars=m.max_text_chars, system_prompt=m.system_prompt, top_p=m.top_p,
                    max_queue_size=eng.max_queue_size)
                services[name] = GenerativeModelService(name, m.resolved_path, settings, version_label=m.version,
                                                        metrics=self.metrics, on_event=on_event)
        return services

    def _model_event(self, name: str):
        def on_event(kind: str, message: str) -> None:
            log.warning("model %s: %s: %s", name, kind, message)
            if self.audit is not None:
                self.audit.record(action=kind, session="", client="", user="appliance", role="", model=name,
                                  status="BadInternalError", detail=message)
            if self.ua is not None:
                self.ua.emit_event(f"Model {name}: {kind}: {message}", severity=800)
        return on_event

    def readiness(self) -> tuple[bool, list[str]]:
        reasons = [f"model {n} is {s.state}" for n, s in self.services.items() if s.state != "Ready"]
        if self.ua is None or self.ua.server is None:
            reasons.append("OPC UA server is not running")
        if self.watchdog is not None and self.watchdog.state == "Critical":
            reasons.append("watchdog is Critical")
        if not self.engine_alive():
            reasons.append("an engine thread has stopped")
        return (not reasons), reasons

    def engine_alive(self) -> bool:
        """Every Ready model's engine thread runs (the Heartbeat stops when one does not)."""
        return all(getattr(s, "engine_alive", True) for s in self.services.values() if s.state == "Ready")

    def health(self) -> dict:
        wd = self.watchdog
        if wd is None:
            return {"WatchdogState": "NoGpu", "GpuTemperatureC": 0.0, "GpuMemoryUsedBytes": 0, "GpuEccErrors": 0}
        return {"WatchdogState": wd.state, "GpuTemperatureC": wd.temperature_c,
                "GpuMemoryUsedBytes": wd.memory_used_bytes, "GpuEccErrors": wd.ecc_errors}

    async def start(self) -> None:
        from certs.pki import PKI
        from certs.validate import TrustList
        from uaserver.server import ApplianceUaServer

        from .audit import AuditLog
        from .http_server import MonitoringServer
        from .users import UserStore
        from .watchdog import Watchdog, make_backend

        cfg = self.config
        state_dir = Path(cfg.server.state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        pki = PKI(state_dir)
        hostnames, ips = certificate_names(cfg)
        if pki.ensure(cfg.server.application_uri, hostnames, ips):
            log.info("created the appliance CA and server certificate in %s", state_dir / "pki")
        trust_list = TrustList(state_dir / "pki")

        device = resolve_device(cfg.engine.device)
        backend = make_backend(cfg.watchdog.backend)
        self.metrics = Metrics(gpu_present=backend is not None)
        self._watch_certificate(pki)
        if cfg.audit.enabled:
            audit_path = Path(cfg.audit.path) if cfg.audit.path else state_dir / "audit" / "audit.jsonl"
            self.audit = AuditLog(audit_path, max_bytes=cfg.audit.max_bytes, keep_files=cfg.audit.keep_files,
                                  metrics=self.metrics)
        users = UserStore(state_dir, [(u.name, u.role, u.password_hash) for u in cfg.users],
                          backoff_s=cfg.security.login_backoff_s, backoff_max_s=cfg.security.login_backoff_max_s)
        wd = cfg.watchdog
        self.watchdog = Watchdog(backend, temperature_warning_c=wd.temperature_warning_c,
                                 temperature_critical_c=wd.temperature_critical_c,
                                 memory_warning_ratio=wd.memory_warning_ratio, metrics=self.metrics,
                                 on_event=self._watchdog_event)
        self.watchdog.poll()
        self._tasks.append(asyncio.create_task(self.watchdog.run(wd.interval_s)))

        self.services = self.build_services(device)
        self.ua = ApplianceUaServer(cfg, pki=pki, trust_list=trust_list, user_store=users, services=self.services,
                                    metrics=self.metrics, audit=self.audit, device=device, health=self.health,
                                    engine_alive=self.engine_alive)
        await self.ua.start()
        if self.metrics.server_cert_expiring._value.get():
            self.ua.emit_event("The server certificate expires within "
                               f"{cfg.security.cert_expiry_warning_days} days: renew it with "
                               "`appliance certs init --force`", severity=700)
        if cfg.metrics.enabled:
            self.http = MonitoringServer(cfg.metrics.host, cfg.metrics.port, self.metrics, self.readiness)
            await self.http.start()
        for svc in self.services.values():
            self._tasks.append(asyncio.create_task(svc.start()))

    def _watch_certificate(self, pki) -> None:
        from datetime import datetime, timezone
        left = (pki.server_cert_not_after() - datetime.now(timezone.utc)).total_seconds()
        self.metrics.server_cert_expiry.set(left)
        expiring = left < self.config.security.cert_expiry_warning_days * 86400
        self.metrics.server_cert_expiring.set(1 if expiring else 0)
        if expiring:
            log.warning("the server certificate expires in %.0f days: renew it (appliance certs init --force)",
                        left / 86400)

    def _watchdog_event(self, state: str, previous: str, message: str) -> None:
        log.warning("watchdog %s -> %s: %s", previous, state, message)
        if self.ua is not None:
            self.ua.emit_event(f"Watchdog {state}: {message}", severity=900 if state == "Critical" else 600)

    async def wait_ready(self, timeout: float = 120.0) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while loop.time() < end:
            if all(s.state != "Loading" for s in self.services.values()):
                return
            await asyncio.sleep(0.05)
        raise TimeoutError("models did not finish loading")

    async def stop(self) -> None:
        if self.ua is not None:
            await self.ua.stop()  # closes sessions first: their slots are freed
        if self.http is not None:
            await self.http.stop()
        for svc in self.services.values():
            try:
                await svc.stop()
            except Exception:
                log.exception("stopping a model failed")
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.watchdog is not None and getattr(self.watchdog, "backend", None) is not None:
            try:
                self.watchdog.backend.close()
            except Exception:
                pass


def configure_logging(config: ApplianceConfig) -> None:
    level = getattr(logging, config.logging.level)
    if config.logging.format == "json":
        import json

        class JsonFormatter(logging.Formatter):
            def format(self, record):
                return json.dumps({"time": self.formatTime(record), "level": record.levelname,
                                   "logger": record.name, "message": record.getMessage()})
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter())
        logging.basicConfig(level=level, handlers=[handler], force=True)
    else:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    # asyncua logs every request at INFO.
    logging.getLogger("asyncua").setLevel(max(level, logging.WARNING))


async def serve(config: ApplianceConfig) -> int:
    import sys
    # The event loop shares the GIL with the inference and audit threads; after a blocking call (a socket send)
    # it waits up to the switch interval to get the GIL back. 5 ms by default is longer than a whole call here.
    sys.setswitchinterval(0.0005)
    app = Appliance(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    await app.start()
    print(f"appliance: OPC UA on {config.server.endpoint}"
          + (f", monitoring on http://{config.metrics.listen}" if config.metrics.enabled else "")
          + f", state in {config.server.state_dir}", flush=True)
    try:
        await stop.wait()
    finally:
        await app.stop()
    return 0
